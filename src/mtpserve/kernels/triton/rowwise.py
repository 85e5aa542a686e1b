"""Row-wise kernels that make a matmul input in one launch: the float32 activation row and its rounding to the
weight type's llama.cpp "vec_dot type" (../shared/spec/gguf-quant-formats.md §5), computed together.

* `quantize_rows`: x [M, K] -> int8 q [M, K] and float32 d [M, K / block], per block of 256 (quantize_row_q8_K:
  iscale = -127 / the signed element of largest magnitude, q = min(127, rint(iscale * x)), d = 1 / iscale) or of
  32 (quantize_row_q8_0: q = rint(x * (127 / amax)), d = amax / 127 rounded to f16, the d the dot uses; with `q8_1`
  d unrounded, from which the Q4_1/Q5_1 GEMV takes both the dot's f16 d and Q8_1's block sum s = f16(d * sum(q))).
  With `paired`, each 32 quants are stored as 16 pairs (v0, v16, v1, v17, ...): the order IQ4's integer GEMV reads.
* `rms_norm_quantize`: s = x + add (the residual stream), y = s / sqrt(mean(s^2) + eps) * weight, and y quantized.
* `glu_quantize`: y = act(gate) * up for SwiGLU ("silu"), a sigmoid gate ("sigmoid") and llama.cpp's CPU GeGLU
  ("gelu_f16": tanh-GELU of the f16-rounded gate, rounded to f16; 0 at or below -10, the identity at or above 10),
  and y quantized. gate and up may be strided views (the two halves of one [M, 2F] GEMV output).

The quantization is bit-exact to mtpserve.ops.linear's quantize_activations_q8_k / q8_0 applied to the kernel's own
y: the divisions are correctly rounded (tl.div_rn: Triton's `/` on float32 is the approximate div.full.f32) and the
rounding is half to even (libdevice rint when compiled; the 1.5 * 2^23 trick under the interpreter, whose numpy
arithmetic never fuses it into an FMA). Each block's values sit in one row of a [blocks, block] register tile, so a
block's reductions (amax, the first index reaching it, the signed peak) are axis-1 reductions of that tile.

The PyTorch twins and the dispatchers are in mtpserve.ops.rowwise; this module stays a leaf and imports neither.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._device import on_input_device
from .intdot import INLINE_ASM
from .pdl import dependent_launch, launch_options

QUANT_BLOCKS = (32, 256)  # Q8_0 / Q8_K activation blocks
GLU_ACTS = ("silu", "sigmoid", "gelu_f16")
MAX_ROW_TILE = 8192  # the norm holds up to this many values of a row in registers (16 a thread at 16 warps)
DEFAULT_CHUNK = 512  # values per program of quantize / glu: 34 programs a row at F = 17408, 16-byte accesses
_PLAIN_BLOCK = 256  # the tile's row length when nothing is quantized (any power of two would do)


@triton.jit
def _round_half_even(x, COMPILED: tl.constexpr):
    """x rounded to the nearest integer, ties to even (|x| < 2^22 under the interpreter)."""
    if COMPILED:
        return libdevice.rint(x)
    else:
        return (x + 12582912.0) - 12582912.0


@triton.jit
def _exp(x, COMPILED: tl.constexpr):
    """e^x, as accurate as torch's CUDA expf (tl.exp is ex2.approx of x * log2(e): ~1e-6 relative at |x| ~ 20)."""
    if COMPILED:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _paired(offs):
    """Where value offs of its 32 (rows start at multiples of 32) is stored in the paired order: j -> 2j for the
    first 16, 2 (j - 16) + 1 for the next."""
    j = offs % 32
    return offs + tl.where(j < 16, j, j - 31)


@triton.jit
def q8_0_blocks(y, COMPILED: tl.constexpr):
    """y [blocks, 32] as quantize_row_q8_0 rounds an activation: (q [blocks, 32] float, integral; d [blocks] float32,
    amax / 127 rounded to f16, the d the dot uses)."""
    amax = tl.max(tl.abs(y), axis=1)
    return q8_0_quants(y, amax[:, None], COMPILED), q8_0_scale(amax)


