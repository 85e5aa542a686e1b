"""bench/gpu.py, the CUDA backend's benchmark, runs end to end: on CPU with tiny shapes under the Triton
interpreter (the same code a GPU runs, minus the GPU), writing its table and JSON."""

from __future__ import annotations

import dataclasses
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

REPO = Path(__file__).resolve().parents[2]


# Stands in for llama-bench in the smoke run: checks the flags it is given and the model file, then answers in
# llama-bench's JSON with 100 tokens/s for every test.
FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
assert (flag("-fa"), flag("-ctk"), flag("-ctv"), flag("-o")) == ("on", "q8_0", "q8_0", "json"), args
assert open(flag("-m"), "rb").read(4) == b"GGUF"
rows = [dict(n_prompt=int(flag("-p")), n_gen=int(flag("-n")), n_depth=int(d), avg_ts=100.0, stddev_ts=1.0,
             build_commit="fake", backends="CPU") for d in flag("-d").split(",")] if "-d" in args else [
        dict(n_prompt=int(flag("-p")), n_gen=int(flag("-n")), n_depth=0, avg_ts=100.0, stddev_ts=1.0,
             build_commit="fake", backends="CPU")]
print(json.dumps(rows))
"""


@pytest.mark.slow  # ~75 s of the emulated model; tests/bench/test_gpu_check.py runs the GPU check's stages quickly
def test_bench_gpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu.py"),
        "--tiny",
        "--device",
        "cpu",
        "--contexts",
        "256,384",
        "--prefill",
        "96",
        "--reps",
        "1",
        "--batch",
        "2",
        "--gemv-k-splits",
        "2",
        "--gemv-l2-ahead",
        "2",
        "--pdl",
        "--attention-choices",
        "ieee min16",
        "--json",
        str(out),
        "--llama-bench",
        str(fake),
        "--gguf",
        str(tmp_path / "random.gguf"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| depth | decode tok/s |" in run.stdout and "prefill:" in run.stdout
    assert "the few-row GEMVs split 2 ways along K" in run.stdout
    assert "programmatic dependent launch: decode" in run.stdout and "logits equal" in run.stdout
    assert "decode attention 'ieee min16': decode" in run.stdout
    result = json.loads(out.read_text())
    assert [row["depth"] for row in result["decode"]] == [256, 384]
    for row in result["decode"]:
        assert row["decode_tokens_per_s"] > 0 and row["verify_ms"] > 0
        [choice] = row["attention_choices"]
        assert choice["choice"] == "ieee min16" and choice["decode_ms"] > 0 and choice["verify_ms"] > 0
        assert row["draft_ms"] > 0 and row["draft_full_head_ms"] > 0 and row["catch_up_ms"] > 0
        assert row["draft_drawn_ms"] > 0 and 0 < row["mtp_drawn_tokens_per_s"]
        # n_max 2 at 63% accepted: 1 + 1.26 tokens per verification step
        assert row["mtp_tokens_per_step"] == pytest.approx(2.26)
        assert row["kv_bytes_per_token"] > 0
        assert row["gemv_k_splits"] == 2 and min(row["decode_k_split_ms"], row["verify_k_split_ms"]) > 0
    first, second = result["decode"]  # PDL and the L2 prefetch at the first depth only (kernels compiled afresh)
    assert first["pdl_logits_equal"] is True and min(first["decode_pdl_ms"], first["verify_pdl_ms"]) > 0
    assert "decode_pdl_ms" not in second
    l2_ahead = ("decode_l2_ahead_ms", "verify_l2_ahead_ms", "decode_k_split_l2_ahead_ms", "verify_k_split_l2_ahead_ms")
    assert first["gemv_l2_ahead"] == 2 and min(first[k] for k in l2_ahead) > 0
    assert min(first["decode_pdl_l2_ahead_ms"], first["verify_pdl_l2_ahead_ms"]) > 0
    assert not any(k in second for k in (*l2_ahead, "decode_pdl_l2_ahead_ms"))
    assert "the GEMVs prefetching 2 K steps ahead into L2: decode" in run.stdout
    # Bytes a token reads: every trunk matrix and the head, far more than one MTP step's block + head.
    assert result["weight_bytes_per_token"] > result["weight_bytes_per_draft_step"] > 0
    ranking = result["ranking"]
    assert ranking["vocab"] > 0 and min(v for k, v in ranking.items() if k.endswith("_us")) > 0
    assert {"topk41_us", "top_candidates41_us", "rows3_top40_together_us", "rows3_top40_each_us"} <= ranking.keys()
    assert result["prefill_tokens_per_s"] > 0
    assert result["batch_decode"]["sequences"] == 2 and result["batch_decode"]["tokens_per_s"] > 0
    assert [(g["matrix"], g["rows"]) for g in result["gemv"]] == [("attn_qkv", 1)]  # --tiny: one case
    assert all(g["words_us"] > 0 and g["sub_tile_us"] > 0 for g in result["gemv"])
    scan = result["chunk_scan"]
    assert scan["tokens"] == 512 and min(scan["scan_kernel_ms"], scan["scan_loop_ms"], scan["chunked_rule_ms"]) > 0
    assert "chunk scan" in run.stdout
    # The peer ran on the model written as a GGUF file, at our depths, and the ratios are ours over theirs.
    peer = result["peer"]
    assert "error" not in peer, peer
    assert peer["gguf_bytes"] == (tmp_path / "random.gguf").stat().st_size
    assert [d["depth"] for d in peer["decode"]] == [256, 384]
    for ours, theirs in zip(result["decode"], peer["decode"]):
        assert theirs["ours_over_theirs"] == pytest.approx(ours["decode_tokens_per_s"] / 100.0)
    assert peer["prefill_ours_over_theirs"] == pytest.approx(result["prefill_tokens_per_s"] / 100.0)
    assert "llama.cpp (CPU, build fake)" in run.stdout


def test_the_random_model_written_as_gguf_is_the_model_benchmarked(tmp_path: Path) -> None:
    """What llama.cpp is given (write_gguf) is what was measured: our loader reads back the same config and
    tensors, so the same logits. (llama.cpp's own llama-bench loads it too: checked by hand with its CPU build.)"""
    import torch

    from mtpserve.models.base import WeightStore
    from mtpserve.models.loader import build_model, load

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    tensors = gpu.random_weights(gpu.TINY, torch.device("cpu"))
    size = gpu.write_gguf(gpu.TINY, tensors, str(tmp_path / "r.gguf"))
    assert size == (tmp_path / "r.gguf").stat().st_size
    loaded = load(tmp_path / "r.gguf")
    assert loaded.config == dataclasses.replace(gpu.TINY, rms_eps=loaded.config.rms_eps)
    assert loaded.config.rms_eps == pytest.approx(gpu.TINY.rms_eps)
    built = build_model(WeightStore(tensors, torch.device("cpu")), gpu.TINY)
    ids = [5, 300, 1000, 7]
    assert torch.equal(
        loaded.prefill(ids, loaded.new_state(64, "f16", "f16")), built.prefill(ids, built.new_state(64, "f16", "f16"))
    )


def test_bench_gpu_refuses_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py")], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 2 and "no CUDA GPU" in run.stderr


def test_the_kernel_table_sums_counts_and_finds_the_idle_gaps() -> None:
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "bench"))
    from gpu import kernel_table  # bench/gpu.py: imported here, where triton is known to be installed

    def kernel(name: str, start: float, end: float) -> SimpleNamespace:
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span)

    events = [kernel("gemv", 0, 10), kernel("norm", 12, 13), kernel("gemv", 15, 25), kernel("attn", 30, 36)]
    table = kernel_table(events, top=2)
    assert (table["kernels"], table["busy_us"], table["span_us"], table["idle_us"]) == (4, 27.0, 36.0, 9.0)
    assert table["top"] == [{"name": "gemv", "count": 2, "us": 20.0}, {"name": "attn", "count": 1, "us": 6.0}]


