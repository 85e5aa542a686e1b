"""The split-K decode attention Triton kernel (mtpserve.kernels.triton.decode_attention), run on CPU under the
Triton interpreter, against its PyTorch twin (below): the cache rows dequantized by mtpserve.quant, then masked
softmax attention in float32. Caches are built by mtpserve.cache.kv.KVCache, so the kernel reads exactly the
storage the engine keeps (f32, f16, bf16, q8_0, q4_0 for K and V independently)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton attention kernel cannot be tested")

from mtpserve.cache.kv import KVCache
from mtpserve.kernels.triton import attention as attention_module
from mtpserve.kernels.triton import auto_splits, decode_attention
from mtpserve.kernels.triton.attention import row_blocks
from mtpserve.kernels.triton.attention_int8 import int8_row_blocks
from mtpserve.kernels.triton.attention_mma import mma_row_blocks
from mtpserve.kernels.triton.attention_mma16 import mma16_row_blocks
from mtpserve.ops.attention import decode_attention_reference
from mtpserve.quant.dequant import dequantize
from mtpserve.quant.planar import to_planar
from mtpserve.quant.types import GGMLType

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Both sides multiply the same float32 values (the cache dequantized exactly; f16 queries are exact in float32):
# only the summation order and the split merge differ.
TOL = 1e-4
# The int8 kernel's PV: the softmax weights and V's scaled values rounded to fp16 (2^-11), float32 sums.
INT8_TOL = 2e-3


def _rows(rows, S: int) -> torch.Tensor:
    """The first S cells of a KVCache store ([S, Hkv, D] float32)."""
    if rows.type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return rows.data[:S].float()
    return dequantize(rows.data[:S], rows.type, (S, rows.n_heads, rows.dim))


def _cache(
    kt: str,
    vt: str,
    n: int,
    n_kv: int,
    dim: int,
    *,
    capacity: int | None = None,
    window: int | None = None,
    ring: bool = False,
    chunk: int = 256,
    seed: int = 0,
) -> KVCache:
    """A cache holding positions 0..n-1 of random K/V (keys of mixed norms, so some dominate the softmax)."""
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(capacity or n, n_kv, dim, dim, kt, vt, window=window, ring=ring)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        k = torch.randn(m, n_kv, dim, generator=g) * (0.5 + torch.rand(m, n_kv, 1, generator=g))
        kv.append(k, torch.randn(m, n_kv, dim, generator=g))
    return kv


def _check(
    kv: KVCache,
    n_heads: int,
    T: int,
    *,
    n_splits: int | None = None,
    q_pos: torch.Tensor | None = None,
    q_dtype: torch.dtype = torch.float32,
    seed: int = 1,
    ordered: bool = False,
    tol: float = TOL,
    planar: bool = False,
    **options: object,
) -> torch.Tensor:
    """decode_attention of T queries (by default the last T cached positions) against the twin; `options` go to
    decode_attention (precision, block_s, num_warps, int8_qk). `planar`: the kernel reads the q8_0 stores as the
    GPU path lays them out (mtpserve.quant.planar), the twin the same bytes as GGUF blocks; where that takes the
    int8 kernel, the twin's query is rounded as the kernel's is."""
    dim = kv.k.dim
    S = kv.capacity
    q = torch.randn(T, n_heads, dim, generator=torch.Generator().manual_seed(seed)).to(q_dtype)
    if q_pos is None:
        q_pos = torch.arange(kv.length - T, kv.length)
    scale = 1.0 / math.sqrt(dim)
    stores = [to_planar(r.data, r.n_heads) if planar and r.type == GGMLType.Q8_0 else r.data for r in (kv.k, kv.v)]
    got = decode_attention(
        q.to(DEVICE),
        stores[0].to(DEVICE),
        stores[1].to(DEVICE),
        int(kv.k.type),
        int(kv.v.type),
        q_pos.to(DEVICE),
        kv.positions.to(DEVICE),
        n_kv_heads=kv.k.n_heads,
        head_dim=dim,
        scale=scale,
        window=kv.window,
        n_splits=n_splits,
        ordered=ordered,
        planar=planar,
        **options,
    ).cpu()
    both_q8_0 = kv.k.type == kv.v.type == GGMLType.Q8_0
    float_options = any(options.get(o) for o in ("precision", "loads_first", "block_m"))
    int8 = planar and both_q8_0 and options.get("int8_qk", not float_options) is not False
    int8 = int8 and options.get("int8_kernel") != "mma16"  # fp16 products: the query is not rounded to q8_0
    expected = decode_attention_reference(
        q,
        kv.k.data[:S],
        kv.v.data[:S],
        kv.k.type,
        kv.v.type,
        q_pos,
        kv.positions,
        n_kv_heads=kv.k.n_heads,
        scale=scale,
        window=kv.window,
        round_q=int8,
    )
    assert got.dtype == torch.float32 and got.shape == (T, n_heads, dim)
    assert torch.isfinite(got).all()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= tol, rel
    return got


TYPE_PAIRS = [
    ("f16", "f16"),
    ("f32", "f32"),
    ("bf16", "bf16"),
    ("q8_0", "q8_0"),
    ("q4_0", "q4_0"),
    ("q8_0", "f16"),
    ("f16", "q4_0"),
    ("q4_0", "q8_0"),
]


@pytest.mark.parametrize(("kt", "vt"), TYPE_PAIRS, ids=lambda t: t)
@pytest.mark.parametrize("T", [1, 4])
def test_cache_types_gqa(kt: str, vt: str, T: int) -> None:
    """H=8 over Hkv=2 (one program per KV head serves its 4 query heads), 3 splits, T=4 causal among the new rows."""
    kv = _cache(kt, vt, 333, 2, 64, seed=T)
    _check(kv, 8, T, n_splits=3)


@pytest.mark.parametrize(("kt", "vt"), [("q8_0", "q4_0"), ("f16", "f32")], ids=lambda t: t)
def test_heads_without_grouping(kt: str, vt: str) -> None:
    kv = _cache(kt, vt, 300, 2, 64)
    _check(kv, 2, 4, n_splits=2)


@pytest.mark.parametrize("n_splits", [1, 2, 5, None, 1000])
def test_splits_agree(n_splits: int | None) -> None:
    """Any number of key ranges (1000: more than there are tiles, so capped) gives the twin's result."""
    kv = _cache("q8_0", "q8_0", 700, 1, 64, seed=2)
    _check(kv, 2, 2, n_splits=n_splits)


