"""bench/gpu_check.sh's staged run without a GPU (the stand-in): every stage writes its file and says how it ended,
the GPU stages skipped with their reason, a failing or hanging stage recorded without stopping the next; and
bench/gpu_smoke.py's cases on small shapes under the Triton interpreter (the wiring of the GPU's first minute)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from gemv_l2 import Q8_TILES  # noqa: E402

STAGE_FILES = {"env": "env.txt", "smoke": "smoke.txt", "bench": "bench.txt", "tests": "tests.txt", "rest": "rest.txt"}


def _run_check(out: Path, **env: str) -> dict[str, str]:
    """`bash bench/gpu_check.sh run` with no CUDA device visible; the files it wrote, by name."""
    full_env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_PYTHON": sys.executable, **env}
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "run"], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    files = {p.name: p.read_text() for p in out.iterdir()}
    assert len(files) <= 8, sorted(files)  # the device returns at most 8 files
    return files


def _outcome(text: str, stage: str) -> str:
    return text.strip().splitlines()[-1].removeprefix(f"== {stage}: ")


def test_every_stage_writes_its_file_and_the_gpu_stages_skip_with_their_reason(tmp_path: Path) -> None:
    files = _run_check(tmp_path)
    assert set(STAGE_FILES.values()) <= set(files)
    assert "\n== env: PASSED" in files["env.txt"], files["env.txt"]
    assert "torch" in files["env.txt"] and "stages (limit in s)" in files["env.txt"]
    for stage in ("smoke", "bench", "tests", "rest"):
        assert _outcome(files[STAGE_FILES[stage]], stage).startswith("SKIPPED: no CUDA device"), files[
            STAGE_FILES[stage]
        ]
        assert f"stage {stage}: SKIPPED: no CUDA device" in files["env.txt"]  # env.txt is the run's index


def test_a_failing_stage_records_its_error_and_the_next_stages_still_run(tmp_path: Path) -> None:
    files = _run_check(tmp_path, GPU_CHECK_FAIL="smoke,bench:hang", GPU_CHECK_TIMEOUT_BENCH="2")
    assert _outcome(files["smoke.txt"], "smoke").startswith("FAILED (exit 1)")
    assert "RuntimeError: injected failure in stage smoke" in files["smoke.txt"]  # the traceback
    assert _outcome(files["bench.txt"], "bench").startswith("TIMED OUT")
    for stage in ("tests", "rest"):
        assert _outcome(files[STAGE_FILES[stage]], stage).startswith("SKIPPED: no CUDA device")
    index = files["env.txt"]
    assert "stage smoke: FAILED" in index and "stage bench: TIMED OUT" in index and "stage rest: SKIPPED" in index


def test_stage_selection_and_the_budget(tmp_path: Path) -> None:
    files = _run_check(tmp_path, GPU_CHECK_STAGES="env rest", GPU_CHECK_BUDGET="5")
    assert set(files) == {"env.txt", "rest.txt"}
    assert _outcome(files["rest.txt"], "rest").startswith("SKIPPED")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gpu_smoke_cases_run_on_small_shapes_under_the_interpreter() -> None:
    # The cheap cases (the interpreter's GEMVs take seconds each, the graph case's emulated model ~50 s).
    only = "decode_attention q8_0 cache 128 cells H=4/2 D=64 T=1,T=3,quantize_rows 1x512,rms_norm_quantize"
    only += ",gated_delta_decode,gdn_decode_inputs,norm_rope_store,decode_attention planar q8_0 cache 128 cells"
    only += ",decode_attention planar q8_0 (mma kernel) cache 128 cells"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_smoke.py"), "--device", "cpu", "--tiny", "--only", only],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    labels = ["decode_attention", "gated_delta_rule_recurrent_batched", "quantize_rows", "rms_norm_quantize"]
    labels += ["gated_delta_decode", "gdn_decode_inputs", "norm_rope_store"]  # three decode kernels had none (issue 38)
    labels += ["decode_attention planar q8_0"]  # the GPU path's q8_0 cache: the int8 kernel
    labels += ["decode_attention planar q8_0 (mma kernel)"]  # sm_75's, on any GPU from sm_75 (the H200 included)
    for label in labels:
        assert any(line.startswith("PASS " + label) for line in lines), run.stdout
    assert not any(line.startswith("FAIL") for line in lines)
    assert not any("no smoke case is registered" in line for line in lines), run.stdout  # every kernel has its case
    # the PDL graph case (--pdl, sm_90+) says why it did not run
    assert any(line.startswith("SKIP programmatic dependent launch: --pdl") for line in lines), run.stdout
    assert lines[-1].startswith("gpu_smoke: 0 failed of ")


def _gemv_l2(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "gemv.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gemv_l2.py"), "--device", "cpu", "--tiny", "--json", str(out), *args],
        env={**os.environ, "TRITON_INTERPRET": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return run, json.loads(out.read_text())["gemv"]


@pytest.mark.slow  # 38 s interpreted; the next test runs the error path on two kernels in the default suite
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemv_l2_measures_every_kernel(tmp_path: Path) -> None:
    """The integer GEMV once errored on every row (its activations quantized with a block size where a format is
    needed) while the stage still passed (issue 38): every kernel and tile choice now measures."""
    run, rows = _gemv_l2(tmp_path)
    tiles = {
        m: {name for name, _, _, prefetch, _, _ in Q8_TILES if not prefetch or m == "attn_qkv"}
        for m in ("attn_qkv", "ffn_down")
    }
    expected = {(m, k) for m in tiles for k in {"words", "sub_tile", "q8"} | tiles[m]}
    assert {(r["matrix"], r["kernel"]) for r in rows} == expected
    assert run.returncode == 0 and not any("error" in r for r in rows), run.stdout + run.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_gemv_run_begins_no_kernel_past_its_budget(tmp_path: Path) -> None:
    """Each kernel runs on every matrix before the next begins, and none but the first after --budget-s: with no
    budget the default GEMV still measures both matrices and the L2-prefetching one is left out, said so."""
    run, rows = _gemv_l2(tmp_path, "--kernels", "q8,q8 l2 ahead2", "--budget-s", "0")
    assert [(r["matrix"], r["kernel"]) for r in rows] == [("attn_qkv", "q8"), ("ffn_down", "q8")]
    assert run.returncode == 0 and "budget: q8 l2 ahead2 and the kernels after it not begun" in run.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_an_error_row_fails_the_gemv_run(tmp_path: Path) -> None:
    """A kernel made to raise makes the run, so the bench stage, fail, the other kernels measured all the same."""
    run, rows = _gemv_l2(tmp_path, "--kernels", "words,q8", GEMV_L2_BREAK="q8")
    assert {(r["matrix"], r["kernel"]) for r in rows} == {
        (m, k) for m in ("attn_qkv", "ffn_down") for k in ("words", "q8")
    }
    failed = {(r["matrix"], r["kernel"]) for r in rows if "error" in r}
    assert run.returncode == 1 and failed == {("attn_qkv", "q8"), ("ffn_down", "q8")}, run.stdout + run.stderr


FAKE_BENCH = """#!/bin/sh
[ "$1" = --help ] && exit {code}
echo "a stand-in llama-bench: $*"
"""


def _carried_peer(tmp_path: Path, help_exit: int) -> tuple[subprocess.CompletedProcess, Path]:
    """`peer` with a stand-in prepare-peer folder: a packed llama-bench (its --help exits `help_exit`), the first
    call's decode.json, a stand-in cuBLAS; no CUDA device, so gpu.py stops after the unpacking."""
    if shutil.which("xz") is None:
        pytest.skip("the carried build is an xz tarball (tar -J), and this machine has no xz")
    peer, cu, built = tmp_path / "peer", tmp_path / "cu", tmp_path / "built"
    (cu / "lib").mkdir(parents=True)
    (cu / "include").mkdir()
    for name in ("libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"):
        (cu / "lib" / name).write_bytes(b"")
    built.mkdir()
    (built / "llama-bench").write_text(FAKE_BENCH.format(code=help_exit))
    (built / "llama-bench").chmod(0o755)
    (built / "libllama.so.0").write_bytes(b"")
    peer.mkdir()
    subprocess.run(["tar", "-cJf", str(peer / "llama.cpp-sm90.tar.xz"), "-C", str(built), "."], check=True)
    (peer / "decode.json").write_text("{}")
    target = tmp_path / "there" / "bin" / "llama-bench"
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "CUDA_VISIBLE_DEVICES": "",
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_PEER_DIR": str(peer),
        "GPU_CHECK_LLAMA_BENCH": str(target),
        "CUBLAS_DIR": str(cu),
        "GPU_CHECK_CUBLAS_LINKS": str(tmp_path / "links"),
    }
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "peer"], env=env, capture_output=True, text=True, timeout=120
    )
    return run, target


