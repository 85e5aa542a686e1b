"""gemma3: the config read from a GGUF file's metadata (the blocks and the model are in models/gemma3.py). Kept
apart from them so that reading a file's metadata (inspect, doctor, the memory plan) imports no PyTorch."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ...gguf import GGUFError, Metadata
from ..config import (
    AttentionCacheSpec,
    CacheLayout,
    TensorSpec,
    attention_specs,
    common_hparams,
    ffn_specs,
    lm_tensor_specs,
)

ARCH = "gemma3"
DEFAULT_SWA_PERIOD = 6  # llama.cpp: every 6th layer is global, the rest use the sliding window
DEFAULT_ROPE_BASE_SWA = 10000.0


@dataclass(frozen=True)
class Gemma3Config:
    architecture: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_base: float  # global layers
    rope_base_swa: float  # sliding-window layers
    rope_scale: float  # linear scaling factor of the global layers (1 = none)
    sliding_window: int | None
    is_swa: tuple[bool, ...]
    final_logit_softcap: float  # 0 = none
    context_length: int
    tied_embeddings: bool

    @classmethod
    def from_metadata(cls, md: Metadata, tensor_names: Collection[str]) -> Gemma3Config:
        hp = common_hparams(md)
        p, n_layer = hp["architecture"], hp.pop("block_count")
        window = md.get_int(f"{p}.attention.sliding_window", 0)
        pattern_key = f"{p}.attention.sliding_window_pattern"
        if window <= 0:
            is_swa = [False] * n_layer
        elif pattern_key in md and not isinstance(md.values[pattern_key], int):
            is_swa = md.get_bool_list(pattern_key)
            if len(is_swa) != n_layer:
                raise GGUFError(md.source, f"{pattern_key} has {len(is_swa)} entries for {n_layer} layers")
        else:
            period = md.get_int(pattern_key, DEFAULT_SWA_PERIOD)
            is_swa = [period == 0 or i % period < period - 1 for i in range(n_layer)]
        scaling = md.get_str(f"{p}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise GGUFError(md.source, f"rope scaling '{scaling}' is not supported for gemma3")
        return cls(
            **hp,
            n_layer=n_layer,
            rope_base_swa=md.get_float(f"{p}.rope.freq_base_swa", DEFAULT_ROPE_BASE_SWA),
            rope_scale=md.get_float(f"{p}.rope.scaling.factor", 1.0) if scaling == "linear" else 1.0,
            sliding_window=window if window > 0 else None,
            is_swa=tuple(is_swa),
            final_logit_softcap=md.get_float(f"{p}.final_logit_softcapping", 0.0),
            tied_embeddings="output.weight" not in tensor_names,
        )

    def layer_kinds(self) -> list[str]:
        return ["sliding_attention" if swa else "attention" for swa in self.is_swa]

    def mtp_layers(self) -> list[int]:
        return []

    def tensor_specs(self) -> list[TensorSpec]:
        E, V, F = self.n_embd, self.n_vocab, self.n_ff
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        specs = lm_tensor_specs(V, E)
        for i in range(self.n_layer):
            b = f"blk.{i}"
            norms = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
            specs += [TensorSpec(f"{b}.{norm}.weight", (E,)) for norm in norms]
            specs += attention_specs(b, E, H * hd, Hkv * hd, H * hd, qk_norm=hd)
            specs += ffn_specs(b, E, F)
        return specs

    def cache_layout(self) -> CacheLayout:
        attention = tuple(
            AttentionCacheSpec(i, self.n_head_kv, self.head_dim, self.head_dim, self.sliding_window if swa else None)
            for i, swa in enumerate(self.is_swa)
        )
        return CacheLayout(attention, ())
