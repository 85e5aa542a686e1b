"""bench/gpu_static.py --quick runs without a GPU and writes its JSON: kernel counts per decode, verification and
MTP step on the 27B's layer pattern, and the quick decode kernels' issue bounds on sm_90 and sm_75 (~60 s).

Asserts the goals of issue 19 that the quick run sees (kernel counts, the quick Q4_K integer GEMV's bound); the
full table is bench/gpu_static.py's without --quick (docs/gpu-decode.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.compiler import require_compiler

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_static.py"


def test_gpu_static_quick(tmp_path: Path) -> None:
    require_compiler()
    out = tmp_path / "static.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--host-tokens", "64", "--json", str(out)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("kernels_per_decode_step", "kernels_per_verify_step", "kernels_per_mtp_draft", "kernels_per_mtp_draw"):
        assert isinstance(r[key], int) and r[key] > 0, key
    drawn = dict(r["counts"]["steps"]["mtp_draw"]["top"])  # a drawn draft's chain: one launch (kernels.triton.chain)
    assert drawn["triton._draw_row_kernel"] == 1 and not {"aten.cumsum", "aten._softmax"} & drawn.keys()
    decode = r["counts"]["steps"]["decode"]
    assert decode["kernels"] == r["kernels_per_decode_step"] == decode["triton"] + decode["aten"]
    layers = {kind: v["layers"] for kind, v in decode["by_layer_kind"].items()}
    assert layers["gated_deltanet"] == 48 and layers["gated_attention"] == 16
    assert sum(v["kernels"] for v in decode["by_layer_kind"].values()) == decode["kernels"]
    assert len(decode["top"]) <= 20 and all(n > 0 for _, n in decode["top"])
    assert r["counts"]["type_plan_fixture_mismatches"] in (None, [])  # the plan is llama-quantize's
    assert not decode["host_kernel_calls"], "the GPU path called the CPU kernels"

    kernels = r["kernels"]
    assert {k["arch"] for k in kernels} == {"sm_90", "sm_75"}
    assert any(k["kernel"].startswith("gemv") for k in kernels)
    for k in kernels:
        assert not k["note"].startswith("FAILED"), k
        assert isinstance(k["registers"], int) and isinstance(k["num_warps"], int), k
        assert isinstance(k["spill_bytes"], int), k
        if k["bytes_per_iteration"] is not None and k["sass_instructions_per_iteration"] is not None:
            assert k["issue_bound_tbps"] > 0 and isinstance(k["ok"], bool), k
        else:
            assert k["issue_bound_tbps"] is None and "no memory-streaming loop" in k["note"], k
    summary = r["summary"]
    assert isinstance(summary["decode_gemvs_ok"], bool) and isinstance(summary["max_decode_spill_bytes"], int)
    # Issue 19's goals that hold: at most 1,000 kernels a decode step, a verification within 1.2x of it, and the
    # quick integer GEMV (Q4_K, the 27B's commonest) issue-bound above 1.5 x HBM without spills on both archs.
    assert r["kernels_per_decode_step"] <= 1000
    assert r["kernels_per_verify_step"] <= 1.2 * r["kernels_per_decode_step"]
    q4k = [k for k in kernels if k["kernel"] == "gemv_q8" and "Q4_K" in k["name"]]
    assert {k["arch"] for k in q4k} == {"sm_90", "sm_75"} and all(k["ok"] for k in q4k), q4k

    # the time model on these counts and bounds (its arithmetic: test_gpu_time_model.py)
    predicted = {(p["device"], p["context"], p["spec"]): p for p in r["predicted"]}
    assert set(predicted) == {
        (d, c, s) for d in ("H200", "2x2080Ti") for c in (4096, 131072) for s in ("none", "draft-mtp")
    }
    planned = {(p["device"], p["context"], p["spec"]) for p in r["predicted_row_split"]}
    assert planned == {
        (d, c, s)
        for d in ("2x2080Ti-row-pcie", "2x2080Ti-row-nvlink")
        for c in (4096, 131072)
        for s in ("none", "draft-mtp")
    }
    assert {(x["device"], x["context"], x["spec"]) for x in r["row_split_vs_layer_split"]} == planned
    assert r["host_ms_per_mtp_cycle"] > 0 and r["host_ms_per_token"] > 0
    sampled = {(p["device"], p["context"], p["spec"]) for p in r["predicted_sampled"]}  # the server's default chain
    assert sampled == set(predicted) and r["host_ms_per_mtp_cycle_sampled"] > 0
    for p in predicted.values():
        assert set(p["ms"]) == {"weights", "attention", "launches", "host", "other"}
        assert abs(p["tok_s"] - 1e3 / sum(p["ms"].values())) <= 0.01 * p["tok_s"]