def test_peer_runs_the_llama_bench_carried_from_here(tmp_path: Path) -> None:
    """A second call carrying prepare-peer's folder: the packed build is unpacked where the peer looks for it, with
    its libraries, checked to run, and the first call's decode.json is what the peer's rows are compared with."""
    run, target = _carried_peer(tmp_path, help_exit=0)
    log = (tmp_path / "out" / "peer.log").read_text()
    assert "llama.cpp peer: the build carried in" in log, log + run.stderr
    assert target.is_file() and (target.parent / "libllama.so.0").is_file()
    for name in ("libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"):  # what the build loads, by soname
        assert (tmp_path / "links" / name).resolve() == tmp_path / "cu" / "lib" / name
    # a fresh machine has no `run` results: the first call's, carried beside the build
    assert f"against the bench stage's rows in {tmp_path / 'peer' / 'decode.json'}" in log, log
    assert "no CUDA GPU visible to torch" in log  # then gpu.py, stopped here by the missing device


def test_a_carried_llama_bench_that_does_not_run_is_removed_and_said(tmp_path: Path) -> None:
    run, target = _carried_peer(tmp_path, help_exit=1)
    log = (tmp_path / "out" / "peer.log").read_text()
    assert "llama.cpp peer: the carried build does not run here" in log, log + run.stderr
    assert not target.exists()  # the peer then says it is missing rather than running a broken binary
