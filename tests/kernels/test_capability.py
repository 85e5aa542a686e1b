"""kernels.capability: every per-architecture choice of the GPU path reads `cuda_capability`, which
MTPSERVE_CUDA_CAPABILITY lowers, so a newer GPU can run the RTX 2080 Ti's (sm_75) branches against their twins.
Checked here with the device's capability stubbed: no GPU is needed to see which branch each choice takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mtpserve.kernels.capability import CAPABILITY_ENV, cuda_capability
from mtpserve.kernels.triton import gated_delta, gemm
from mtpserve.ops.attention import prompt_attention_dtype
from mtpserve.ops.quant_gemv import gemm_compute_dtype

SRC = Path(__file__).resolve().parents[2] / "src" / "mtpserve"
CUDA = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("env", "seen"), [(None, (9, 0)), ("7.5", (7, 5)), ("8", (8, 0)), ("10.0", (9, 0))])
def test_the_override_only_lowers(h200, env, seen):
    if env is not None:
        h200.setenv(CAPABILITY_ENV, env)
    assert cuda_capability(CUDA) == seen


def test_a_malformed_override_says_what_it_wants(h200):
    h200.setenv(CAPABILITY_ENV, "turing")
    with pytest.raises(ValueError, match="such as 7.5"):
        cuda_capability(CUDA)


def test_every_choice_takes_the_turing_branch_under_the_override(h200):
    natively = (gemm_compute_dtype(CUDA), prompt_attention_dtype(CUDA), gemm._num_warps(CUDA))
    scan = gated_delta.chunk_scan_supported(CUDA, 64, 128)
    assert natively == (torch.bfloat16, torch.bfloat16, gemm.NUM_WARPS) and scan
    h200.setenv(CAPABILITY_ENV, "7.5")
    as_turing = (gemm_compute_dtype(CUDA), prompt_attention_dtype(CUDA), gemm._num_warps(CUDA))
    assert as_turing == (torch.float16, torch.float16, 2 * gemm.NUM_WARPS)
    assert not gated_delta.chunk_scan_supported(CUDA, 64, 128)


def test_no_choice_reads_the_device_capability_around_the_override():
    direct = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if path.name != "capability.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"get_device_capability\(", line)
    ]
    assert direct == [], "read the capability through kernels.capability.cuda_capability"
