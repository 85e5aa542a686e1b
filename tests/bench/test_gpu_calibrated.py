"""bench/gpu_calibrated.py: its fit reproduces the H200 run it was fitted to, and its attention model counts the
programs and tiles the kernel itself walks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_calibrated as gc  # noqa: E402


def test_the_fit_reproduces_the_h200_run_within_a_tenth() -> None:
    measured = json.loads(gc.MEASURED.read_text())
    host = json.loads((REPO / "docs" / "perf" / "gpu_time_model.json").read_text())
    e = gc.fit(measured)
    assert 0.15 < e.gemv_fraction_3 < e.gemv_fraction_1 < 0.5 and 11 < e.tile_us < 14  # 0.23, 0.38, 12.7 us
    checks = gc.compare(gc.predict(e, host["host_ms_per_token"], host["host_ms_per_mtp_cycle"]), measured)
    assert {(c["context"], c["spec"]) for c in checks} == {(d, s) for d in (4096, 65536) for s in ("none", "draft-mtp")}
    for c in checks:
        assert abs(c["calibrated"] / c["measured"] - 1) < 0.1, c


def test_a_run_on_an_h100_is_fitted_at_its_bandwidth() -> None:
    """The same kernel times from an H100 SXM: the GEMVs' fractions are of its 3.35 TB/s (so higher by 4.8 / 3.35),
    the attention tile time the same (the same SMs and clock), and the rows are the H100's, each still
    reproducing the run; a PCIe H100 is refused, not modelled as the SXM."""
    measured = json.loads(gc.MEASURED.read_text())
    host = json.loads((REPO / "docs" / "perf" / "gpu_time_model.json").read_text())
    h200 = gc.fit(measured)
    h100_run = measured | {"device": "NVIDIA H100 80GB HBM3"}
    e = gc.fit(h100_run)
    assert e.gemv_fraction_1 == pytest.approx(h200.gemv_fraction_1 * 4.8 / 3.35) and e.tile_us == h200.tile_us
    predicted = gc.predict(e, host["host_ms_per_token"], host["host_ms_per_mtp_cycle"], card="H100")
    assert {p["device"] for p in predicted} == {"H100", "2x2080Ti"}
    checks = gc.compare(predicted, h100_run)
    assert len(checks) == 4 and all(abs(c["calibrated"] / c["measured"] - 1) < 0.1 for c in checks), checks
    with pytest.raises(ValueError, match="only the SXM H100"):
        gc.fit(measured | {"device": "NVIDIA H100 PCIe"})


def test_attention_programs_follow_the_split_rule() -> None:
    assert gc.attention_programs(4096, 1) == (64, 16)  # 16 ranges of 256 keys x 4 KV heads
    assert gc.attention_programs(65536, 1) == (1024, 16)
    assert gc.attention_programs(262144, 1) == (1024, 64)  # 256 ranges of 1024
    assert gc.attention_programs(4096, 3) == (128, 16)  # 18 query rows: two 16-row blocks


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel under the interpreter")
def test_the_kernel_walks_the_ranges_the_model_counts() -> None:
    """decode_attention's own count of the cells each split walked (an ordered q8_0 cache, 1024 of 65536 cells
    filled, one KV head): as many ranges of as many tiles as attention_programs says."""
    from mtpserve.kernels.triton.attention import decode_attention

    cells, depth, n_splits = 65536, 1024, 256
    cache = torch.zeros(cells, 256 // 32 * 34, dtype=torch.uint8)
    k_pos = torch.full((cells,), -1, dtype=torch.int64)
    k_pos[:depth] = torch.arange(depth)
    counts = torch.zeros(n_splits, dtype=torch.int32)
    q = torch.randn(1, 6, 256)
    decode_attention(q, cache, cache, 8, 8, torch.tensor([depth - 1]), k_pos, n_kv_heads=1, head_dim=256,
                     scale=0.0625, ordered=True, n_splits=n_splits, split_counts=counts)  # fmt: skip
    programs, tiles = gc.attention_programs(depth, 1)
    walked = counts[counts > 0]
    assert len(walked) * 4 == programs and (walked == tiles * gc.KEYS_PER_TILE).all()  # the model's 4 KV heads
