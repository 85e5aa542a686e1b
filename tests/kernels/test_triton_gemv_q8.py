"""The integer GEMV kernels over quantized activations (kernels.triton.gemv_q8), run on CPU under the Triton
interpreter against their twin (ops.quant_gemv.quant_gemv_q8_reference): every type, 1-9 activation rows, super-block
counts that take each K step (4, 2 and 1 blocks a step), row tiles left partial, an `out` slice and weights viewed
off their alignment."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton GEMV kernels cannot be tested")

from mtpserve.kernels.triton import Q8_GEMV_TYPES, act_block
from mtpserve.kernels.triton import quant_gemv_q8 as triton_gemv_q8
from mtpserve.ops.activation_rounding import Q8_1_ACTIVATIONS
from mtpserve.ops.quant_gemv import quant_gemv_q8, quant_gemv_q8_reference
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.types import GGMLType, block_geometry

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TYPES = [GGMLType(int(t)) for t in Q8_GEMV_TYPES]
F16_OFFSETS = {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q8_0: (0,)}
F16_OFFSETS[GGMLType.IQ4_XS] = (0,)
F16_OFFSETS |= {GGMLType.Q4_0: (0,), GGMLType.Q5_0: (0,), GGMLType.IQ4_NL: (0,), GGMLType.Q4_1: (0, 2)}
F16_OFFSETS[GGMLType.Q5_1] = (0, 2)  # d, m


def _blocks(qtype: GGMLType, n: int, k: int, seed: int) -> torch.Tensor:
    """Random bytes (every bit pattern of the packing) with each f16 field a sane scale."""
    g = torch.Generator().manual_seed(seed)
    qk, size = block_geometry(qtype)
    b = torch.randint(0, 256, (n, k // qk, size), generator=g, dtype=torch.uint8)
    for off in F16_OFFSETS[qtype]:
        scale = (torch.rand(n, k // qk, generator=g) * 0.02 + 1e-3).half()
        b[:, :, off : off + 2] = scale.view(torch.uint8).view(n, k // qk, 2)
    return b.reshape(n, -1)


def _activations(qtype: GGMLType, m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quants in -127..127 (what the roundings give) and positive block scales."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    xd = torch.rand(m, k // act_block(qtype), generator=g) * 0.01 + 1e-4
    if act_block(qtype) == 32 and qtype not in Q8_1_ACTIVATIONS:
        xd = xd.half().float()  # Q8_0 activations carry f16-rounded scales (Q8_1's the kernel rounds itself)
    return xq, xd


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same integer block sums; only the float32 order of the scaled sums differs."""
    assert got.dtype == torch.float32 and got.shape == expected.shape
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-5 * scale, (got - expected).abs().max().item() / scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "k"), [(1, 1024), (3, 768), (8, 512), (9, 256)])
def test_matches_twin(qtype: GGMLType, m: int, k: int) -> None:
    """K of 4, 3, 2 and 1 super-blocks: 4, 1, 2 and 1 a step (Q6_K's odd step moves its half-word offsets); 9 rows:
    two launches; 20 weight rows: a partial row tile."""
    n = 20
    blocks = _blocks(qtype, n, k, seed=k + m)
    xq, xd = _activations(qtype, m, k, seed=m)
    expected = quant_gemv_q8_reference(xq, xd, blocks, qtype)
    got = triton_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), blocks.to(DEVICE), qtype).cpu()
    _close(got, expected)


@pytest.mark.parametrize("m", [1, 3])
def test_iq4_xs_with_whole_row_tiles(m: int) -> None:
    """N a multiple of the row tile: the IQ4_XS kernel's unclamped-row form (EVEN_N)."""
    blocks = _blocks(GGMLType.IQ4_XS, 32, 512, seed=11 + m)
    xq, xd = _activations(GGMLType.IQ4_XS, m, 512, seed=12)
    expected = quant_gemv_q8_reference(xq, xd, blocks, GGMLType.IQ4_XS)
    _close(triton_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), blocks.to(DEVICE), GGMLType.IQ4_XS).cpu(), expected)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_rows_are_independent_of_batch_size(qtype: GGMLType) -> None:
    """A row's result is bit-identical whether it is multiplied alone or with up to 7 others."""
    blocks = _blocks(qtype, 8, 512, seed=5).to(DEVICE)
    xq, xd = _activations(qtype, 4, 512, seed=6)
    xq, xd = xq.to(DEVICE), xd.to(DEVICE)
    alone = torch.cat([triton_gemv_q8(xq[i : i + 1], xd[i : i + 1], blocks, qtype) for i in range(4)])
    assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype), alone)