@pytest.mark.parametrize(
    ("precision", "block_s", "num_warps", "tol"),
    [
        ("tf32", 32, 4, 3e-3),
        ("fp16", 32, 4, 3e-3),
        pytest.param(
            "bf16",
            16,
            8,
            2e-2,
            marks=pytest.mark.skipif(
                DEVICE == "cpu", reason="the Triton interpreter's tl.dot multiplies bf16 as raw bits"
            ),
        ),
    ],
)
def test_tensor_core_operands_and_tile_choices(precision: str, block_s: int, num_warps: int, tol: float) -> None:
    """The choices bench/attention_gpu.py measures on a lent GPU, at the 27B's head geometry (D = 256, 6 query heads
    a KV head, q8_0 cache): the twin's result within the operands' rounding (bf16 keeps 8 bits, fp16 and tf32 11)."""
    kv = _cache("q8_0", "q8_0", 200, 1, 256, seed=4)
    _check(kv, 6, 3, n_splits=3, tol=tol, precision=precision, block_s=block_s, num_warps=num_warps)


@pytest.mark.parametrize("precision", ["ieee", "fp16"])
def test_a_verification_in_one_32_row_block(precision: str) -> None:
    """block_m=32 (bench/attention_gpu.py's "m32" choices): a verification's 3 tokens x 6 query heads a KV head, 18
    rows, in one block where the default takes two; the twin's result, and the two-block run's within float32
    order (fp16: the operands' rounding, which both runs share)."""
    kv = _cache("q8_0", "q8_0", 200, 1, 256, seed=7)
    one = _check(kv, 6, 3, n_splits=3, precision=precision, block_m=32, tol=TOL if precision == "ieee" else 1e-3)
    two = _check(kv, 6, 3, n_splits=3, precision=precision, tol=TOL if precision == "ieee" else 1e-3)
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block_m must be a power of two of at least 8"):
        _check(kv, 6, 3, block_m=24)


