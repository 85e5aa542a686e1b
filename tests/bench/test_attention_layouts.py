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


def test_the_timing_wiring_runs_every_unpacked_kernel_on_the_cpu() -> None:
    rows = attention_layouts.time_rows((48,), budget_s=600, device="cpu")
    ran = [r for r in rows if "us" in r]
    assert not [r for r in rows if "error" in r or "skipped" in r]
    assert len(ran) == 4 + sum(1 for t in attention_layouts.TIMED if t[2] != "packed" and t[3][0] == 16)
    assert all(r["relative_error"] < 2e-2 for r in ran), ran
