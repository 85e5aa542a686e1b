"""bench/gpu_ncu.py: ncu's raw CSV page read into one line a case (times in any unit, the top stalls), a missing
ncu or GPU a skip, a case ncu gives nothing for a failed run, and the cases' launches wired (the interpreter)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_ncu  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = {
    "gpu__time_duration.sum": ("968,780", "nsecond"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("26.12", "%"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("11.8", "%"),
    "sm__maximum_warps_per_active_cycle_pct": ("12.5", "%"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("30.2", "%"),
    "launch__registers_per_thread": ("168", "register/thread"),
    "launch__grid_size": ("31,040", ""),
    "launch__occupancy_limit_registers": ("8", "block"),
    "launch__occupancy_limit_blocks": ("32", "block"),
    "l1tex__throughput.avg.pct_of_peak_sustained_active": ("91.5", "%"),
    gpu_ncu.SECTORS: ("1,600,000", "sector"),
    gpu_ncu.REQUESTS: ("100,000", ""),
    STALL.format("long_scoreboard"): ("9.5", "inst"),
    STALL.format("wait"): ("1.2", "inst"),
    STALL.format("math_pipe_throttle"): ("0.4", "inst"),
    STALL.format("short_scoreboard"): ("2.5", "inst"),
    STALL.format("barrier"): ("0", "inst"),
    STALL.format("not_selected"): ("0.1", "inst"),
}


def raw_page(metrics: dict[str, tuple[str, str]] = METRICS) -> str:
    """A `ncu --csv --page raw` run's stdout: ncu's and the program's lines, then header, units and a launch."""
    names = ["ID", "Kernel Name", *metrics]
    header = ",".join(f'"{n}"' for n in names)
    units = ",".join(f'"{u}"' for u in ["", "", *(u for _, u in metrics.values())])
    values = ",".join(f'"{v}"' for v in ["0", "_q6k_kernel", *(v for v, _ in metrics.values())])
    return "\n".join(["==PROF== Connected to process 4242", "launched: a case", header, units, values, ""])


def test_the_raw_page_reads_into_the_shown_columns_and_the_top_stalls() -> None:
    (launch,) = gpu_ncu.parse_raw(raw_page())
    s = gpu_ncu.summarise(launch)
    assert s["kernel"] == "_q6k_kernel"
    assert s["us"] == pytest.approx(968.78)  # nanoseconds, with a thousands separator
    assert (s["DRAM %"], s["occupancy %"], s["theoretical %"], s["issue %"]) == (26.12, 11.8, 12.5, 30.2)
    assert (s["registers"], s["programs"], s["blocks/SM by registers"]) == (168, 31040, 8)
    assert (s["L1 %"], s["L2 %"], s["sectors/request"]) == (91.5, None, 16.0)  # a metric ncu did not give: None
    assert list(s["stalls"].items()) == [("long_scoreboard", 9.5), ("short_scoreboard", 2.5), ("wait", 1.2),
                                         ("math_pipe_throttle", 0.4)]  # fmt: skip
    assert "| 968.8 | 26.1 | 11.8 | 12.5 | 30.2 | 91.5 | - | 168.0 | 31040 | 8.0 | 32.0 | 16.0 |" in gpu_ncu.table_line(
        "case", s
    )
    assert gpu_ncu.summarise(gpu_ncu.parse_raw(raw_page({"gpu__time_duration.sum": ("1.5", "msecond")}))[0])[
        "us"
    ] == pytest.approx(1500)
    assert gpu_ncu.parse_raw("==PROF== Disconnected\nno csv here\n") == []


def test_no_ncu_is_a_skip(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_ncu, "find_ncu", lambda: None)
    assert gpu_ncu.main(["--device", "cpu"]) == 0
    assert "ncu not found" in capsys.readouterr().out


def _fake_ncu(tmp_path: Path, stdout: str, rc: int) -> str:
    page = tmp_path / "page.txt"
    page.write_text(stdout)
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!/bin/sh\ncat {page}\nexit {rc}\n")
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    return str(ncu)


def test_a_case_ncu_profiles_is_a_line_and_one_it_does_not_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_ncu, "CASES", gpu_ncu.CASES[:1])
    monkeypatch.setattr(gpu_ncu, "find_ncu", lambda: _fake_ncu(tmp_path, raw_page(), 0))
    out = tmp_path / "ncu.json"
    assert gpu_ncu.main(["--device", "cpu", "--json", str(out)]) == 0
    assert "| Q6_K output 248320x5120, 3 rows | 968.8 |" in capsys.readouterr().out
    assert '"long_scoreboard": 9.5' in out.read_text()
    monkeypatch.setattr(gpu_ncu, "find_ncu", lambda: _fake_ncu(tmp_path, "==ERROR== the program failed\n", 1))
    assert gpu_ncu.main(["--device", "cpu"]) == 1
    assert "failed" in capsys.readouterr().out
    refused = "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU counters\n"
    monkeypatch.setattr(gpu_ncu, "find_ncu", lambda: _fake_ncu(tmp_path, refused, 1))
    assert gpu_ncu.main(["--device", "cpu"]) == 0  # counters refused on the machine: said, not failed
    assert "refused" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under the interpreter")
def test_the_cases_launch(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    gpu_ncu.launch(["q4k-qkv-1-split4", "attention-int8-1"], torch.device("cpu"), tiny=True)
    assert capsys.readouterr().out.count("launched: ") == 2
    with pytest.raises(ValueError, match="no case"):
        gpu_ncu.launch(["q4k"], torch.device("cpu"), tiny=True)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under the interpreter")
def test_every_case_launches(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    gpu_ncu.launch([case_id for case_id, *_ in gpu_ncu.CASES], torch.device("cpu"), tiny=True)
    assert capsys.readouterr().out.count("launched: ") == len(gpu_ncu.CASES)
