"""y = x W^T on the GPU path (see ops.device), with W in its GGUF blocks: the quantized matmul of every model
when its activations live on a GPU.

* up to 8 activation rows (decode, speculative verification): `quant_gemv`, the fused dequantize + GEMV Triton
  kernel, which reads each weight byte once for all rows;
* more rows (prompts): from sm_80 the dequantize-in-the-loop tensor-core GEMM (`quant_matmul`, bf16 inputs);
  below (the RTX 2080 Ti is sm_75) Triton emits no tensor-core instructions, so the weight is dequantized by the
  Triton kernel and cuBLAS multiplies in fp16;
* float weights (F16/BF16/F32) multiply as stored; types without a kernel are dequantized per call
  (`quant_gemv_reference`: correct, slow).

The Triton kernels run on CUDA tensors, or on CPU ones under TRITON_INTERPRET=1 (the tests). `quant_gemv` and
`quant_linear` multiply float activations by dequantized weights and accumulate in float32; `quant_gemv_q8`
multiplies the activations' int8 quants by the weight's in integer block dots (decode of the types
kernels.triton.gemv_q8 covers). ops.linear_gpu rounds the activations to the weight's vec_dot type first, so the
products are llama.cpp's CPU ones up to summation order.
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType

import torch

from ..kernels.capability import cuda_capability
from ..quant.dequant import block_mins, dequantize, dequantize_without_mins
from ..quant.qtensor import QTensor
from ..quant.types import GGMLType, block_geometry
from .activation_rounding import PAIRED_ACTIVATIONS, Q8_1_ACTIVATIONS, q8_1_block_sums, unpair_halves
from .device import matmul_kernels

GEMV_MAX_ROWS = 8  # the GEMV reads the weights once for up to 8 rows (one launch); more rows go to the GEMM
# K splits of the integer GEMV for matrices of at most SPLIT_MAX_ROWS rows (the 27B's 5120-row projections give 640
# one-warp programs, too few to keep an H200's memory busy: 27% of a copy in the first run). 1 until a lent GPU
# measures the split: bench/gemv_l2.py's "q8 splitN" rows, bench/gpu.py --gemv-k-splits (docs/gpu-decode.md).
GEMV_K_SPLITS = 1
SPLIT_MAX_ROWS = 8192
# K steps ahead whose weights the Q4_K/Q5_K/Q6_K GEMVs prefetch into L2 (kernels/triton/prefetch.py): a program's
# steps then wait on L2 rather than DRAM. 0 until a lent GPU measures it: bench/gemv_l2.py's "q8 l2 aheadN" rows,
# bench/gpu.py --gemv-l2-ahead (docs/gpu-decode.md).
GEMV_L2_AHEAD = 0
_FLOAT_WEIGHTS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def quant_gemv_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLType | int) -> torch.Tensor:
    """x [m, k] times the matrix W [n, k] stored in uint8 `blocks` [n, k / QK * type_size] -> float32 [m, n]."""
    t = GGMLType(int(qtype))
    block_size, type_size = block_geometry(t)
    n, k = blocks.shape[0], blocks.shape[1] // type_size * block_size
    w = dequantize(blocks, t, (n, k)).to(x.device)
    return x.float() @ w.T


@cache
def triton_kernels() -> ModuleType | None:
    try:
        from ..kernels import triton as kernels
    except ImportError:  # triton not installed
        return None
    return kernels


def quant_gemv_q8_reference(
    xq: torch.Tensor, xd: torch.Tensor, blocks: torch.Tensor, qtype: GGMLType | int
) -> torch.Tensor:
    """The integer GEMV's twin: activation quants xq int8 [m, k] with their block scales xd float32 [m, k / block]
    times the matrix W [n, k] in `blocks` -> float32 [m, n] = (q * d) @ W.T, q in pairs (activation_rounding
    .pair_halves) for the IQ4 types, as their kernels read them. Q4_1/Q5_1 (w = d_w q_w + m_w) take Q8_1
    activations, xd unrounded: (q * f16(xd)) @ (d_w q_w).T + f16(xd * sum(q)) @ m_w.T."""
    t = GGMLType(int(qtype))
    block_size, type_size = block_geometry(t)
    n, k = blocks.shape[0], blocks.shape[1] // type_size * block_size
    q = (unpair_halves(xq) if t in PAIRED_ACTIVATIONS else xq).float()
    if t in Q8_1_ACTIVATIONS:
        q_blocks = q.reshape(q.shape[0], -1, 32)
        return q8_1_product(
            q_blocks, xd.half().float(), q8_1_block_sums(q_blocks, xd), QTensor(blocks, t, (n, k), "blocks")
        )
    x = q * xd.float().repeat_interleave(k // xd.shape[-1], dim=-1)
    return x @ dequantize(blocks, t, (n, k)).to(xq.device).T


def q8_1_product(q: torch.Tensor, d16: torch.Tensor, s16: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """llama.cpp's Q4_1/Q5_1 vec_dot in float32: Q8_1 activations (quants q [M, K/32, 32] as float, their f16 scales
    d16 and block sums s16 [M, K/32]) times weight [N, K] = (q * d16) @ (d_w q_w).T + s16 @ m_w.T -> [M, N]."""
    scaled = dequantize_without_mins(weight.data, weight.ggml_type, weight.shape).to(q.device)
    mins = block_mins(weight.data, weight.ggml_type, weight.shape).to(q.device)
    return (q * d16[..., None]).reshape(q.shape[0], -1) @ scaled.T + s16 @ mins.T


def triton_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on x: a CUDA tensor, or any under the interpreter."""
    return (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_kernels() is not None


INTERPRETED_MAX_ROWS = 8  # under the interpreter, decode-sized row-wise launches only (see triton_for_rows)


def triton_for_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether a row-wise kernel (one or more programs a row) takes Triton for `rows` rows of x: always on CUDA;
    under the interpreter, which runs programs one by one in Python, only for decode-sized inputs (a prompt's
    hundreds of rows take the twin: the model tests stay minutes, and the kernels' own tests cover long inputs)."""
    return triton_available(x) and (x.is_cuda or rows <= INTERPRETED_MAX_ROWS)


def use_triton(x: torch.Tensor, qtype: GGMLType | int) -> bool:
    """Whether `quant_gemv` takes the Triton kernel for activations x and weight type qtype."""
    kernels = triton_kernels()
    if not (triton_available(x) and matmul_kernels(x)) or kernels is None:
        return False
    return int(qtype) in {int(t) for t in kernels.GEMV_TYPES}


def _interpreter_tiles(x: torch.Tensor) -> bool:
    """Under the interpreter (CPU tensors) each Triton op costs the same at any tile size: wide tiles, few
    programs. On a GPU the kernels' own tile choices stand."""
    return not x.is_cuda


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(0, n - 1).bit_length()))