@pytest.mark.parametrize(
    ("qtype", "rows_divisor", "num_warps"),
    [(GGMLType.Q4_K, 2, 2), (GGMLType.Q6_K, 2, 1), (GGMLType.IQ4_XS, 2, 1)],  # warps alone change nothing interpreted
)
def test_the_tiles_bench_choices_change_no_bit(qtype: GGMLType, rows_divisor: int, num_warps: int) -> None:
    """The tile choices bench/gemv_l2.py measures on a lent GPU (fewer weight rows a program, more warps) give the
    default tile's result bit for bit, 1 and 3 activation rows, a partial last tile (40 rows). (One K step: the
    choices tile rows and warps, not K; the K loop's steps are test_matches_twin's.)"""
    blocks = _blocks(qtype, 40, 256, seed=7).to(DEVICE)
    for m in (1, 3):
        xq, xd = (t.to(DEVICE) for t in _activations(qtype, m, 256, seed=8 + m))
        default = triton_gemv_q8(xq, xd, blocks, qtype)
        chosen = triton_gemv_q8(xq, xd, blocks, qtype, rows_divisor=rows_divisor, num_warps=num_warps)
        assert torch.equal(chosen, default)


@pytest.mark.parametrize(
    ("qtype", "k"), [(GGMLType.Q4_K, 2048), (GGMLType.Q4_K, 768), (GGMLType.Q5_K, 2048)]
)  # 8 and 3 super-blocks: 2 steps of 4, 3 of 1 (each last step reloading its own block)
def test_prefetch_changes_no_bit(qtype: GGMLType, k: int) -> None:
    """Q4_K/Q5_K's prefetch (each step's weight words loaded in the step before) gives the default's result bit for
    bit, 1 and 3 activation rows; other types refuse it."""
    blocks = _blocks(qtype, 24, k, seed=9).to(DEVICE)
    for m in (1, 3):
        xq, xd = (t.to(DEVICE) for t in _activations(qtype, m, k, seed=10 + m))
        default = triton_gemv_q8(xq, xd, blocks, qtype)
        assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, prefetch=True), default)
        _close(default, quant_gemv_q8_reference(xq, xd, blocks, qtype))
    with pytest.raises(ValueError, match="prefetch is a Q4_K / Q5_K choice"):
        q6 = _blocks(GGMLType.Q6_K, 8, 256, seed=1).to(DEVICE)
        triton_gemv_q8(
            *(t.to(DEVICE) for t in _activations(GGMLType.Q6_K, 1, 256, seed=2)), q6, GGMLType.Q6_K, prefetch=True
        )


# One type a kernel (the k-quant, Q6_K, Q8_0, IQ4_XS and legacy kernels) in the default suite, every type in test-all.
SPLIT_TYPES = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ4_XS, GGMLType.Q4_0]


@pytest.mark.parametrize(
    "qtype",
    [t if t in SPLIT_TYPES else pytest.param(t, marks=pytest.mark.slow) for t in TYPES],
    ids=lambda t: t.name,
)
def test_split_k_matches_the_twin(qtype: GGMLType) -> None:
    """`k_splits=2`: the K loop's 2 steps (K = 2048: 8 super-blocks 4 a step; 64 blocks 32 a step) one a split, 3
    activation rows, a partial row tile: the twin's sums up to float32 order, and the same bits as adding the
    residual after (the splits' sum first, the residual last)."""
    n, k, m = 20, 2048, 3
    blocks = _blocks(qtype, n, k, seed=21).to(DEVICE)
    xq, xd = (t.to(DEVICE) for t in _activations(qtype, m, k, seed=22))
    got = triton_gemv_q8(xq, xd, blocks, qtype, k_splits=2)
    _close(got.cpu(), quant_gemv_q8_reference(xq.cpu(), xd.cpu(), blocks.cpu(), qtype))
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, add=residual, k_splits=2), residual + got)