def test_an_attention_choice_that_fails_is_recorded_and_leaves_the_others_measured(monkeypatch) -> None:
    """bench/gpu.py --attention-choices: each choice captured with ops.attention.DECODE_ATTENTION_CHOICE set to its
    keywords (cleared after, failing or not); a failure is a row of its own, the next choice still runs."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "bench"))
    import gpu  # bench/gpu.py
    from attention_gpu import choice_kwargs

    from mtpserve.ops import attention

    captured = []

    def time_captured(*args: object) -> tuple[float, float]:
        captured.append(dict(attention.DECODE_ATTENTION_CHOICE))
        if attention.DECODE_ATTENTION_CHOICE["precision"] == "fp16":
            raise RuntimeError("out of resources")
        return 0.002, 0.003

    monkeypatch.setattr(gpu, "time_captured", time_captured)
    args = SimpleNamespace(attention_choices=["fp16 s16 w2", "ieee min16"])
    out = gpu.measure_attention_choices(None, None, 4096, 7, args, None, decode_ms=2.5)
    assert captured == [choice_kwargs("fp16 s16 w2"), choice_kwargs("ieee min16")]
    assert attention.DECODE_ATTENTION_CHOICE == {}
    assert out == {
        "attention_choices": [
            {"choice": "fp16 s16 w2", "failed": "RuntimeError: out of resources"},
            {"choice": "ieee min16", "decode_ms": 2.0, "verify_ms": 3.0},
        ]
    }


def test_an_unknown_attention_choice_is_refused_before_anything_is_built() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--attention-choices", "ieee min16,nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2 and "no attention choice 'nope'" in run.stderr


def test_a_failed_pdl_capture_is_recorded_and_switches_pdl_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """--pdl captures with a launch attribute no GPU here has run: if that capture fails on the lent GPU, the
    depth keeps its other numbers, the failure is in the JSON and the report, and PDL is off again."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import gpu

    from mtpserve.kernels.triton import pdl

    class Graph:
        def __init__(self, model, state) -> None:
            pass

        def decode(self, token: int) -> torch.Tensor:
            return torch.zeros(4)

    def capture_fails(*args, **kwargs):
        assert pdl.ENABLED  # timed with PDL on
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gpu, "DecodeGraph", Graph)
    monkeypatch.setattr(gpu, "truncate", lambda state, depth: None)
    monkeypatch.setattr(gpu, "time_captured", capture_fails)
    row = gpu.measure_pdl(None, None, 4096, 1, None, None)
    assert row == {"pdl_failed": "RuntimeError: operation not permitted when stream is capturing"}
    assert pdl.ENABLED is False