def gemm_compute_dtype(device: torch.device) -> torch.dtype:
    """The tensor-core input type: bf16 from compute capability 8.0, fp16 before (and under the interpreter)."""
    if device.type == "cuda" and cuda_capability(device)[0] >= 8:
        return torch.bfloat16
    return torch.float16


def quant_gemv(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x [..., K] -> float32 [..., N] for a 2-D QTensor weight [N, K], by the GEMV kernel (any number of rows:
    8 per launch)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if use_triton(x2, weight.ggml_type):
        kernels = triton_kernels()
        assert kernels is not None
        tiles = {"block_n": _pow2(weight.shape[0], 32, 1024)} if _interpreter_tiles(x2) else {}
        y = kernels.quant_gemv(x2, weight.data, int(weight.ggml_type), **tiles)
    else:
        y = quant_gemv_reference(x2, weight.data, weight.ggml_type)
    return y.reshape(*lead, weight.shape[0])


def quant_gemv_q8(
    xq: torch.Tensor,
    xd: torch.Tensor,
    weight: QTensor,
    *,
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantized activations xq int8 [..., K] with scales xd float32 [..., K / block] (the weight's vec_dot type:
    kernels.triton.gemv_q8.act_block) -> float32 [..., N] for a 2-D QTensor weight [N, K], plus `add` (float32
    [..., N], the residual stream) when given: the integer GEMV kernel where it runs (into `out`, a [rows, N] view,
    when given; the add in its epilogue), else the twin."""
    lead, k = xq.shape[:-1], xq.shape[-1]
    q2, d2 = xq.reshape(-1, k), xd.reshape(-1, xd.shape[-1])
    add2 = None if add is None else add.reshape(-1, add.shape[-1]).float().contiguous()
    kernels = triton_kernels()
    t = weight.ggml_type
    if use_triton(q2, t) and kernels is not None and int(t) in {int(q) for q in kernels.Q8_GEMV_TYPES} and k % 64 == 0:
        splits = GEMV_K_SPLITS if weight.shape[0] <= SPLIT_MAX_ROWS else 1
        ahead = GEMV_L2_AHEAD if int(t) in {int(q) for q in kernels.L2_AHEAD_TYPES} else 0
        y = kernels.quant_gemv_q8(q2, d2, weight.data, int(t), out=out, add=add2, k_splits=splits, l2_ahead=ahead)
    else:
        y = quant_gemv_q8_reference(q2, d2, weight.data, t)
        y = y if add2 is None else add2 + y
        if out is not None:
            out.copy_(y)
            y = out
    return y.reshape(*lead, weight.shape[0])


def quant_linear(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x [..., K] -> float32 [..., N]: GEMV for up to GEMV_MAX_ROWS rows, GEMM above, as the module says."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    t = weight.ggml_type
    if t in _FLOAT_WEIGHTS:
        w = weight.data.view(_FLOAT_WEIGHTS[t]).view(weight.shape)
        return (x2.float() @ w.float().T).reshape(*lead, weight.shape[0])
    if x2.shape[0] <= GEMV_MAX_ROWS or not use_triton(x2, t):  # the GEMM takes the GEMV's types (one unpacking)
        return quant_gemv(x, weight)
    kernels = triton_kernels()
    assert kernels is not None
    if x2.is_cuda and cuda_capability(x2.device)[0] < 8:
        # Triton emits no tensor-core instructions below sm_80: dequantize (exact, rounded once to fp16 as it is
        # written: 2 bytes a weight written and read, where float32 then .half() moved 12) and let cuBLAS multiply in
        # fp16, into float32 (an fp16 output is a third rounding; on the Gemma 3 slice it moved a 0.42-nat margin
        # to 0.05).
        w = kernels.dequant_blocks(weight.data, int(t), dtype=torch.float16)
        return torch.mm(x2.half(), w.T, out_dtype=torch.float32).reshape(*lead, weight.shape[0])
    tiles = {}
    if _interpreter_tiles(x2):
        tiles = {"block_m": _pow2(x2.shape[0], 16, 128), "block_n": _pow2(weight.shape[0], 16, 512)}
    y = kernels.quant_matmul(x2, weight.data, int(t), compute_dtype=gemm_compute_dtype(x2.device), **tiles)
    return y.reshape(*lead, weight.shape[0])
