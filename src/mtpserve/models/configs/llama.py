"""llama: the config read from a GGUF file's metadata (the blocks and the model are in models/llama.py). Kept
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

ARCHES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    n_rot: int
    rope_base: float
    rope_neox: bool  # half-split pairs (qwen2/qwen3) rather than adjacent pairs (llama)
    rope_scale: float  # linear scaling factor (1 = none)
    qk_norm: bool  # qwen3: per-head RMSNorm on q and k before RoPE
    qkv_bias: bool  # qwen2: biases on q, k and v
    context_length: int
    tied_embeddings: bool

    @classmethod
    def from_metadata(cls, md: Metadata, tensor_names: Collection[str]) -> LlamaConfig:
        hp = common_hparams(md)
        p, n_layer = hp["architecture"], hp.pop("block_count")
        if md.get_int(f"{p}.expert_count", 0):
            raise GGUFError(md.source, f"mixture-of-experts {p} models are not supported")
        scaling = md.get_str(f"{p}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise GGUFError(md.source, f"rope scaling '{scaling}' is not supported yet")
        return cls(
            **hp,
            n_layer=n_layer,
            n_rot=md.get_int(f"{p}.rope.dimension_count", hp["head_dim"]),
            rope_neox=p != "llama",
            rope_scale=md.get_float(f"{p}.rope.scaling.factor", 1.0) if scaling == "linear" else 1.0,
            qk_norm=p == "qwen3",
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            tied_embeddings="output.weight" not in tensor_names,
        )

    def layer_kinds(self) -> list[str]:
        return ["attention"] * self.n_layer

    def mtp_layers(self) -> list[int]:
        return []

    def tensor_specs(self) -> list[TensorSpec]:
        E, V, F = self.n_embd, self.n_vocab, self.n_ff
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        specs = lm_tensor_specs(V, E)
        for i in range(self.n_layer):
            b = f"blk.{i}"
            specs += [TensorSpec(f"{b}.attn_norm.weight", (E,)), TensorSpec(f"{b}.ffn_norm.weight", (E,))]
            specs += attention_specs(b, E, H * hd, Hkv * hd, H * hd, qk_norm=hd if self.qk_norm else 0)
            specs += ffn_specs(b, E, F)
            if self.qkv_bias:
                specs += [
                    TensorSpec(f"{b}.attn_q.bias", (H * hd,)),
                    TensorSpec(f"{b}.attn_k.bias", (Hkv * hd,)),
                    TensorSpec(f"{b}.attn_v.bias", (Hkv * hd,)),
                ]
        return specs

    def cache_layout(self) -> CacheLayout:
        return CacheLayout(
            tuple(AttentionCacheSpec(i, self.n_head_kv, self.head_dim, self.head_dim) for i in range(self.n_layer)), ()
        )