@triton.jit
def q8_0_quants(y, amax, COMPILED: tl.constexpr):
    """y's q8_0 quants (float, integral) where its block's largest magnitude is amax (broadcast to y's shape)."""
    nz = amax > 0.0
    inv = tl.where(nz, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(nz, amax, 1.0)), 0.0)
    return _round_half_even(y * inv, COMPILED)


@triton.jit
def q8_0_scale(amax):
    """A q8_0 block's scale d from its largest magnitude: amax / 127 rounded to f16, as float32."""
    return q8_1_scale(amax).to(tl.float16).to(tl.float32)


@triton.jit
def q8_1_scale(amax):
    """amax / 127, unrounded: the d from which q8_1 takes both its f16 d and its block sum."""
    return tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def _quantize_store(
    y,
    offs,
    ok,
    q_ptr,
    d_ptr,
    d_offs,
    d_ok,
    BLOCK: tl.constexpr,
    PAIRED: tl.constexpr,
    Q8_1: tl.constexpr,
    COMPILED: tl.constexpr,
):
    """Quantize y [blocks, BLOCK] block by block (row by row) and store q int8 at offs (paired: `_paired(offs)`), d
    float32 at d_offs (Q8_1: unrounded)."""
    ay = tl.abs(y)
    amax = tl.max(ay, axis=1)
    if BLOCK == 256:
        cols = tl.arange(0, BLOCK)
        # llama.cpp keeps the first element of largest magnitude: with +a and -a both present its sign decides q's.
        first = tl.min(tl.where(ay == amax[:, None], cols[None, :], BLOCK), axis=1)
        peak = tl.sum(tl.where(cols[None, :] == first[:, None], y, 0.0), axis=1)
        nz = peak != 0.0
        iscale = tl.where(nz, tl.div_rn(tl.full(peak.shape, -127.0, tl.float32), tl.where(nz, peak, 1.0)), 0.0)
        q = tl.minimum(_round_half_even(y * iscale[:, None], COMPILED), 127.0)
        d = tl.where(nz, tl.div_rn(tl.full(peak.shape, 1.0, tl.float32), tl.where(nz, iscale, 1.0)), 0.0)
    elif Q8_1:
        q = q8_0_quants(y, amax[:, None], COMPILED)
        d = q8_1_scale(amax)
    else:
        q, d = q8_0_blocks(y, COMPILED)
    tl.store(q_ptr + (_paired(offs) if PAIRED else offs), q.to(tl.int8), mask=ok)
    tl.store(d_ptr + d_offs, d, mask=d_ok)


@triton.jit
def _load_sum(x_ptr, add_ptr, row, offs, ok, sx_m, sx_k, sa_m, sa_k, HAS_ADD: tl.constexpr):
    s = tl.load(x_ptr + row * sx_m + offs * sx_k, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        s += tl.load(add_ptr + row * sa_m + offs * sa_k, mask=ok, other=0.0).to(tl.float32)
    return s


@triton.jit
def _norm_store(
    s,
    r,
    offs,
    ok,
    block0,
    row,
    K,
    w_ptr,
    y_ptr,
    q_ptr,
    d_ptr,
    HAS_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRED: tl.constexpr,
    Q8_1: tl.constexpr,
    NB: tl.constexpr,
    COMPILED: tl.constexpr,
):
    """y = s * r * weight for one tile of a row (its first block is block0), stored with its quantization."""
    y = s * r
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * K + offs, y, mask=ok)
    if QUANT:
        n_blocks = K // BLOCK
        blocks = block0 + tl.arange(0, NB)
        d_offs = row * n_blocks + blocks
        _quantize_store(y, row * K + offs, ok, q_ptr, d_ptr, d_offs, blocks < n_blocks, BLOCK, PAIRED, Q8_1, COMPILED)