def test_split_k_uneven_splits_repeat_bit_for_bit() -> None:
    """Q6_K's 3 steps (K = 3072) in 2 splits of 2 + 1 steps and in 3 of 1, one activation row: the twin's sums, and
    the same bits on a second call (the splits are added in order, not as they finish: on a GPU too)."""
    qtype, n, k = GGMLType.Q6_K, 20, 3072
    blocks = _blocks(qtype, n, k, seed=26).to(DEVICE)
    xq, xd = (t.to(DEVICE) for t in _activations(qtype, 1, k, seed=27))
    expected = quant_gemv_q8_reference(xq.cpu(), xd.cpu(), blocks.cpu(), qtype)
    for splits in (2, 3):
        got = triton_gemv_q8(xq, xd, blocks, qtype, k_splits=splits)
        _close(got.cpu(), expected)
        assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, k_splits=splits), got)


def test_split_k_with_prefetch_into_an_out_slice() -> None:
    """Q4_K's prefetch inside each split (each split's first words loaded before its loop, its last step reloading
    its own block) gives the split result bit for bit; `out` a column slice: only its columns are written."""
    qtype, n, k, m = GGMLType.Q4_K, 16, 4096, 3  # 16 super-blocks: 4 steps of 4, in 3 splits (2, 1, 1 steps)
    blocks = _blocks(qtype, n, k, seed=24).to(DEVICE)
    xq, xd = (t.to(DEVICE) for t in _activations(qtype, m, k, seed=25))
    split = triton_gemv_q8(xq, xd, blocks, qtype, k_splits=3)
    assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, k_splits=3, prefetch=True), split)
    buffer = torch.full((m, 40), -1.0, device=DEVICE)
    triton_gemv_q8(xq, xd, blocks, qtype, out=buffer[:, 8 : 8 + n], k_splits=3)
    assert torch.equal(buffer[:, 8 : 8 + n], split)
    assert (buffer[:, :8] == -1).all() and (buffer[:, 8 + n :] == -1).all()
    _close(split.cpu(), quant_gemv_q8_reference(xq.cpu(), xd.cpu(), blocks.cpu(), qtype))


@pytest.mark.parametrize(
    ("qtype", "k"),
    # Q6_K's case took 101 s of a 24-minute default suite under the interpreter: `make test-all` runs it
    [(GGMLType.Q4_K, 2048), (GGMLType.Q5_K, 768), pytest.param(GGMLType.Q6_K, 3072, marks=pytest.mark.slow)],
)  # 2 steps of 4 super-blocks, 3 of 1, 3 of 1
def test_l2_prefetch_changes_no_bit(qtype: GGMLType, k: int) -> None:
    """`l2_ahead` (each program's weights prefetched into L2 that many K steps on; a hint: under the interpreter only
    its address arithmetic runs, on a GPU the prefetches too) gives the default's result bit for bit at 1 and 3
    activation rows, ahead past the loop's end, and in each split; types without it refuse it."""
    blocks = _blocks(qtype, 20, k, seed=30).to(DEVICE)
    for m in (1, 3):
        xq, xd = (t.to(DEVICE) for t in _activations(qtype, m, k, seed=31 + m))
        default = triton_gemv_q8(xq, xd, blocks, qtype)
        for ahead in (1, 4):
            assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, l2_ahead=ahead), default)
        split = triton_gemv_q8(xq, xd, blocks, qtype, k_splits=2)
        assert torch.equal(triton_gemv_q8(xq, xd, blocks, qtype, k_splits=2, l2_ahead=2), split)
    _close(default.cpu(), quant_gemv_q8_reference(xq.cpu(), xd.cpu(), blocks.cpu(), qtype))
    q8 = _blocks(GGMLType.Q8_0, 8, 256, seed=1).to(DEVICE)
    with pytest.raises(ValueError, match="l2_ahead is a count of K steps for Q4_K, Q5_K, Q6_K"):
        triton_gemv_q8(
            *(t.to(DEVICE) for t in _activations(GGMLType.Q8_0, 1, 256, seed=2)), q8, GGMLType.Q8_0, l2_ahead=1
        )


