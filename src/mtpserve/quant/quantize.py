"""Quantizers for KV-cache rows (q8_0, q4_0), following ggml's reference rounding rules
(../shared/spec/gguf-quant-formats.md, "Reference quantizers that matter for the KV cache")."""

from __future__ import annotations

import torch

from .types import GGMLType


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float [..., n] (n % 32 == 0) -> uint8 blocks [..., n // 32 * 34]: d = amax / 127 (as f16),
    q = round-half-away(x / d)."""
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)  # exact division, not 1 * (1/d)
    v = blocks * inv
    q = (v.sign() * torch.floor(v.abs() + 0.5)).to(torch.int8)
    out = torch.cat((d.half().view(torch.uint8), q.view(torch.uint8)), dim=-1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """float [..., n] -> uint8 blocks [..., n // 32 * 18]: d = (signed max-magnitude value) / -8,
    q = min(15, trunc(x / d + 8.5)); low nibbles hold the first 16 values, high nibbles the last 16."""
    blocks = x.float().reshape(-1, 32)
    idx = blocks.abs().argmax(-1, keepdim=True)
    d = blocks.gather(-1, idx) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)  # exact division, not 1 * (1/d)
    q = torch.clamp(torch.trunc(blocks * inv + 8.5), 0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    out = torch.cat((d.half().view(torch.uint8), packed), dim=-1)
    return out.reshape(*x.shape[:-1], -1)


QUANTIZERS = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0}
