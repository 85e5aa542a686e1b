"""bench/attention_gpu.py's wiring under the Triton interpreter: every choice a lent GPU will measure runs (at a
verification's 3 tokens, which every choice takes; one token is the same code with fewer rows), and gives the float32
kernel's output within its operands' rounding. A choice that fails makes the script exit 1 (the GPU check's bench
stage then fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from attention_gpu import VARIANTS, choice_kwargs  # noqa: E402


def attention_gpu(out: Path, *args: str) -> dict:
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "attention_gpu.py"), "--device", "cpu", "--tiny", "--json", str(out)]
        + list(args),
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


@pytest.mark.slow  # ~45 s of the interpreter; each choice's kernel options are tested in test_triton_attention.py
def test_every_choice_runs_and_agrees_with_the_float32_kernel(tmp_path: Path) -> None:
    result = attention_gpu(tmp_path / "attention.json", "--rows", "3")
    rows = result["rows"]
    assert result["unmeasured"] == []
    on_cpu = [v for v in VARIANTS if v[1] != "bf16"]  # the interpreter multiplies bf16 as raw bits
    expected = [(3, v) for v in on_cpu]  # a verification's rows: every choice, the 32-row blocks too
    assert [(r["rows"], r["variant"]) for r in rows] == [(t, v[0]) for t, v in expected]
    for row, (_, (_, precision, *_)) in zip(rows, expected):
        assert "failed" not in row and row["us"] > 0
        # fp16 operands round to ~1e-3; the int8 kernel's query in 8 bits and fp16 weights to ~1e-2
        assert row["error"] <= (1e-3 if precision == "fp16" else 2e-2 if precision is None else 1e-6), row


def test_a_spent_budget_leaves_the_later_choices_out_and_the_reference_in(tmp_path: Path) -> None:
    result = attention_gpu(tmp_path / "attention.json", "--rows", "1,3", "--budget-s", "0")
    assert [(r["variant"], r["rows"]) for r in result["rows"]] == [("float", 1), ("float", 3)]
    assert all("failed" not in r and r["error"] == 0.0 for r in result["rows"])
    assert result["unmeasured"] == [v[0] for v in VARIANTS[1:]]


def test_kernel_choices_name_the_kernel_for_every_step() -> None:
    """A choice named for a planar-q8_0 kernel runs it for decode and verification alike (a verification's default
    on sm_80+ is mma16, so "int8 ..." asks for tl.dot's int8 kernel by name); the float choices name none."""
    kernels = {name: choice_kwargs(name).get("int8_kernel") for name, *_ in VARIANTS}
    assert kernels["int8"] == kernels["int8 min64"] == "dot"
    assert kernels["mma"] == kernels["mma min64"] == "mma"
    assert kernels["mma16"] == "mma16"
    assert kernels["ieee min16"] is None and kernels["float"] is None
