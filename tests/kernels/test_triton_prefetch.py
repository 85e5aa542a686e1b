"""L2 prefetch ahead of the GEMVs' loads (kernels/triton/prefetch.py): which sectors the lanes prefetch, and the
check (tests/support/gpu_compile.py) that a GEMV launched with `l2_ahead` carries its prefetches, the first steps'
before a PDL wait, and that no other launch carries any. That the result is the default's bit for bit is held under
the interpreter in test_triton_gemv_q8 (and on a GPU by the same test in the GPU check's test stage); what it is
worth, on a lent GPU (bench/gemv_l2.py's "q8 l2 aheadN" rows, bench/gpu.py --gemv-l2-ahead)."""

from __future__ import annotations

import pytest

from mtpserve.kernels.triton.prefetch import lane_bytes
from tests.kernels.test_gpu_compile import compile_kernels
from tests.support.compiler import require_compiler
from tests.support.gpu_compile import l2_prefetch_problems

PREFETCH = "prefetch.global.L2 [%rd1];"
WAIT = "griddepcontrol.wait;"


@pytest.mark.parametrize("size", [144, 176, 210], ids=["Q4_K", "Q5_K", "Q6_K"])
def test_the_lanes_touch_every_sector_of_a_block_wherever_it_starts(size: int) -> None:
    """The eight bytes four lanes prefetch the sectors of lie in the block and hit every 32-byte sector it touches,
    for each of its 32 possible starts in a sector (Q6_K's 210-byte blocks start anywhere)."""
    marks = lane_bytes(size)
    assert len(marks) == 8 and min(marks) == 0 and max(marks) == size - 1
    for start in range(32):
        touched = {(start + b) // 32 for b in range(size)}
        assert {(start + b) // 32 for b in marks} == touched, start


def test_the_check_counts_a_launchs_prefetches() -> None:
    """Two a block a lane, for the loop's step and the prologue's L2_AHEAD: 4 blocks a thread (8 rows, 4 super-blocks
    a step) at L2_AHEAD 2 is 8 x 3 = 24; the prologue's 16 before the PDL wait; none in a launch without it."""
    tile = {"BLOCK_N": 8, "SB": 4}
    ahead = {**tile, "L2_AHEAD": 2}
    assert l2_prefetch_problems("\n".join([PREFETCH] * 24), ahead) == []
    assert l2_prefetch_problems("\n".join([PREFETCH] * 23), ahead) == ["23 prefetch.global.L2 in its PTX, want 24"]
    assert l2_prefetch_problems("", tile) == []
    assert l2_prefetch_problems(PREFETCH, tile) == ["1 prefetch.global.L2 in its PTX, want 0"]
    with_pdl = {**ahead, "PDL": True}
    assert l2_prefetch_problems("\n".join([PREFETCH] * 16 + [WAIT] + [PREFETCH] * 8), with_pdl) == []
    assert l2_prefetch_problems("\n".join([PREFETCH] * 8 + [WAIT] + [PREFETCH] * 16), with_pdl) == [
        "8 prefetch.global.L2 before griddepcontrol.wait, want the first 2 steps'"
    ]


def test_the_prefetching_gemvs_compile_for_sm90_with_their_prefetches() -> None:
    """Q4_K, Q5_K and Q6_K at 1 and 3 activation rows with l2_ahead=2, compiled for sm_90: no spills, and each
    carries its prefetches (the check above runs on every compile)."""
    require_compiler()
    out = compile_kernels("--arch", "90", "--only", "l2_ahead", kernels=("gemv_q8",))
    assert sum(" ok " in line and "l2_ahead=2" in line for line in out.splitlines()) == 6, out
    assert "0 of them spill" in out, out
