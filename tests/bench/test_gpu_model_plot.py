"""bench/gpu_model_plot.py draws the committed time model: its static rows are docs/perf/gpu_time_model.json's
predictions, its measured points the H200 run's, and it writes a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_model_plot as gmp  # noqa: E402


def test_the_plot_draws_the_committed_predictions_and_the_run(tmp_path: Path) -> None:
    out, series_json = tmp_path / "model.png", tmp_path / "series.json"
    assert gmp.main(["--out", str(out), "--json", str(series_json)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(series_json.read_text())
    committed = json.loads((REPO / "docs" / "perf" / "gpu_time_model.json").read_text())
    table = {
        (p["device"], p["context"]): p["tok_s"]
        for p in committed["predicted"] + committed["predicted_row_split"]
        if p["spec"] == "draft-mtp"
    }
    drawn = 0
    for label, source, device, *_ in gmp.SERIES:
        tok_s = dict(zip(data["contexts"], data["series"][label]["tok_s"], strict=True))
        assert len(tok_s) == len(gmp.CONTEXTS) and all(t > 0 for t in tok_s.values())
        assert all(a > b for a, b in zip(list(tok_s.values()), list(tok_s.values())[1:])), label  # deeper is slower
        if source == "static":
            for context in (4096, 131072):
                assert tok_s[context] == table[(device, context)], (label, context)
                drawn += 1
    assert drawn == 6
    run = json.loads((REPO / "docs" / "perf" / "h200_decode_2026-12-04.json").read_text())
    assert data["measured_h200"] == {str(r["depth"]): round(r["mtp_tokens_per_s"], 1) for r in run["decode"]}