@triton.jit
def _norm_kernel(
    x_ptr,
    add_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    q_ptr,
    d_ptr,
    K,
    k_float,
    eps,
    sx_m,
    sx_k,
    sa_m,
    sa_k,
    HAS_ADD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    STORE_S: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRED: tl.constexpr,
    Q8_1: tl.constexpr,
    CHUNK: tl.constexpr,
    SINGLE: tl.constexpr,
    COMPILED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = CHUNK // BLOCK
    tile = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if SINGLE:  # the whole row in registers: one read of x (and add)
        ok = tile < K
        s = _load_sum(x_ptr, add_ptr, row, tile, ok, sx_m, sx_k, sa_m, sa_k, HAS_ADD)
        if STORE_S:
            tl.store(s_ptr + row * K + tile, s, mask=ok)
        total = tl.sum(tl.sum(s * s, axis=1), axis=0)
    else:  # longer rows: a pass for the sum of squares, a second (from L2) for the output
        acc = tl.zeros([NB, BLOCK], dtype=tl.float32)
        for c in range(0, K, CHUNK):
            ok = c + tile < K
            s = _load_sum(x_ptr, add_ptr, row, c + tile, ok, sx_m, sx_k, sa_m, sa_k, HAS_ADD)
            if STORE_S:
                tl.store(s_ptr + row * K + c + tile, s, mask=ok)
            acc += s * s
        total = tl.sum(tl.sum(acc, axis=1), axis=0)
    mean = tl.div_rn(total, k_float)
    r = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))  # correctly rounded, where tl.rsqrt is rsqrt.approx
    if SINGLE:
        _norm_store(
            s, r, tile, ok, 0, row, K, w_ptr, y_ptr, q_ptr, d_ptr, HAS_WEIGHT, QUANT, BLOCK, PAIRED, Q8_1, NB, COMPILED
        )
    else:
        for c in range(0, K, CHUNK):
            ok = c + tile < K
            s = _load_sum(x_ptr, add_ptr, row, c + tile, ok, sx_m, sx_k, sa_m, sa_k, HAS_ADD)
            _norm_store(
                s,
                r,
                c + tile,
                ok,
                c // BLOCK,
                row,
                K,
                w_ptr,
                y_ptr,
                q_ptr,
                d_ptr,
                HAS_WEIGHT,
                QUANT,
                BLOCK,
                PAIRED,
                Q8_1,
                NB,
                COMPILED,
            )


