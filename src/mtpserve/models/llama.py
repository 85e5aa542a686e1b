"""The Llama family: `llama` (SmolLM2, the default model), `qwen2` (Q/K/V biases) and `qwen3` (QK norm).
Pre-norm decoder blocks: RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU.

llama.cpp rotates `llama` heads with normal (adjacent-pair) RoPE — its converter permutes Q/K for that —
and `qwen2`/`qwen3` with NeoX (half-split) RoPE.
"""

from __future__ import annotations

from ctypes import Structure
from dataclasses import replace

import torch

from ..cache import KVCache, append_and_attend
from ..ops.activations import ResidualGatedFFN
from ..ops.linear import WeightGroup, linear, linear_many
from ..ops.norm import rms_norm, rms_norm_for
from ..ops.rope import RopeTable, apply_rope
from .base import Batch, CausalLM, ModelState, Rope, SharedKV, WeightStore, new_kv_caches, padded_context
from .configs.llama import ARCHES, LlamaConfig  # noqa: F401 (re-exported)
from .tensor_parallel import attention_share, ffn_share

# --- blocks -------------------------------------------------------------------------------------------


class Attention:
    """GQA attention with RoPE; optional q/k/v biases (qwen2) and per-head q/k RMSNorm (qwen3)."""

    def __init__(self, w: WeightStore, b: str, c: LlamaConfig) -> None:
        hd, wo = c.head_dim, f"{b}.attn_output.weight"
        share = attention_share(w.partition, c.n_head, c.n_head_kv, hd, w.ggml_type(wo))  # a rank's heads
        self.c = c = replace(c, n_head=len(share.heads), n_head_kv=len(share.kv_heads))
        rows = {"q": share.q_rows(hd), "k": share.kv_rows(hd), "v": share.kv_rows(hd)}
        self.wq, self.wk, self.wv = (w.matrix(f"{b}.attn_{n}.weight", rows=rows[n]) for n in "qkv")
        self.qkv = WeightGroup((self.wq, self.wk, self.wv))  # one kernel call for the three
        self.wo = w.matrix(wo, columns=share.out_columns(hd), partition=share.partition)
        self.bq, self.bk, self.bv = (w.dense(f"{b}.attn_{n}.bias", rows[n]) if c.qkv_bias else None for n in "qkv")
        self.q_norm = w.dense(f"{b}.attn_q_norm.weight") if c.qk_norm else None
        self.k_norm = w.dense(f"{b}.attn_k_norm.weight") if c.qk_norm else None
        # the block's one-call form (KVCache.residual_attention, decode_block), which has no q/k/v biases (qwen2)
        self.fused = None
        if self.bq is None:
            self.fused = {"qkv": self.qkv, "wo": self.wo, "n_heads": c.n_head, "scale": c.head_dim**-0.5}
            self.fused |= {"q_norm": self.q_norm, "k_norm": self.k_norm, "neox": c.rope_neox}

    def __call__(self, x: torch.Tensor, rope: Rope, caches: list[KVCache], seq_len: int) -> torch.Tensor:
        c, T = self.c, x.shape[0]
        q, k, v = linear_many(x, self.qkv, seq_len)
        if self.bq is not None:  # qwen2: biases on q, k and v
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        q, k, v = (
            q.view(T, c.n_head, c.head_dim),
            k.view(T, c.n_head_kv, c.head_dim),
            v.view(T, c.n_head_kv, c.head_dim),
        )
        if c.qk_norm:
            q, k = rms_norm(q, self.q_norm, c.rms_eps), rms_norm(k, self.k_norm, c.rms_eps)
        q, k = apply_rope(q, rope.cos, rope.sin, c.rope_neox), apply_rope(k, rope.cos, rope.sin, c.rope_neox)
        o = append_and_attend(caches, q, k, v, rope.positions, c.head_dim**-0.5, rope.static)
        return linear(o.reshape(T, -1), self.wo, seq_len=seq_len)

    def residual(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, rope: Rope, caches: list[KVCache], seq_len: int
    ) -> torch.Tensor:
        """x + self(rms_norm(x) * norm_weight): one C call for a few tokens of one sequence on the CPU
        (`KVCache.residual_attention`), op by op elsewhere."""
        if len(caches) == 1 and self.fused is not None and not rope.static:
            y = caches[0].residual_attention(x, norm_weight, eps, cos=rope.cos, sin=rope.sin, **self.fused)
            if y is not None:
                return y
        h = rms_norm_for(x, norm_weight, eps, matmul=self.wq)  # GPU path: quantized rows
        return x + self(h, rope, caches, seq_len)


class DecoderLayer:
    def __init__(self, w: WeightStore, i: int, c: LlamaConfig) -> None:
        b = f"blk.{i}"
        self.index, self.eps = i, c.rms_eps
        self.attn_norm = w.dense(f"{b}.attn_norm.weight")
        self.attn = Attention(w, b, c)
        self.ffn_norm = w.dense(f"{b}.ffn_norm.weight")
        down = f"{b}.ffn_down.weight"
        share = ffn_share(w.partition, w.shape(down)[1], w.ggml_type(down))  # a rank's columns of the FFN
        self.gate, self.up = (w.matrix(f"{b}.ffn_{n}.weight", rows=share.columns) for n in ("gate", "up"))
        self.down = w.matrix(down, columns=share.columns, partition=share.partition)
        self.gate_up = WeightGroup((self.gate, self.up))  # one GEMV launch on the GPU path
        self.residual_ffn = ResidualGatedFFN(self.ffn_norm, self.eps, self.gate_up, self.down)

    def __call__(self, x: torch.Tensor, rope: Rope, batch: Batch) -> torch.Tensor:
        caches = [state.kv[self.index] for state in batch.states]
        x = self.attn.residual(x, self.attn_norm, self.eps, rope, caches, batch.n_tokens)
        return self.residual_ffn(x, batch.n_tokens)

    def decode_blocks(self, state: ModelState) -> list[Structure] | None:
        """The block's two halves in a CPU decode program over `state` (ops.decode_program), or None."""
        fused = self.attn.fused
        attention = None if fused is None else state.kv[self.index].decode_block(self.attn_norm, self.eps, **fused)
        ffn = self.residual_ffn.decode_block()
        return None if attention is None or ffn is None else [attention, ffn]


# --- model --------------------------------------------------------------------------------------------


class LlamaForCausalLM(CausalLM):
    def __init__(self, w: WeightStore, config: LlamaConfig) -> None:
        c = self.config = config
        self._place(w)
        self.token_embd = w.matrix("token_embd.weight")
        self.layers = [DecoderLayer(w, i, c) for i in range(c.n_layer)]
        self.output_norm = w.dense("output_norm.weight")
        self.output = self._output_layer(w)
        self.kv_heads = {layer.index: layer.attn.c.n_head_kv for layer in self.layers if w.partition.split}
        self.rope_table = RopeTable(c.n_rot, c.rope_base, 1.0 / c.rope_scale, device=self.device)

    def new_state(
        self, ctx_size: int = 0, cache_type_k: str = "f16", cache_type_v: str = "f16", *, shared: SharedKV | None = None
    ) -> ModelState:
        ctx = padded_context(ctx_size, self.config)
        devices = self._layer_device_map()
        kv = new_kv_caches(
            self.config, ctx, cache_type_k, cache_type_v, devices=devices, shared=shared, kv_heads=self.kv_heads
        )
        return ModelState(kv, capacity=ctx)
