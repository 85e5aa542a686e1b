"""Gemma 3 (`gemma3`): interleaved sliding-window and global attention layers with their own RoPE bases,
pre- and post-norms around attention and FFN, QK norm, GeGLU, and an embedding scaled by sqrt(n_embd).

Semantics: ../shared/spec/qwen35-architecture.md §7 (read from llama.cpp's gemma3 graph).
"""

from __future__ import annotations

import math
from ctypes import Structure
from dataclasses import replace

import numpy as np
import torch

from ..cache import KVCache, append_and_attend
from ..ops.activations import ResidualGatedFFN
from ..ops.embedding import embedding
from ..ops.linear import WeightGroup, linear, linear_many
from ..ops.norm import rms_norm, rms_norm_for
from ..ops.rope import RopeTable, apply_rope
from .base import Batch, CausalLM, ModelState, Rope, SharedKV, WeightStore, new_kv_caches, padded_context
from .configs.gemma3 import ARCH, DEFAULT_ROPE_BASE_SWA, DEFAULT_SWA_PERIOD, Gemma3Config  # noqa: F401 (re-exported)
from .tensor_parallel import attention_share, ffn_share

# --- blocks -------------------------------------------------------------------------------------------


class Attention:
    """GQA attention with per-head q/k RMSNorm and full-width NeoX RoPE; sliding-window layers see only
    the last `sliding_window` positions."""

    def __init__(self, w: WeightStore, b: str, c: Gemma3Config) -> None:
        hd, wo = c.head_dim, f"{b}.attn_output.weight"
        share = attention_share(w.partition, c.n_head, c.n_head_kv, hd, w.ggml_type(wo))  # a rank's heads
        self.c = c = replace(c, n_head=len(share.heads), n_head_kv=len(share.kv_heads))
        self.wq = w.matrix(f"{b}.attn_q.weight", rows=share.q_rows(hd))
        self.wk, self.wv = (w.matrix(f"{b}.attn_{n}.weight", rows=share.kv_rows(hd)) for n in "kv")
        self.qkv = WeightGroup((self.wq, self.wk, self.wv))  # one kernel call for the three
        self.wo = w.matrix(wo, columns=share.out_columns(hd), partition=share.partition)
        self.q_norm = w.dense(f"{b}.attn_q_norm.weight")
        self.k_norm = w.dense(f"{b}.attn_k_norm.weight")
        self.query_scale = float(np.float32(1.0) / np.sqrt(np.float32(c.head_dim)))
        # the block's one-call form (KVCache.residual_attention, decode_block): the query scaled, softmax scale 1
        self.fused = {"qkv": self.qkv, "wo": self.wo, "n_heads": c.n_head, "scale": 1.0}
        self.fused |= {"q_norm": self.q_norm, "k_norm": self.k_norm, "q_scale": self.query_scale, "neox": True}

    def __call__(self, x: torch.Tensor, rope: Rope, caches: list[KVCache], seq_len: int) -> torch.Tensor:
        c, T = self.c, x.shape[0]
        q, k, v = linear_many(x, self.qkv, seq_len)
        q = rms_norm(q.view(T, c.n_head, c.head_dim), self.q_norm, c.rms_eps)
        k = rms_norm(k.view(T, c.n_head_kv, c.head_dim), self.k_norm, c.rms_eps)
        v = v.view(T, c.n_head_kv, c.head_dim)
        q, k = apply_rope(q, rope.cos, rope.sin, neox=True), apply_rope(k, rope.cos, rope.sin, neox=True)
        # Gemma scales the query before attention (1/sqrt(head_dim)); the softmax scale is then 1.
        o = append_and_attend(caches, q * self.query_scale, k, v, rope.positions, 1.0, rope.static)
        return linear(o.reshape(T, -1), self.wo, seq_len=seq_len)

    def residual(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        post_norm: torch.Tensor,
        rope: Rope,
        caches: list[KVCache],
        seq_len: int,
    ) -> torch.Tensor:
        """x + rms_norm(self(rms_norm(x) * norm_weight)) * post_norm: one C call for a few tokens of one sequence on
        the CPU (`KVCache.residual_attention`), op by op elsewhere."""
        c = self.c
        if len(caches) == 1 and not rope.static:
            rows = {"cos": rope.cos, "sin": rope.sin}
            y = caches[0].residual_attention(x, norm_weight, c.rms_eps, **rows, post_norm=post_norm, **self.fused)
            if y is not None:
                return y
        h = rms_norm_for(x, norm_weight, c.rms_eps, matmul=self.wq)
        return x + rms_norm(self(h, rope, caches, seq_len), post_norm, c.rms_eps)


