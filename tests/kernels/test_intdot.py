"""The integer helpers' inline PTX (mtpserve.kernels.triton.intdot), which the interpreter cannot run, modelled
instruction by instruction; a lent GPU runs them inside the kernels (bench/gpu_smoke.py's cases)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from mtpserve.kernels.triton import intdot


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector nibble i) of the 8 bytes b:a."""
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def test_the_packed_conversion_gives_each_int8_exactly_in_fp16() -> None:
    """int8_to_fp16's PTX: xor by 0x80 a byte, each byte under 0x64 (fp16 1024 + byte), minus 1152 in fp16: each
    value exact, in its input's order."""
    assert f"mov.b32 c, {intdot.FP16_1152 * 0x10001:#x}" in intdot.SIGNED_TO_FP16_ASM
    assert intdot.SIGNED_TO_FP16_ASM.count("prmt.b32") == 2 and intdot.SIGNED_TO_FP16_ASM.count("sub.f16x2") == 2
    c = torch.tensor([intdot.FP16_1152], dtype=torch.int16).view(torch.float16)
    assert c.item() == 1152.0
    values = torch.arange(-128, 128, dtype=torch.int8)
    for word in values.view(-1, 4):
        packed = int.from_bytes(word.numpy().tobytes(), "little") ^ 0x80808080
        words = b"".join(_prmt(packed, 0x64646464, sel).to_bytes(4, "little") for sel in intdot.PRMT_SELECTORS)
        got = torch.frombuffer(bytearray(words), dtype=torch.float16) - c  # sub.f16x2, in fp16 as the GPU rounds it
        assert got.dtype == torch.float16 and torch.equal(got.float(), word.float()), (word, got)