def test_row_blocks_pad_only_the_last_block() -> None:
    assert row_blocks(6, 256) == [(0, 1, 8)]  # a decode step of the 27B
    assert row_blocks(18, 256) == [(0, 1, 16), (16, 1, 4)]  # its verification: 16 + 2 rows, not 2 x 16
    assert row_blocks(24, 256) == [(0, 1, 16), (16, 1, 8)]
    assert row_blocks(32, 256) == [(0, 2, 16)]
    assert row_blocks(12, 256) == [(0, 1, 16)]
    assert row_blocks(9, 64) == [(0, 1, 16)]  # SmolLM2's verification: one block up to 64 rows at D = 64


def test_a_verification_in_a_16_row_block_and_a_4_row_one() -> None:
    """The default's two launches (rows 0-15, then 16-17 in a 4-row block) give the twin's result, and the 16-row
    blocks' within float32 summation order."""
    kv = _cache("q8_0", "q8_0", 200, 2, 256, seed=9)
    split = _check(kv, 12, 3, n_splits=3)
    sixteen = _check(kv, 12, 3, n_splits=3, block_m=16)
    torch.testing.assert_close(split, sixteen, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kt", ["q8_0", "q4_0", "f16"])
def test_a_decode_step_in_an_8_row_block(kt: str) -> None:
    """A decode step's 6 query heads a KV head take an 8-row block by default (half the FMAs of 16): the twin's
    result, and the 16-row run's within float32 summation order."""
    kv = _cache(kt, kt, 200, 2, 256, seed=8)
    eight = _check(kv, 12, 1, n_splits=3)
    sixteen = _check(kv, 12, 1, n_splits=3, block_m=16)
    torch.testing.assert_close(eight, sixteen, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block_m must be a power of two of at least 8"):
        _check(kv, 12, 1, block_m=4)


def _both_ways(kv: KVCache, n_heads: int, T: int, q_pos: torch.Tensor | None = None, **options: object) -> None:
    """loads_first's result is the default's, bit for bit (the same values, only the loads' order moves), and the
    twin's."""
    runs = [_check(kv, n_heads, T, q_pos=q_pos, loads_first=first, **options) for first in (False, True)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "case", ["q8_0-gqa", "q4_0-f16-window", "ring", "nan-garbage", "d256-verify", "ordered"], ids=str
)
def test_loads_first_is_the_default_bit_for_bit(case: str) -> None:
    """bench/attention_gpu.py's loads_first choice reads every cell of a tile's range (a ring's stale cells, a
    truncated cache's NaN garbage) and selects the unseen ones away: no value of theirs reaches the result."""
    if case == "q8_0-gqa":
        _both_ways(_cache("q8_0", "q8_0", 333, 2, 64, seed=1), 8, 4, n_splits=3)
    elif case == "q4_0-f16-window":
        _both_ways(_cache("q4_0", "f16", 500, 2, 64, window=100, seed=3), 4, 4, n_splits=4)
    elif case == "ring":
        kv = _cache("q8_0", "q8_0", 700, 2, 64, capacity=320, window=256, ring=True, chunk=64, seed=4)
        _both_ways(kv, 4, 3, n_splits=3)
    elif case == "nan-garbage":
        kv = _cache("q8_0", "q4_0", 400, 2, 64, capacity=480, seed=5)
        kv.truncate(350)
        for rows in (kv.k, kv.v):
            rows.data[350:] = 0xFF  # every f16 scale 0xFFFF: NaN
        _both_ways(kv, 4, 4, q_pos=torch.arange(350, 354), n_splits=4)
    elif case == "d256-verify":
        _both_ways(_cache("q8_0", "q8_0", 200, 1, 256, seed=4), 6, 3, n_splits=3)
    else:
        _both_ways(_cache("q8_0", "q8_0", 300, 2, 64, capacity=2048, seed=6), 4, 3, ordered=True)


def test_sliding_window() -> None:
    """A window of 100 over 500 positions: each of the 4 queries sees a different 100-key band."""
    kv = _cache("q4_0", "f16", 500, 2, 64, window=100, seed=3)
    _check(kv, 4, 4, n_splits=4)


def test_ring_cache_with_window() -> None:
    """A ring of 320 cells after 700 positions: cells hold positions out of order, some cells are stale."""
    kv = _cache("q8_0", "q8_0", 700, 2, 64, capacity=320, window=256, ring=True, chunk=64, seed=4)
    _check(kv, 4, 3, n_splits=3)


@pytest.mark.parametrize(("kt", "vt"), [("f16", "f32"), ("q8_0", "q4_0")], ids=lambda t: t)
def test_empty_cells_are_never_read(kt: str, vt: str) -> None:
    """A truncated cache (a rejected draft) with NaN garbage in its forgotten cells, plus never-written cells."""
    kv = _cache(kt, vt, 400, 2, 64, capacity=480, seed=5)
    kv.truncate(350)
    for rows in (kv.k, kv.v):
        if rows.data.dtype == torch.uint8:
            rows.data[350:] = 0xFF  # every f16 scale 0xFFFF: NaN
        else:
            rows.data[350:] = float("nan")
    got = _check(kv, 4, 4, n_splits=4, q_pos=torch.arange(350, 354))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("T", [1, 3])
def test_an_ordered_cache_is_read_only_up_to_the_last_query(T: int) -> None:
    """`ordered` (cell i holds position i or nothing: a cache that is not a ring): over a 2048-cell cache holding
    300 positions, the twin's result; and the kernel really stops at the last query position: a cell past it
    given a visible position (which an ordered cache never has) is read without `ordered` and not with it."""
    kv = _cache("q8_0", "q8_0", 300, 2, 64, capacity=2048, seed=6)
    for splits in (None, 4):
        _check(kv, 4, T, n_splits=splits, ordered=True)
    planted = kv.positions.clone()
    planted[1500] = 10
    q = torch.randn(T, 4, 64, generator=torch.Generator().manual_seed(7))
    q_pos = torch.arange(300 - T, 300)
    runs = [
        decode_attention(
            q.to(DEVICE),
            kv.k.data.to(DEVICE),
            kv.v.data.to(DEVICE),
            int(kv.k.type),
            int(kv.v.type),
            q_pos.to(DEVICE),
            positions.to(DEVICE),
            n_kv_heads=2,
            head_dim=64,
            scale=0.125,
            n_splits=4,
            ordered=ordered,
        ).cpu()
        for positions, ordered in ((planted, False), (planted, True), (kv.positions, False))
    ]
    assert not torch.allclose(runs[0], runs[2])  # the planted key counts without `ordered`
    torch.testing.assert_close(runs[1], runs[2], rtol=1e-5, atol=1e-6)  # and is never reached with it


@pytest.mark.parametrize("T", [1, 4])
def test_qwen_head_geometry(T: int) -> None:
    """Qwen3.6's full-attention layers: head_dim 256, 24 query heads over 4 KV heads (T=4: 96 rows, 3 blocks)."""
    kv = _cache("q8_0", "q8_0", 160, 4, 256, seed=6)
    _check(kv, 24, T, n_splits=2)


def test_f16_queries_and_head_dim_256_f16_cache() -> None:
    kv = _cache("f16", "f16", 100, 1, 256, seed=7)
    _check(kv, 2, 2, q_dtype=torch.float16)


@pytest.mark.parametrize(("kt", "vt"), [("f32", "f16"), ("bf16", "f32")], ids=lambda t: t)
def test_head_dim_not_a_power_of_two(kt: str, vt: str) -> None:
    """D = 80 pads to 128: the kernel's two half-D tiles (16-runs of each 32) mask dims 80..127 in both halves."""
    kv = _cache(kt, vt, 90, 1, 80, seed=10)
    _check(kv, 2, 3, n_splits=2)


def test_no_visible_key_gives_zeros() -> None:
    kv = _cache("q8_0", "f16", 64, 2, 64, capacity=96)
    q = torch.randn(2, 4, 64, device=DEVICE)
    k, v = kv.k.data.to(DEVICE), kv.v.data.to(DEVICE)
    args = (q, k, v, int(kv.k.type), int(kv.v.type))
    empty = torch.full((96,), -1, dtype=torch.long, device=DEVICE)
    out = decode_attention(*args, torch.tensor([5, 6], device=DEVICE), empty, n_kv_heads=2, head_dim=64, scale=0.125)
    assert torch.equal(out.cpu(), torch.zeros(2, 4, 64))
    # Row 0 at position -1 sees nothing; row 1 sees position 0 only and returns its value exactly.
    out = decode_attention(
        *args, torch.tensor([-1, 0], device=DEVICE), kv.positions.to(DEVICE), n_kv_heads=2, head_dim=64, scale=0.125
    )
    assert torch.equal(out[0].cpu(), torch.zeros(4, 64))
    torch.testing.assert_close(out[1].cpu(), _rows(kv.v, 1)[0].repeat_interleave(2, dim=0), rtol=1e-6, atol=1e-6)


def test_auto_splits_rule() -> None:
    cells = (1, 256, 257, 4096, 65536, 131072, 262144, 10**6)
    assert [auto_splits(s) for s in cells] == [1, 1, 2, 16, 256, 256, 256, 256]


def _ordered_run(kv: KVCache, capacity: int, n_splits: int | None, min_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention of the last 3 positions over the first `capacity` cells of kv, `ordered`; (out, cells each
    split walked)."""
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(8))
    splits = n_splits or auto_splits(capacity)
    counts = torch.full((splits,), -1, dtype=torch.int32, device=DEVICE)
    out = decode_attention(
        q.to(DEVICE),
        kv.k.data[:capacity].to(DEVICE),
        kv.v.data[:capacity].to(DEVICE),
        int(kv.k.type),
        int(kv.v.type),
        torch.arange(kv.length - 3, kv.length, device=DEVICE),
        kv.positions[:capacity].to(DEVICE),
        n_kv_heads=2,
        head_dim=64,
        scale=0.125,
        n_splits=n_splits,
        ordered=True,
        min_keys=min_keys,
        split_counts=counts,
    )
    return out.cpu(), counts.cpu()


def test_ordered_splits_share_the_filled_cells() -> None:
    """An ordered cache splits the cells up to the last query position, read on the device, not its capacity: 250
    filled cells over 8 splits give every split a 32-key tile (the last 26), at a capacity of 256, 1024 or 4096 cells
    alike, with the same result bit for bit; and with the default minimum of 256 keys a split, one split has work."""
    kv = _cache("q8_0", "f16", 250, 2, 64, capacity=4096, seed=9)
    runs = [_ordered_run(kv, capacity, 8, 16) for capacity in (256, 1024, 4096)]
    for out, counts in runs:
        assert counts.tolist() == [32] * 7 + [26]
        assert torch.equal(out, runs[0][0])
    _check(kv, 4, 3, n_splits=8, ordered=True)
    out, counts = _ordered_run(kv, 4096, None, 256)
    assert counts.tolist() == [250] + [0] * (auto_splits(4096) - 1)
    torch.testing.assert_close(out, runs[0][0], rtol=1e-5, atol=1e-6)


def test_rejects_unsupported_type_and_bad_shapes() -> None:
    q, pos = torch.zeros(1, 2, 64), torch.zeros(1, dtype=torch.long)
    f16 = torch.zeros(4, 2, 64, dtype=torch.float16)
    k_pos = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="no Triton attention for cache type"):
        decode_attention(
            q,
            torch.zeros(4, 80, dtype=torch.uint8),
            f16,
            GGMLType.Q4_1,
            GGMLType.F16,
            pos,
            k_pos,
            n_kv_heads=2,
            head_dim=64,
            scale=1.0,
        )
    with pytest.raises(ValueError, match="a Q8_0 cache must be uint8"):
        decode_attention(
            q,
            torch.zeros(4, 64, dtype=torch.uint8),
            f16,
            GGMLType.Q8_0,
            GGMLType.F16,
            pos,
            k_pos,
            n_kv_heads=2,
            head_dim=64,
            scale=1.0,
        )
    odd = torch.zeros(4, 2 * 68 + 1, dtype=torch.uint8)[:, : 2 * 68]  # rows 137 bytes apart: fp16 scales misaligned
    with pytest.raises(ValueError, match="v_cache: a planar q8_0 cache needs an even row stride, got 137"):
        decode_attention(
            q, f16, odd, GGMLType.F16, GGMLType.Q8_0, pos, k_pos, n_kv_heads=2, head_dim=64, scale=1.0, planar=True
        )
    with pytest.raises(ValueError, match="a F32 cache must be"):
        decode_attention(q, f16, f16, GGMLType.F32, GGMLType.F16, pos, k_pos, n_kv_heads=2, head_dim=64, scale=1.0)
    with pytest.raises(ValueError, match="cells but k_pos has"):
        decode_attention(q, f16, f16, GGMLType.F16, GGMLType.F16, pos, k_pos[:3], n_kv_heads=2, head_dim=64, scale=1.0)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(
            torch.zeros(1, 3, 64),
            f16,
            f16,
            GGMLType.F16,
            GGMLType.F16,
            pos,
            k_pos,
            n_kv_heads=2,
            head_dim=64,
            scale=1.0,
        )


# --- q8_0 stored planar: the float kernel (sm_75's) and the int8 tensor-core kernel (sm_80+) ----------------------


@pytest.mark.parametrize(("kt", "vt"), [("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0")], ids=str)
@pytest.mark.parametrize("T", [1, 3])
def test_the_float_kernel_reads_planar_q8_0(kt: str, vt: str, T: int) -> None:
    """A planar q8_0 store (either or both), read by the float kernel, gives the twin's result over the same bytes
    as GGUF blocks to float32 rounding: the layout moves only where the bytes are."""
    _check(_cache(kt, vt, 300, 2, 256, seed=11), 12, T, n_splits=3, planar=True, int8_qk=False)


@pytest.mark.parametrize(
    ("dim", "T", "kernel"),
    # mma's two 4-warp blocks (T = 6) run at D = 64 only: at 256 the interpreter takes 14 s for nothing new
    [(d, t, k) for d in (64, 256) for t in (1, 3, 6) for k in ("dot", "mma") if (d, t, k) != (256, 6, "mma")]
    + [(128, 1, "dot")],  # 136-byte head rows: the kernel's strides 8-byte aligned (ALIGN)
)
def test_the_int8_kernel_is_the_twin_with_the_query_rounded(T: int, dim: int, kernel: str) -> None:
    """Planar q8_0 K and V take an int8 kernel by default: 6 query heads a KV head, so on tl.dot ("dot", sm_80+) a
    decode step's 6 rows take a 16-row block, a verification's 18 one 32-row block and 6 tokens' 36 rows a 32-row
    and a 16-row one; on mma.sync written lane by lane ("mma", sm_75's) one warp each 8 rows, 4 warps a program."""
    kv = _cache("q8_0", "q8_0", 300 if kernel == "dot" else 120, 2, dim, seed=12)
    int8 = _check(kv, 12, T, n_splits=3, planar=True, tol=INT8_TOL, int8_kernel=kernel)
    plain = _check(kv, 12, T, n_splits=3, planar=True, int8_qk=False)
    assert not torch.equal(int8, plain)  # the query rounding and fp16 weights do show: the int8 kernel ran


@pytest.mark.parametrize(
    ("dim", "T"),
    # two programs (T = 6) and D = 256 take 10 s each under the interpreter: `slow` (the GPU check runs them)
    [(64, 1), (64, 3), pytest.param(64, 6, marks=pytest.mark.slow), pytest.param(256, 3, marks=pytest.mark.slow)],
)
def test_the_mma16_kernel_is_the_twin_in_fp16(dim: int, T: int) -> None:
    """attention_mma16 (`int8_kernel="mma16"`): 6 query heads a KV head, so a decode step's 6 rows take one 8-row
    group, a verification's 18 three groups in one program, 6 tokens' 36 rows two programs of three; the twin's
    query is not rounded (fp16 products of the query and K and V as dequantized, float32 sums)."""
    kv = _cache("q8_0", "q8_0", 120, 2, dim, seed=12)
    fp16 = _check(kv, 12, T, n_splits=3, planar=True, tol=INT8_TOL, int8_kernel="mma16")
    plain = _check(kv, 12, T, n_splits=3, planar=True, int8_qk=False)
    assert not torch.equal(fp16, plain)  # the fp16 operands do show: the mma16 kernel ran


def _mask_cases() -> list:
    """(case, kernel): every case for tl.dot's kernel; the lane-by-lane ones (5-8 s a case under the interpreter)
    take the cases their own code masks (window, NaN bytes, no key) by default and `slow` the ones whose ranges
    come from the split code all pass-1 kernels share (ring, ordered, splits)."""
    cases = ["window", "ring", "nan-garbage", "ordered", "splits", "no-key"]
    out = []
    for kernel in ("dot", "mma", "mma16"):
        for case in cases:
            slow = kernel != "dot" and case in ("ring", "ordered", "splits")
            out.append(pytest.param(case, kernel, marks=[pytest.mark.slow] if slow else [], id=f"{case}-{kernel}"))
    return out


@pytest.mark.parametrize(("case", "kernel"), _mask_cases())
def test_the_int8_kernel_masks_as_the_float_kernel(case: str, kernel: str) -> None:
    """The cells an int8 kernel reads but no row sees (a ring's stale cells, outside a window, a truncated cache's
    NaN scales, the tail of a range) weigh nothing; `ordered` and any split count give the twin's result."""
    opts = {"planar": True, "tol": INT8_TOL, "int8_kernel": kernel}
    if case == "window":
        _check(_cache("q8_0", "q8_0", 300, 2, 64, window=100, seed=3), 4, 4, n_splits=4, **opts)
    elif case == "ring":
        kv = _cache("q8_0", "q8_0", 500, 2, 64, capacity=192, window=128, ring=True, chunk=64, seed=4)
        _check(kv, 4, 3, n_splits=3, **opts)
    elif case == "nan-garbage":
        kv = _cache("q8_0", "q8_0", 200, 2, 64, capacity=280, seed=5)
        kv.truncate(150)
        for rows in (kv.k, kv.v):
            rows.data[150:] = 0xFF  # every f16 scale 0xFFFF: NaN
        got = _check(kv, 4, 4, n_splits=4, q_pos=torch.arange(150, 154), **opts)
        assert torch.isfinite(got).all()
    elif case == "ordered":
        kv = _cache("q8_0", "q8_0", 150, 2, 64, capacity=1024, seed=6)
        for splits in (None, 4):
            _check(kv, 4, 3, n_splits=splits, ordered=True, **opts)
    elif case == "splits":
        kv = _cache("q8_0", "q8_0", 300, 1, 64, seed=2)
        for splits in (1, 5, 1000):
            _check(kv, 2, 2, n_splits=splits, **opts)
    else:  # a row at position -1 sees nothing and is 0
        kv = _cache("q8_0", "q8_0", 64, 2, 64, capacity=96)
        got = _check(kv, 4, 2, q_pos=torch.tensor([-1, 0]), **opts)
        assert torch.equal(got[0], torch.zeros(4, 64))


def test_int8_row_blocks() -> None:
    assert int8_row_blocks(6) == [(0, 1, 16)]  # a decode step of the 27B
    assert int8_row_blocks(18) == [(0, 1, 32)]  # its verification in one pass
    assert int8_row_blocks(36) == [(0, 1, 32), (32, 1, 16)]
    assert int8_row_blocks(64) == [(0, 2, 32)]
    assert int8_row_blocks(90) == [(0, 2, 32), (64, 1, 32)]


def test_mma_row_blocks() -> None:
    """A warp a group of 8 rows, up to 4 warps a program: (first row, blocks, rows a block, warps)."""
    assert mma_row_blocks(6) == [(0, 1, 8, 1)]  # a decode step of the 27B: one warp
    assert mma_row_blocks(18) == [(0, 1, 32, 4)]  # its verification: one pass, the fourth warp padding
    assert mma_row_blocks(12) == [(0, 1, 16, 2)]
    assert mma_row_blocks(90) == [(0, 3, 32, 4)]


def test_mma16_row_blocks() -> None:
    """Groups of 8 rows, up to 3 a program of 2 warps: (first row, blocks, rows a block, groups)."""
    assert mma16_row_blocks(6) == [(0, 1, 8, 1)]  # a decode step of the 27B
    assert mma16_row_blocks(18) == [(0, 1, 24, 3)]  # its verification: one pass
    assert mma16_row_blocks(12) == [(0, 1, 16, 2)]
    assert mma16_row_blocks(36) == [(0, 2, 24, 3)]


def test_which_kernel_reads_a_planar_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planar-q8_0 kernel where K and V are planar q8_0 at a power-of-two head dim and no float option is asked
    for: tl.dot's int8 ("dot") on sm_80+ and under the interpreter, but mma16's fp16 for more than 16 rows a KV head
    on sm_80+ (64 <= D <= 256); mma.sync's int8 ("mma") on sm_75 (64 <= D <= 256); the float kernel otherwise, and
    `int8_qk=True` refuses where it cannot run."""

    def takes(device, k, v, d, planar, int8_qk, float_options, kernel=None, rows=6):
        return attention_module.planar_kernel(
            torch.device(device), k, v, d, planar, int8_qk, kernel, float_options, rows
        )

    q8, f16 = GGMLType.Q8_0, GGMLType.F16
    assert takes("cpu", q8, q8, 256, True, None, None) == "dot"
    assert takes("cpu", q8, q8, 256, True, None, None, rows=18) == "dot"  # the interpreter: only when asked for
    assert takes("cpu", q8, q8, 64, True, None, None, "mma") == "mma"  # the interpreter runs either
    assert takes("cpu", q8, q8, 32, True, None, None, "mma") is None  # a lane's words need D >= 64
    assert takes("cpu", q8, q8, 256, False, None, None) is None  # GGUF blocks
    assert takes("cpu", q8, f16, 256, True, None, None) is None
    assert takes("cpu", q8, q8, 96, True, None, None) is None
    assert takes("cpu", q8, q8, 256, True, None, "fp16") is None  # a float kernel's option
    assert takes("cpu", q8, q8, 256, True, False, None) is None
    monkeypatch.setattr(attention_module, "cuda_capability", lambda device: (7, 5))
    assert takes("cuda", q8, q8, 256, True, None, None) == "mma"  # sm_75: mma.sync, no int8 tl.dot
    assert takes("cuda", q8, q8, 256, True, None, None, rows=18) == "mma"
    assert takes("cuda", q8, q8, 512, True, None, None) is None
    assert takes("cuda", q8, q8, 256, True, None, None, "mma16") is None  # m16n8k16 in fp16: sm_80+
    with pytest.raises(ValueError, match="int8_qk needs"):
        takes("cuda", q8, q8, 256, True, True, None, "dot")
    monkeypatch.setattr(attention_module, "cuda_capability", lambda device: (7, 0))
    assert takes("cuda", q8, q8, 256, True, None, None) is None  # Volta: neither
    monkeypatch.setattr(attention_module, "cuda_capability", lambda device: (9, 0))
    assert takes("cuda", q8, q8, 256, True, None, None) == "dot"
    assert takes("cuda", q8, q8, 256, True, None, None, "mma") == "mma"  # sm_90 runs Turing's mma.sync too
    assert takes("cuda", q8, q8, 256, True, None, None, rows=18) == "mma16"  # a verification: fp16 products
    assert takes("cuda", q8, q8, 256, True, None, None, rows=16) == "dot"
    assert takes("cuda", q8, q8, 32, True, None, None, rows=18) == "dot"  # mma16's runs need D >= 64
    assert takes("cuda", q8, q8, 256, True, None, None, "dot", rows=18) == "dot"
    assert takes("cuda", q8, q8, 32, True, None, None, "mma16") is None
    with pytest.raises(ValueError, match="int8_kernel must be"):
        takes("cuda", q8, q8, 256, True, None, None, "wmma")
    with pytest.raises(ValueError, match="int8_qk needs"):
        takes("cpu", GGMLType.Q4_0, GGMLType.Q4_0, 256, True, True, None)
