"""bench/numerics_vs_llama.py: llama.cpp's top-5 log-probabilities against the CPU path, teacher-forced with
llama-server's prompt batches, and the model's own spread under a 1e-5 change at its first block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import shared_path

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_path_lies_within_the_spread_a_tiny_change_makes(tmp_path: Path) -> None:
    """tinyqwen35, two positions of each case: the CPU path's distance from llama.cpp stays under the near-tie
    bound (0.05 nats) and the perturbed run really moved (a perturbation that did nothing would read 0)."""
    shared_path("fixtures", "tinyqwen35-mtp-Q4_K_M.gguf")
    out = tmp_path / "numerics.json"
    command = [sys.executable, str(REPO / "bench" / "numerics_vs_llama.py"), "--model", "tinyqwen35"]
    command += ["--positions", "2", "--perturb", "1e-5", "--json", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    ours, perturbed = result["rows"]["against llama.cpp"], result["rows"]["perturbed by 1e-05 at block 0"]
    assert result["positions"] == 2 and ours["n"] == perturbed["n"] == 6 * 2 * 5  # cases x positions x top 5
    assert ours["max"] < 0.05
    assert perturbed["max"] > 0