class DecoderLayer:
    """Norms on both sides of attention and of the FFN: x + post(attn(pre(x))), then the same for GeGLU."""

    def __init__(self, w: WeightStore, i: int, c: Gemma3Config) -> None:
        b = f"blk.{i}"
        self.index, self.eps, self.sliding = i, c.rms_eps, c.is_swa[i]
        self.attn_norm = w.dense(f"{b}.attn_norm.weight")
        self.attn = Attention(w, b, c)
        self.attn_post_norm = w.dense(f"{b}.post_attention_norm.weight")
        self.ffn_norm = w.dense(f"{b}.ffn_norm.weight")
        down = f"{b}.ffn_down.weight"
        share = ffn_share(w.partition, w.shape(down)[1], w.ggml_type(down))  # a rank's columns of the FFN
        self.gate, self.up = (w.matrix(f"{b}.ffn_{n}.weight", rows=share.columns) for n in ("gate", "up"))
        self.down = w.matrix(down, columns=share.columns, partition=share.partition)
        self.gate_up = WeightGroup((self.gate, self.up))
        self.ffn_post_norm = w.dense(f"{b}.post_ffw_norm.weight")
        ffn = (self.ffn_norm, self.eps, self.gate_up, self.down)
        self.residual_ffn = ResidualGatedFFN(*ffn, gelu=True, post_norm=self.ffn_post_norm)

    def __call__(self, x: torch.Tensor, ropes: dict[bool, Rope], batch: Batch) -> torch.Tensor:
        caches = [state.kv[self.index] for state in batch.states]
        x = self.attn.residual(x, self.attn_norm, self.attn_post_norm, ropes[self.sliding], caches, batch.n_tokens)
        return self.residual_ffn(x, batch.n_tokens)

    def decode_blocks(self, state: ModelState) -> list[Structure] | None:
        """The block's two halves in a CPU decode program over `state` (ops.decode_program), or None; its RoPE rows
        from the program's table int(sliding) (`decode_rope_tables`)."""
        norms = {"rope": int(self.sliding), "post_norm": self.attn_post_norm}
        cache = state.kv[self.index]
        attention = cache.decode_block(self.attn_norm, self.eps, **norms, **self.attn.fused)
        ffn = self.residual_ffn.decode_block()
        return None if attention is None or ffn is None else [attention, ffn]


# --- model --------------------------------------------------------------------------------------------


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, w: WeightStore, config: Gemma3Config) -> None:
        c = self.config = config
        self._place(w)
        self.token_embd = w.matrix("token_embd.weight")
        # sqrt(n_embd) rounded to float32, as llama.cpp scales (not HF's bf16 value).
        self.embed_scale = float(np.float32(math.sqrt(c.n_embd)))
        self.rope_tables = {  # sliding-window layers have their own base
            True: RopeTable(c.head_dim, c.rope_base_swa, device=self.device),
            False: RopeTable(c.head_dim, c.rope_base, 1.0 / c.rope_scale, device=self.device),
        }
        self.layers = [DecoderLayer(w, i, c) for i in range(c.n_layer)]
        self.output_norm = w.dense("output_norm.weight")
        self.output = self._output_layer(w)
        self.kv_heads = {layer.index: layer.attn.c.n_head_kv for layer in self.layers if w.partition.split}

    def new_state(
        self, ctx_size: int = 0, cache_type_k: str = "f16", cache_type_v: str = "f16", *, shared: SharedKV | None = None
    ) -> ModelState:
        ctx = padded_context(ctx_size, self.config)
        devices = self._layer_device_map()
        kv = new_kv_caches(
            self.config, ctx, cache_type_k, cache_type_v, ubatch=self.ubatch, devices=devices, shared=shared,
            kv_heads=self.kv_heads,
        )  # fmt: skip
        return ModelState(kv, capacity=ctx)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(self.token_embd, tokens) * self.embed_scale

    def decode_rope_tables(self) -> list[RopeTable]:
        return [self.rope_tables[False], self.rope_tables[True]]  # indexed by int(sliding): DecoderLayer.decode_blocks

    def forward_layers(self, x: torch.Tensor, batch: Batch, layers: range) -> torch.Tensor:
        ropes = {swa: batch.rope(table) for swa, table in self.rope_tables.items()}
        for layer in self.layers[layers.start : layers.stop]:
            device = self.device_of(layer.index)
            x = layer(x.to(device), {swa: rope.to(device) for swa, rope in ropes.items()}, batch)
        return x

    def head_is_product(self) -> bool:
        return not self.config.final_logit_softcap

    def logits_on_device(self, hidden: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        logits = linear(hidden.to(self.output.data.device), self.output, seq_len=seq_len)
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits
