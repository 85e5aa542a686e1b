"""bench/gpu.py, the CUDA backend's benchmark, runs end to end: on CPU with tiny shapes under the Triton
interpreter (the same code a GPU runs, minus the GPU), writing its table and JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed: the GPU path cannot run"
)

REPO = Path(__file__).resolve().parents[1]


def test_bench_gpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--device", "cpu", "--contexts", "256,384",
           "--prefill", "96", "--reps", "1", "--batch", "2", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| depth | decode tok/s |" in run.stdout and "prefill:" in run.stdout
    result = json.loads(out.read_text())
    assert [row["depth"] for row in result["decode"]] == [256, 384]
    for row in result["decode"]:
        assert row["decode_tokens_per_s"] > 0 and row["verify_ms"] > 0
        assert row["draft_ms"] > 0 and row["catch_up_ms"] > 0
        # n_max 2 at 63% accepted: 1 + 1.26 tokens per verification step
        assert row["mtp_tokens_per_step"] == pytest.approx(2.26)
        assert row["kv_bytes_per_token"] > 0
    # Bytes a token reads: every trunk matrix and the head, far more than one MTP step's block + head.
    assert result["weight_bytes_per_token"] > result["weight_bytes_per_draft_step"] > 0
    assert result["prefill_tokens_per_s"] > 0
    assert result["batch_decode"]["sequences"] == 2 and result["batch_decode"]["tokens_per_s"] > 0
    assert [(g["matrix"], g["rows"]) for g in result["gemv"]] == [("attn_qkv", 1)]  # --tiny: one case
    assert all(g["words_us"] > 0 and g["sub_tile_us"] > 0 for g in result["gemv"])
    scan = result["chunk_scan"]
    assert scan["tokens"] == 512 and min(scan["scan_kernel_ms"], scan["scan_loop_ms"], scan["chunked_rule_ms"]) > 0
    assert "chunk scan" in run.stdout


def test_bench_gpu_refuses_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py")], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 2 and "no CUDA GPU" in run.stderr
