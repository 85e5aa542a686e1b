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


PRMT_SELECTORS = (0x5140, 0x7362)  # the two output words: bytes 0, 1 and bytes 2, 3 of the input, each under 0x64
FP16_1152 = 0x6480  # 1024 + 128: what the byte's bias and the 0x64 high byte add to it
SIGNED_TO_FP16_ASM = (
    f"{{ .reg .b32 t, c; xor.b32 t, $2, 0x80808080; mov.b32 c, {FP16_1152 * 0x10001:#x}; "
    + " ".join(
        f"prmt.b32 ${i}, t, 0x64646464, {sel:#x}; sub.f16x2 ${i}, ${i}, c;" for i, sel in enumerate(PRMT_SELECTORS)
    )
    + " }"
)
_SIGNED_TO_FP16 = tl.constexpr(SIGNED_TO_FP16_ASM)  # a jit function reads only constexpr globals


@triton.jit
def int8_to_fp16(x, ASM: tl.constexpr):
    """int8 -> fp16, exact. Compiled, four at a time in five instructions (the compiler's conversion takes ~3 a value):
    each byte biased by 128 becomes the low mantissa byte of fp16 1024.0 (0x64xx: 1024 + byte), and 1152 (0x6480)
    comes off in one packed subtraction. Under the interpreter, a plain conversion."""
    if ASM:
        return tl.inline_asm_elementwise(_SIGNED_TO_FP16, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return x.to(tl.float16)
