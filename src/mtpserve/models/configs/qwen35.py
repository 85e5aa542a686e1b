"""qwen35: the config read from a GGUF file's metadata (the blocks and the model are in models/qwen35.py). Kept
apart from them so that reading a file's metadata (inspect, doctor, the memory plan) imports no PyTorch."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...gguf import GGUFError, Metadata
from ..config import (
    AttentionCacheSpec,
    CacheLayout,
    RecurrentStateSpec,
    TensorSpec,
    attention_specs,
    common_hparams,
    common_metadata,
    ffn_specs,
    lm_tensor_specs,
)

ARCH = "qwen35"


@dataclass(frozen=True)
class Qwen35Config:
    architecture: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk depth = block_count - nextn_predict_layers
    n_nextn: int  # MTP blocks, stored as blk.{n_layer}..
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length (== value_length)
    rms_eps: float
    n_rot: int  # rotated dims per head (partial rotary)
    rope_base: float
    rope_sections: tuple[int, int, int, int]
    context_length: int
    d_conv: int  # ssm.conv_kernel
    ssm_head_dim: int  # ssm.state_size: dk == dv
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    recurrent: tuple[bool, ...]  # per block, including MTP blocks (never recurrent)
    tied_embeddings: bool  # no output.weight: the LM head is token_embd

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.ssm_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.ssm_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_metadata(cls, md: Metadata, tensor_names: Collection[str]) -> Qwen35Config:
        hp = common_hparams(md)
        p, n_layer_all = hp["architecture"], hp.pop("block_count")
        n_nextn = md.get_int(f"{p}.nextn_predict_layers", 0)
        if not 0 <= n_nextn <= 1 or n_nextn >= n_layer_all:
            raise GGUFError(md.source, f"{p}.nextn_predict_layers = {n_nextn}: only 0 or 1 MTP block is supported")
        n_layer = n_layer_all - n_nextn
        sections = md.get_int_list(f"{p}.rope.dimension_sections")
        if len(sections) != 4:
            raise GGUFError(md.source, f"{p}.rope.dimension_sections must have 4 entries, got {sections}")
        if f"{p}.attention.recurrent_layers" in md:
            recurrent = md.get_bool_list(f"{p}.attention.recurrent_layers")
            if len(recurrent) != n_layer_all:
                raise GGUFError(
                    md.source, f"{p}.attention.recurrent_layers has {len(recurrent)} entries for {n_layer_all} blocks"
                )
        else:
            interval = md.get_int(f"{p}.full_attention_interval", 4)
            recurrent = [i < n_layer and (i + 1) % interval != 0 for i in range(n_layer_all)]
        if any(recurrent[n_layer:]):
            raise GGUFError(md.source, "an MTP block is marked recurrent")
        n_v_heads = md.get_int(f"{p}.ssm.time_step_rank")
        ssm_head_dim = md.get_int(f"{p}.ssm.state_size")
        inner = md.get_int(f"{p}.ssm.inner_size")
        if inner != n_v_heads * ssm_head_dim:
            raise GGUFError(
                md.source, f"ssm.inner_size {inner} != time_step_rank {n_v_heads} x state_size {ssm_head_dim}"
            )
        n_k_heads = md.get_int(f"{p}.ssm.group_count")
        if n_k_heads <= 0 or n_v_heads % n_k_heads:
            raise GGUFError(md.source, f"ssm.time_step_rank {n_v_heads} is not a multiple of group_count {n_k_heads}")
        return cls(
            **hp,
            n_layer=n_layer,
            n_nextn=n_nextn,
            n_rot=md.get_int(f"{p}.rope.dimension_count", hp["head_dim"]),
            rope_sections=tuple(sections),  # type: ignore[arg-type]
            d_conv=md.get_int(f"{p}.ssm.conv_kernel"),
            ssm_head_dim=ssm_head_dim,
            n_k_heads=n_k_heads,
            n_v_heads=n_v_heads,
            recurrent=tuple(recurrent),
            tied_embeddings="output.weight" not in tensor_names,
        )

    def metadata(self) -> dict[str, Any]:
        """The keys from_metadata reads (and llama.cpp's qwen35 loader), with this config's values; the tokenizer's
        keys aside. For writing a file of these shapes (bench/gpu.py's random model, for llama.cpp to read)."""
        p = self.architecture
        first_attention = self.recurrent.index(False) if False in self.recurrent else self.n_layer
        return {
            **common_metadata(self, self.n_layer + self.n_nextn),
            f"{p}.nextn_predict_layers": self.n_nextn,
            f"{p}.rope.dimension_count": self.n_rot,
            f"{p}.rope.dimension_sections": np.array(self.rope_sections, dtype=np.int32),
            f"{p}.ssm.conv_kernel": self.d_conv,
            f"{p}.ssm.state_size": self.ssm_head_dim,
            f"{p}.ssm.group_count": self.n_k_heads,
            f"{p}.ssm.time_step_rank": self.n_v_heads,
            f"{p}.ssm.inner_size": self.value_dim,
            f"{p}.attention.recurrent_layers": np.array(self.recurrent, dtype=bool),
            f"{p}.full_attention_interval": first_attention + 1,
        }

    def layer_kinds(self) -> list[str]:
        return ["gated_deltanet" if self.recurrent[i] else "attention" for i in range(self.n_layer)]

    def mtp_layers(self) -> list[int]:
        return list(range(self.n_layer, self.n_layer + self.n_nextn))

    def tensor_specs(self) -> list[TensorSpec]:
        E, V, F = self.n_embd, self.n_vocab, self.n_ff
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        specs = lm_tensor_specs(V, E)
        for i in range(self.n_layer + self.n_nextn):
            b = f"blk.{i}"
            specs += [TensorSpec(f"{b}.attn_norm.weight", (E,)), TensorSpec(f"{b}.post_attention_norm.weight", (E,))]
            specs += ffn_specs(b, E, F)
            if self.recurrent[i]:
                specs += [
                    TensorSpec(f"{b}.attn_qkv.weight", (self.conv_dim, E)),
                    TensorSpec(f"{b}.attn_gate.weight", (self.value_dim, E)),
                    TensorSpec(f"{b}.ssm_beta.weight", (self.n_v_heads, E)),
                    TensorSpec(f"{b}.ssm_alpha.weight", (self.n_v_heads, E)),
                    TensorSpec(f"{b}.ssm_dt.bias", (self.n_v_heads,)),
                    TensorSpec(f"{b}.ssm_a", (self.n_v_heads,)),
                    TensorSpec(f"{b}.ssm_conv1d.weight", (self.conv_dim, self.d_conv)),
                    TensorSpec(f"{b}.ssm_norm.weight", (self.ssm_head_dim,)),
                    TensorSpec(f"{b}.ssm_out.weight", (E, self.value_dim)),
                ]
            else:  # the query rows hold the output gate too, interleaved per head: [H, 2, hd]
                specs += attention_specs(b, E, 2 * H * hd, Hkv * hd, H * hd, qk_norm=hd)
            if i >= self.n_layer:
                specs += [
                    TensorSpec(f"{b}.nextn.eh_proj.weight", (E, 2 * E)),
                    TensorSpec(f"{b}.nextn.enorm.weight", (E,)),
                    TensorSpec(f"{b}.nextn.hnorm.weight", (E,)),
                    TensorSpec(f"{b}.nextn.shared_head_norm.weight", (E,), required=False),
                    TensorSpec(f"{b}.nextn.embed_tokens.weight", (V, E), required=False),
                    TensorSpec(f"{b}.nextn.shared_head_head.weight", (V, E), required=False),
                ]
        return specs

    def cache_layout(self) -> CacheLayout:
        def kv(layer: int) -> AttentionCacheSpec:
            return AttentionCacheSpec(layer, self.n_head_kv, self.head_dim, self.head_dim)

        recurrent = tuple(
            RecurrentStateSpec(
                layer=i,
                conv_state_elements=(self.d_conv - 1) * self.conv_dim,
                ssm_state_elements=self.n_v_heads * self.ssm_head_dim * self.ssm_head_dim,
            )
            for i in range(self.n_layer)
            if self.recurrent[i]
        )
        attention = tuple(kv(i) for i in range(self.n_layer) if not self.recurrent[i])
        return CacheLayout(attention, recurrent, tuple(kv(i) for i in self.mtp_layers()))