def test_splits_cut_whole_steps_and_leave_none_empty() -> None:
    from mtpserve.kernels.triton.gemv_q8 import _splits

    assert _splits(17, 4) == (5, 4)  # the 27B's ffn_down: 68 super-blocks, 17 steps of 4
    assert _splits(10, 4) == (3, 4)
    assert _splits(9, 4) == (3, 3)  # 3 + 3 + 3: a fourth split would have nothing
    assert _splits(3, 8) == (1, 3)
    assert _splits(5, 1) == (5, 1)
    with pytest.raises(ValueError, match="k_splits must be at least 1"):
        _splits(5, 0)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ4_XS, GGMLType.Q5_0])
def test_adds_a_residual_in_the_same_launch(qtype: GGMLType) -> None:
    """`add` (the residual stream) summed in the epilogue: bit-identical to adding after the launch (one rounding
    either way), with a partial row tile (20 rows)."""
    n, k, m = 20, 512, 3
    blocks = _blocks(qtype, n, k, seed=13).to(DEVICE)
    xq, xd = _activations(qtype, m, k, seed=14)
    xq, xd = xq.to(DEVICE), xd.to(DEVICE)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    plain = triton_gemv_q8(xq, xd, blocks, qtype)
    fused = triton_gemv_q8(xq, xd, blocks, qtype, add=residual)
    assert torch.equal(fused, residual + plain)
    _close(fused.cpu(), residual.cpu() + quant_gemv_q8_reference(xq.cpu(), xd.cpu(), blocks.cpu(), qtype))
    with pytest.raises(ValueError, match="add must be float32"):
        triton_gemv_q8(xq, xd, blocks, qtype, add=residual[:, :4])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_writes_into_an_out_slice_and_takes_misaligned_views(qtype: GGMLType) -> None:
    """`out` a column slice of a wider buffer (row stride 40): only its columns are written. Weights viewed one
    byte off their allocation are copied to an aligned one first."""
    n, k, m = 16, 512, 3
    blocks = _blocks(qtype, n, k, seed=9)
    xq, xd = _activations(qtype, m, k, seed=10)
    expected = quant_gemv_q8_reference(xq, xd, blocks, qtype)
    buffer = torch.full((m, 40), -1.0, device=DEVICE)
    shifted = torch.cat((torch.zeros(n, 1, dtype=torch.uint8), blocks), dim=1)[:, 1:].to(DEVICE)
    got = triton_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), shifted, qtype, out=buffer[:, 8 : 8 + n])
    assert got.data_ptr() == buffer[:, 8:].data_ptr()
    _close(buffer[:, 8 : 8 + n].cpu(), expected)
    assert (buffer[:, :8] == -1).all() and (buffer[:, 8 + n :] == -1).all()