@triton.jit
def _quant_kernel(
    x_ptr,
    q_ptr,
    d_ptr,
    K,
    sx_m,
    sx_k,
    BLOCK: tl.constexpr,
    PAIRED: tl.constexpr,
    Q8_1: tl.constexpr,
    CHUNK: tl.constexpr,
    COMPILED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = CHUNK // BLOCK
    block0 = tl.program_id(1) * NB
    offs = block0 * BLOCK + tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = offs < K
    x = tl.load(x_ptr + row * sx_m + offs * sx_k, mask=ok, other=0.0).to(tl.float32)
    blocks = block0 + tl.arange(0, NB)
    n_blocks = K // BLOCK
    d_offs = row * n_blocks + blocks
    _quantize_store(x, row * K + offs, ok, q_ptr, d_ptr, d_offs, blocks < n_blocks, BLOCK, PAIRED, Q8_1, COMPILED)


@triton.jit
def _glu_kernel(
    g_ptr,
    u_ptr,
    y_ptr,
    q_ptr,
    d_ptr,
    F,
    sg_m,
    sg_g,
    sg_k,
    su_m,
    su_g,
    su_k,
    ACT: tl.constexpr,
    GROUP: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRED: tl.constexpr,
    Q8_1: tl.constexpr,
    CHUNK: tl.constexpr,
    COMPILED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = CHUNK // BLOCK
    block0 = tl.program_id(1) * NB
    offs = block0 * BLOCK + tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = offs < F
    if GROUP:  # a row of groups of GROUP values (heads), each group at its own stride
        g_offs = (offs // GROUP) * sg_g + (offs % GROUP) * sg_k
        u_offs = (offs // GROUP) * su_g + (offs % GROUP) * su_k
    else:
        g_offs, u_offs = offs * sg_k, offs * su_k
    g = tl.load(g_ptr + row * sg_m + g_offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su_m + u_offs, mask=ok, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = tl.div_rn(g, 1.0 + _exp(-g, COMPILED))  # div_rn: `/` is the approximate div.full.f32
    elif ACT == "sigmoid":
        a = tl.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + _exp(-g, COMPILED))
    else:  # gelu_f16: 0.5 h (1 + tanh(z)), z = sqrt(2/pi) (h + 0.044715 h^3), h = f16(g)
        h = g.to(tl.float16).to(tl.float32)
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        # 1 + tanh(z) = 2 sigmoid(2z), then snapped to the 2^-24 grid a float32 tanh in [-1, -0.5] lies on (torch's and
        # llama.cpp's 1 + tanhf): the left tail then cancels to 0 where theirs does
        p = tl.div_rn(tl.full(g.shape, 2.0, tl.float32), 1.0 + _exp(-2.0 * z, COMPILED))
        p = tl.where(p < 0.5, _round_half_even(p * 16777216.0, COMPILED) * (1.0 / 16777216.0), p)
        table = (0.5 * h * p).to(tl.float16).to(tl.float32)
        a = tl.where(g <= -10.0, 0.0, tl.where(g >= 10.0, g, table))
    y = a * u
    tl.store(y_ptr + row * F + offs, y, mask=ok)
    if QUANT:
        blocks = block0 + tl.arange(0, NB)
        n_blocks = F // BLOCK
        d_offs = row * n_blocks + blocks
        _quantize_store(y, row * F + offs, ok, q_ptr, d_ptr, d_offs, blocks < n_blocks, BLOCK, PAIRED, Q8_1, COMPILED)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 2-D float tensor [M, K], got {x.dtype} {list(x.shape)}")


def _quant_outputs(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Empty q int8 [M, K] and d float32 [M, K / block] (None, None when block is None)."""
    if block is None:
        return None, None
    M, K = x.shape
    if block not in QUANT_BLOCKS or K % block:
        raise ValueError(f"block must be one of {QUANT_BLOCKS} and divide K={K}, got {block}")
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    return q, torch.empty(M, K // block, dtype=torch.float32, device=x.device)


def _q8_1(q8_1: bool, block: int | None) -> bool:
    """Whether d is stored unrounded (Q8_1): only 32-value blocks have the choice."""
    if q8_1 and block != 32:
        raise ValueError(f"q8_1 quantizes 32-value blocks, got block {block}")
    return q8_1


def _chunk(chunk: int | None, block: int) -> int:
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    return max(chunk, block)


@on_input_device
def quantize_rows(
    x: torch.Tensor, block: int, *, paired: bool = False, q8_1: bool = False, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] (any strides) -> (q int8 [M, K], d float32 [M, K / block]) as the module says. One launch,
    grid (M, K / chunk): each program quantizes `chunk` values (default 512, 4 warps), chunk / block blocks."""
    _check_rows("x", x)
    q, d = _quant_outputs(x, block)
    assert q is not None and d is not None
    M, K = x.shape
    chunk = _chunk(chunk, block)
    if q.numel():
        grid = (M, triton.cdiv(K, chunk))
        _quant_kernel[grid](
            x, q, d, K, *x.stride(), BLOCK=block, PAIRED=paired, Q8_1=_q8_1(q8_1, block), CHUNK=chunk,
            COMPILED=INLINE_ASM, num_warps=4, **launch_options(x),
        )  # fmt: skip
    return q, d


@on_input_device
def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    add: torch.Tensor | None = None,
    block: int | None = None,
    paired: bool = False,
    q8_1: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] (+ add [M, K]) -> (s, y, q, d): s = x + add (x itself when add is None and x is float32), y =
    RMSNorm(s) * weight in float32, and y quantized per `block` (q, d None when block is None). One launch, one
    program per row (the norm needs the whole row's sum): a row of K <= 8192 sits in registers as a
    [next_pow2(K) / block, block] tile at up to 16 warps and is read once; longer rows (or a smaller `chunk`) loop
    over chunks twice, the second pass re-reading x and add from L2."""
    _check_rows("x", x)
    M, K = x.shape
    if add is not None and (add.shape != x.shape or not add.dtype.is_floating_point):
        raise ValueError(f"add must be a float tensor of x's shape {list(x.shape)}, got {add.dtype} {list(add.shape)}")
    if weight is not None and (weight.shape != (K,) or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous [{K}], got {list(weight.shape)}")
    q, d = _quant_outputs(x, block)
    store_s = add is not None or x.dtype != torch.float32
    s = torch.empty(M, K, dtype=torch.float32, device=x.device) if store_s else x
    y = torch.empty(M, K, dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return s, y, q, d
    tile_block = _PLAIN_BLOCK if block is None else block
    chunk = max(tile_block, min(triton.next_power_of_2(K), MAX_ROW_TILE if chunk is None else chunk))
    a = x if add is None else add
    _norm_kernel[(M,)](
        x,
        a,
        y if weight is None else weight,
        s,
        y,
        y if q is None else q,
        y if d is None else d,
        K,
        float(K),
        float(eps),
        *x.stride(),
        *a.stride(),
        HAS_ADD=add is not None,
        HAS_WEIGHT=weight is not None,
        STORE_S=store_s,
        QUANT=block is not None,
        BLOCK=tile_block,
        PAIRED=paired,
        Q8_1=_q8_1(q8_1, block),
        CHUNK=chunk,
        SINGLE=chunk >= K,
        COMPILED=INLINE_ASM,
        num_warps=max(4, min(16, chunk // 512)),
        **launch_options(x),
    )
    return s, y, q, d


@on_input_device
def glu_quantize(
    gate: torch.Tensor,
    up: torch.Tensor,
    act: str,
    *,
    block: int | None = None,
    paired: bool = False,
    q8_1: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gate, up [M, F] (any strides: e.g. the halves of one [M, 2F] GEMV output) or [M, G, D] (groups of D values,
    each at its own stride: e.g. the gate heads interleaved with the query heads of one GEMV output) -> (y, q, d): y
    [M, F = G * D] = act(gate) * up in float32 (act in GLU_ACTS, as the module says) and y quantized per `block` (q,
    d None when block is None). One launch, grid (M, F / chunk): each program does `chunk` values (default 512, 4
    warps)."""
    if gate.dim() == 3 and gate.dtype.is_floating_point:  # groups: read through their strides, never copied
        group = gate.shape[2]
        M, F = gate.shape[0], gate.shape[1] * group
    else:
        _check_rows("gate", gate)
        group, (M, F) = 0, gate.shape
    if up.shape != gate.shape or not up.dtype.is_floating_point:
        raise ValueError(f"up must be a float tensor of gate's shape {list(gate.shape)}, got {list(up.shape)}")
    if act not in GLU_ACTS:
        raise ValueError(f"act must be one of {GLU_ACTS}, got {act!r}")
    y = torch.empty(M, F, dtype=torch.float32, device=gate.device)
    q, d = _quant_outputs(y, block)
    if y.numel() == 0:
        return y, q, d
    tile_block = _PLAIN_BLOCK if block is None else block
    chunk = _chunk(chunk, tile_block)
    # (row, group, element) strides: one group of F values a row when the rows are plain
    strides = [x.stride() if group else (x.stride(0), 0, x.stride(1)) for x in (gate, up)]
    _glu_kernel[(M, triton.cdiv(F, chunk))](
        gate,
        up,
        y,
        y if q is None else q,
        y if d is None else d,
        F,
        *strides[0],
        *strides[1],
        ACT=act,
        GROUP=group,
        QUANT=block is not None,
        BLOCK=tile_block,
        PAIRED=paired,
        Q8_1=_q8_1(q8_1, block),
        CHUNK=chunk,
        COMPILED=INLINE_ASM,
        num_warps=4,
        **launch_options(gate),
    )
    return y, q, d
