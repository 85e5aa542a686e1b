"""Dequantize-in-the-loop tensor-core GEMM over GGUF blocks as stored, for prefill: y = x @ W.T with x [M, K]
(any M, typically a prompt's 9..4096 rows) and W given as uint8 blocks [N, K / QK * type_size] (`QTensor.data`).

Each program owns a BLOCK_M x BLOCK_N tile of y and walks K one 32-value sub-tile at a time (BLOCK_K = 32): it
loads the raw bytes of its BLOCK_N weight rows' sub-tile, unpacks and scales them in registers with gemv.py's
`_dequant_sub` (so the float32 weights are the ones mtpserve.quant.dequant makes), casts them and the x tile to
the compute type (fp16 on GPUs without bf16, e.g. sm_75 like the RTX 2080 Ti; bf16 from sm_80) and multiplies
with `tl.dot` (tensor cores from sm_80), accumulating in float32. The dequantized weights never touch memory, so a
prompt reads 4.5-8.5 bits per weight instead of 16.

Caveat for sm_75 (seen by compiling for it with triton 3.9, no GPU): Triton no longer emits mma below sm_80
(triton-lang/triton PR #5066, late 2024), so there tl.dot compiles to FMA instructions, not tensor cores. The
kernel is correct on a 2080 Ti but runs at CUDA-core speed; tensor-core prefill there needs the weights
dequantized to fp16 and torch.matmul (cuBLAS).

Why BLOCK_K = 32: a sub-tile is a whole Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 block and exactly one sub-block of a
Q4_K/Q5_K/Q6_K super-block (QK = 256: eight sub-tiles), so every K step has one scale per weight row
and the unpacking is shared with the GEMV. A K-32 fp16/bf16 dot is two k-steps of the mma instruction; several
of them in a row accumulate into the same registers, as one wider dot would.

This module stays a leaf (kernels may import only torch, triton and gguf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..capability import cuda_capability
from ._device import on_input_device
from .gemv import GEMV_TYPES, SUB, _check, _dequant_sub

GEMM_TYPES = GEMV_TYPES  # one unpacking (`_dequant_sub`) serves both kernels
COMPUTE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Default tile, chosen without a GPU to be safe on sm_75..sm_90 rather than fastest. What a GPU would tune,
# per architecture and weight type: BLOCK_M/BLOCK_N (128x128 or 128x64 for long prompts, fewer wasted rows with
# 16/32 for short ones), num_warps (4 or 8: at 64x64 on sm_80 ptxas gives 168-194 registers a thread with 4,
# about 105-128 with 8, so 8 may hide more latency) and num_stages (2-4, software pipelining of the byte loads; sm_75
# has less shared memory than sm_80+), GROUP_M (the L2 reuse of x and W across neighbouring programs), and
# whether a wider K step (two sub-tiles joined, BLOCK_K = 64) or splitting K across programs for small M and
# large K pays; all are a triton.autotune config list keyed on (M bucket, N, K, type).
BLOCK_M = 64
BLOCK_N = 64
GROUP_M = 8
NUM_WARPS = 4


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    n_blocks,
    stride_xm,
    stride_wn,
    stride_ym,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    COMPUTE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row tiles of x go through one column tile of W before the next, so both stay in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    ns_safe = tl.where(n_ok, ns, 0)  # rows past N re-read row 0 instead of masking every byte load
    offs = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + ns_safe.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    SUBS: tl.constexpr = QK // BLOCK_K
    # One loop over all sub-tiles, not blocks x an unrolled 8 for the super-block types: unrolled, the compiler
    # hoists eight sub-tiles' loads and spills (2-3 KB a thread for Q5_K/Q6_K at 64 x 64 on sm_80, ptxas -v);
    # so the sub-tile index j is a run-time value here and `_dequant_sub` selects rather than branches on it.
    for s in range(n_blocks * SUBS):
        bp = w_rows + (s // SUBS) * TYPE_SIZE
        w = _dequant_sub(bp, offs[None, :], s % SUBS, QTYPE).to(COMPUTE)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + s * BLOCK_K + offs[None, :], mask=m_ok[:, None], other=0.0).to(COMPUTE)
        if IEEE:  # float32 compute means float32 products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + ms.to(tl.int64)[:, None] * stride_ym + ns[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _num_warps(device: torch.device) -> int:
    """NUM_WARPS, or 8 before sm_80: tl.dot's FMA lowering there spills with 4 warps at 64 x 64 (ptxas -v)."""
    if device.type == "cuda" and cuda_capability(device)[0] < 8:
        return 2 * NUM_WARPS
    return NUM_WARPS


def _block_m(m: int) -> int:
    """The row tile: BLOCK_M, or for a short prompt the smallest power of two >= m (tl.dot needs >= 16)."""
    return BLOCK_M if m >= BLOCK_M else max(16, triton.next_power_of_2(m))


@on_input_device
def quant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    *,
    compute_dtype: torch.dtype = torch.float16,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """x [M, K] (float16/bfloat16/float32) times the GGUF matrix W [N, K] in `blocks` -> float32 [M, N] = x @ W.T.

    `qtype` is a GGML type id (a GGMLQuantizationType). x and W are rounded to `compute_dtype` (float16 or
    bfloat16 for the tensor cores; float32 for exact products, slow on a GPU) and accumulated in float32.
    `block_m`/`block_n` override the tile (powers of two >= 16); by default it depends only on M."""
    t, qk, type_size = _check(blocks, qtype, "GEMM")
    n, n_blocks = blocks.shape[0], blocks.shape[1] // type_size
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be float16, bfloat16 or float32, got {compute_dtype}")
    if x.dim() != 2 or x.shape[1] != n_blocks * qk:
        raise ValueError(f"x must be [m, {n_blocks * qk}] for this weight, got {list(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != blocks.device:
        raise ValueError(f"x is on {x.device} but the weight blocks are on {blocks.device}")
    bm = _block_m(x.shape[0]) if block_m is None else block_m
    for name, size in (("block_m", bm), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {size}")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    x = x.contiguous()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x,
        blocks,
        y,
        m,
        n,
        n_blocks,
        x.stride(0),
        blocks.stride(0),
        y.stride(0),
        QTYPE=int(t),
        QK=qk,
        TYPE_SIZE=type_size,
        COMPUTE=COMPUTE_DTYPES[compute_dtype],
        IEEE=compute_dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=SUB,
        GROUP_M=GROUP_M,
        num_warps=_num_warps(x.device),
    )
    return y
