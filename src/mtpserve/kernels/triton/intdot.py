"""Integer dot products for the GEMVs over quantized activations: `dp4a(a, b, c)` = c + the sum of the four products
of the signed bytes of a and b, one `dp4a.s32.s32` instruction (sm_61+) on a GPU, and the same sum spelled out in
shifts under TRITON_INTERPRET=1 (the interpreter runs no inline PTX). Callers pass `ASM=INLINE_ASM`."""

from __future__ import annotations

import os

import triton
import triton.language as tl

INLINE_ASM = os.environ.get("TRITON_INTERPRET") != "1"  # fixed at import, as triton.jit itself decides


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum over bytes i of int8(a >> 8i) * int8(b >> 8i), elementwise on int32 tensors."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s
