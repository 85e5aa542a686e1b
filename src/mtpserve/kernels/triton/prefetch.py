"""L2 prefetch for the decode GEMVs' weights: a hint that costs no register and makes no load wait.

The first H200 run measured the integer GEMVs at 27-58% of a copy's bandwidth with 12-23 one-warp programs an SM
(docs/gpu-decode.md). Each program streams its K loop step by step: a step's weight loads go out at its top and
its arithmetic waits for them, so every step pays a DRAM latency, and ffn_down's 17 steps pay 17 in a row. A
register double buffer (the GEMV's `prefetch` choice) holds a second step in flight but costs the registers that set
the occupancy, and spills at 3 activation rows. `prefetch.global.L2` asks the memory system to bring a 32-byte
sector into L2 and returns at once: `L2_AHEAD` steps ahead, a step's loads then find their weights in L2 (a few
hundred cycles) rather than DRAM, and a program keeps that many steps of its weights in flight without a register.
CUTLASS's Hopper GEMM for low-latency inference prefetches its weights into L2 the same way, before its PDL wait.

Results cannot change: a prefetch moves no data into a register, and L2 is the device's point of coherence, so a
sector brought in early is the sector a later load reads. Under TRITON_INTERPRET=1 it is nothing at all.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, ASM: tl.constexpr):
    """Bring the 32-byte sector at each address into L2 (`prefetch.global.L2`, one a pointer); nothing without ASM."""
    if ASM:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs.to(tl.int64, bitcast=True)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def lane_first(c, SIZE: tl.constexpr):
    """Where lane c (0..3) of a SIZE-byte block (132 < SIZE <= 256) starts its part: 64 c bytes in, held back to end
    at the block's last byte (Q6_K's 210 bytes: 0, 64, 128, 177)."""
    tl.static_assert(132 < SIZE and SIZE <= 256)
    return tl.minimum(c * 64, SIZE - 33)


@triton.jit
def prefetch_lane(first, ASM: tl.constexpr):
    """A lane's part of its block: the sectors holding bytes `first` and `first` + 32 (byte pointers). The four lanes'
    bytes start at the block's first byte, end at its last and lie at most 32 apart, so every sector the block
    touches holds one of them."""
    prefetch_l2(first, ASM)
    prefetch_l2(first + 32, ASM)


def lane_bytes(block_bytes: int) -> list[int]:
    """The bytes whose sectors the four lanes prefetch, as lane_first and prefetch_lane pick them (the tests hold
    them to touching every sector of the block)."""
    firsts = [min(64 * c, block_bytes - 33) for c in range(4)]
    return sorted(b for first in firsts for b in (first, first + 32))
