"""bench/attention_layouts.py's prototypes compute attention: under the Triton interpreter each (cache layout, QK
arithmetic) gives float32 attention over the same q8_0 cache within its operands' rounding (an empty cell, keys in
some rows' future, a tail tile), so the issue bounds docs/gpu-decode.md quotes for them are of working kernels."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the prototypes run under the Triton interpreter here", allow_module_level=True)

import attention_layouts  # noqa: E402


def test_every_prototype_is_attention() -> None:
    rows = attention_layouts.check()
    assert {(r["layout"], r["qk"]) for r in rows} == {
        (a, b) for a in attention_layouts.LAYOUTS for b in attention_layouts.QK
    }
    for r in rows:
        # fp16 operands round to ~1e-3 at most; Q in 8 bits (int8 QK) to ~1e-2, as llama.cpp's CPU path rounds it
        assert r["relative_error"] < (2e-3 if r["qk"] == "fp16" else 2e-2), r


def test_the_planar_rows_hold_the_same_bytes() -> None:
    x = torch.randn(3, attention_layouts.N_HEAD_KV, attention_layouts.HEAD_DIM)
    blocks, planar = attention_layouts.cache_rows(x, False), attention_layouts.cache_rows(x, True)
    assert blocks.shape == planar.shape == (3, attention_layouts.N_HEAD_KV * attention_layouts.ROW)
    head = blocks[1, : attention_layouts.ROW].view(8, 34)
    assert torch.equal(planar[1, :16], head[:, :2].flatten())  # the 8 scales first
    assert torch.equal(planar[1, 16 : attention_layouts.ROW], head[:, 2:].flatten())  # then the 256 quants


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector nibble i) of the 8 bytes b:a."""
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def test_the_packed_conversion_gives_each_int8_exactly_in_fp16() -> None:
    """_int8_to_fp16's PTX, modelled instruction by instruction (the interpreter cannot run it; --time runs the
    prototype using it on a GPU against float32 attention): each value exact, in its input's order."""
    assert f"mov.b32 c, {attention_layouts.FP16_1152 * 0x10001:#x}" in attention_layouts._PACKED_CVT_ASM.value
    c = torch.tensor([attention_layouts.FP16_1152], dtype=torch.int16).view(torch.float16)
    assert c.item() == 1152.0
    values = torch.arange(-128, 128, dtype=torch.int8)
    for word in values.view(-1, 4):
        packed = int.from_bytes(word.numpy().tobytes(), "little") ^ 0x80808080
        words = b"".join(
            _prmt(packed, 0x64646464, sel).to_bytes(4, "little") for sel in attention_layouts.PRMT_SELECTORS
        )
        got = torch.frombuffer(bytearray(words), dtype=torch.float16) - c  # sub.f16x2, in fp16 as the GPU rounds it
        assert got.dtype == torch.float16 and torch.equal(got.float(), word.float()), (word, got)


def test_the_timing_wiring_runs_every_unpacked_kernel_on_the_cpu() -> None:
    rows = attention_layouts.time_rows((48,), budget_s=600, device="cpu")
    ran = [r for r in rows if "us" in r]
    assert not [r for r in rows if "error" in r or "skipped" in r]
    assert len(ran) == 2 + sum(1 for t in attention_layouts.TIMED if t[2] != "packed" and t[3][0] == 16)
    assert all(r["relative_error"] < 2e-2 for r in ran), ran