def test_dispatcher_takes_the_kernel_and_the_twin_agrees_with_float_matmul() -> None:
    """ops.quant_gemv.quant_gemv_q8 runs the kernel under the interpreter (leading dims kept) and falls back to the
    twin for a type without one; the twin is (q * d) @ W.T."""
    from mtpserve.quant.dequant import dequantize

    qtype, n, k = GGMLType.Q6_K, 12, 256
    blocks = _blocks(qtype, n, k, seed=11)
    weight = QTensor(blocks.to(DEVICE), qtype, (n, k), "w")
    xq, xd = _activations(qtype, 4, k, seed=12)
    got = quant_gemv_q8(xq.reshape(2, 2, k).to(DEVICE), xd.reshape(2, 2, 1).to(DEVICE), weight).cpu()
    floats = (xq.float() * xd.repeat_interleave(256, -1)) @ dequantize(blocks, qtype, (n, k)).T
    assert got.shape == (2, 2, n)
    _close(got.reshape(4, n), floats)
    q2_k = QTensor(torch.zeros(n, k // 256 * 84, dtype=torch.uint8), GGMLType.Q2_K, (n, k), "w")
    xq0, xd0 = _activations(GGMLType.Q4_K, 1, k, seed=13)
    assert quant_gemv_q8(xq0, xd0, q2_k).abs().max().item() == 0.0


def test_dispatcher_splits_k_of_matrices_with_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.quant_gemv.GEMV_K_SPLITS (1 until a lent GPU measures it; bench/gpu.py --gemv-k-splits sets it) reaches
    the kernel for matrices of at most SPLIT_MAX_ROWS rows only, and the split product is the twin's."""
    from mtpserve.kernels import triton as kernels
    from mtpserve.ops import quant_gemv as dispatch

    qtype, n, k = GGMLType.Q6_K, 12, 768  # 3 super-blocks, one a step
    blocks = _blocks(qtype, n, k, seed=28)
    weight = QTensor(blocks.to(DEVICE), qtype, (n, k), "w")
    xq, xd = _activations(qtype, 2, k, seed=29)
    seen: list[int] = []
    kernel = kernels.quant_gemv_q8

    def spy(*args: object, k_splits: int = 1, **kwargs: object) -> torch.Tensor:
        seen.append(k_splits)
        return kernel(*args, k_splits=k_splits, **kwargs)

    monkeypatch.setattr(kernels, "quant_gemv_q8", spy)
    monkeypatch.setattr(dispatch, "GEMV_K_SPLITS", 2)
    got = quant_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), weight)
    _close(got.cpu(), quant_gemv_q8_reference(xq, xd, blocks, qtype))
    monkeypatch.setattr(dispatch, "SPLIT_MAX_ROWS", n - 1)
    quant_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), weight)
    assert seen == [2, 1]


def test_dispatcher_prefetches_ahead_for_the_k_quants_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.quant_gemv.GEMV_L2_AHEAD (0 until a lent GPU measures it; bench/gpu.py --gemv-l2-ahead sets it) reaches
    the kernel for Q4_K, Q5_K and Q6_K weights, 0 for the others, and the products are the twin's."""
    from mtpserve.kernels import triton as kernels
    from mtpserve.ops import quant_gemv as dispatch

    seen: list[tuple[int, int]] = []
    kernel = kernels.quant_gemv_q8

    def spy(xq: torch.Tensor, xd: torch.Tensor, blocks: torch.Tensor, qtype: int, **kwargs: object) -> torch.Tensor:
        seen.append((qtype, kwargs["l2_ahead"]))
        return kernel(xq, xd, blocks, qtype, **kwargs)

    monkeypatch.setattr(kernels, "quant_gemv_q8", spy)
    monkeypatch.setattr(dispatch, "GEMV_L2_AHEAD", 2)
    n, k = 12, 512
    for qtype in (GGMLType.Q6_K, GGMLType.Q8_0):
        blocks = _blocks(qtype, n, k, seed=34)
        xq, xd = _activations(qtype, 1, k, seed=35)
        got = quant_gemv_q8(xq.to(DEVICE), xd.to(DEVICE), QTensor(blocks.to(DEVICE), qtype, (n, k), "w"))
        _close(got.cpu(), quant_gemv_q8_reference(xq, xd, blocks, qtype))
    assert seen == [(int(GGMLType.Q6_K), 2), (int(GGMLType.Q8_0), 0)]


def test_rejects_bad_shapes() -> None:
    blocks = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="xq must be"):
        triton_gemv_q8(torch.zeros(1, 512, dtype=torch.int8), torch.zeros(1, 2), blocks, GGMLType.Q4_K)
    with pytest.raises(ValueError, match="xd must be"):
        triton_gemv_q8(torch.zeros(1, 256, dtype=torch.int8), torch.zeros(1, 8), blocks, GGMLType.Q4_K)
    with pytest.raises(ValueError, match="no integer GEMV"):
        act_block(GGMLType.Q2_K)
