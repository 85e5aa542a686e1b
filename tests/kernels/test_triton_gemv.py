"""The fused dequantize + GEMV Triton kernels (mtpserve.kernels.triton), run on CPU under the Triton interpreter:
unpacking bit-exact against mtpserve.quant's dequantizers, products against the torch twin, and each activation
row independent of the others in a batch of up to 8."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

pytest.importorskip("triton", reason="triton is not installed: the Triton GEMV kernels cannot be tested")

from mtpserve.kernels.triton import dequant_blocks
from mtpserve.kernels.triton import quant_gemv as triton_gemv
from mtpserve.ops.quant_gemv import quant_gemv, quant_gemv_reference, use_triton
from mtpserve.quant.dequant import dequantize
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.quantize import WEIGHT_QUANTIZERS, quantize
from mtpserve.quant.types import GGMLType, block_geometry

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
SUPER_TYPES = (GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
LEGACY_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)
IQ4_TYPES = (GGMLType.IQ4_NL, GGMLType.IQ4_XS)  # no quantizer writes these here: random blocks stand in
TYPES = SUPER_TYPES + LEGACY_TYPES + IQ4_TYPES
# The f16 fields of each block (d, and m or dmin), by byte offset.
F16_OFFSETS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}


def _weight(qtype: GGMLType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Valid blocks for a random [n, k] matrix, quantized by mtpserve's own quantizers (gguf-py's for Q4_1, which
    mtpserve cannot write; random blocks for the IQ4 types, which neither writes)."""
    if qtype in IQ4_TYPES:
        return _random_blocks(qtype, n, k, seed)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
    if qtype not in WEIGHT_QUANTIZERS:
        return torch.from_numpy(gguf_quantize(w.numpy(), GGMLQuantizationType(int(qtype)))).contiguous()
    return quantize(w, qtype).contiguous()


def _random_blocks(qtype: GGMLType, n: int, k: int, seed: int = 1) -> torch.Tensor:
    """Random bytes with every f16 field replaced by a sane scale: exercises all bit patterns of the packing."""
    g = torch.Generator().manual_seed(seed)
    qk, size = block_geometry(qtype)
    b = torch.randint(0, 256, (n, k // qk, size), generator=g, dtype=torch.uint8)
    for off in F16_OFFSETS[qtype]:
        scale = (torch.rand(n, k // qk, generator=g) * 0.02 + 1e-3).half()
        b[:, :, off : off + 2] = scale.view(torch.uint8).view(n, k // qk, 2)
    return b.reshape(n, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("source", ["quantized", "random_bytes"])
def test_unpacking_is_bit_exact(qtype: GGMLType, source: str) -> None:
    n, k = 40, 512  # 40: a partial second row tile
    blocks = _weight(qtype, n, k) if source == "quantized" else _random_blocks(qtype, n, k)
    expected = dequantize(blocks, qtype, (n, k))
    got = dequant_blocks(blocks.to(DEVICE), qtype).cpu()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacking_straight_to_half_rounds_once(qtype: GGMLType) -> None:
    """sm_75's prompt path: the weights written as fp16 are the float32 unpacking rounded once (`.half()`, to
    nearest even), for every type's bit patterns."""
    n, k = 40, 512
    blocks = _random_blocks(qtype, n, k, seed=3)
    got = dequant_blocks(blocks.to(DEVICE), qtype, dtype=torch.float16).cpu()
    assert got.dtype == torch.float16 and torch.equal(got, dequantize(blocks, qtype, (n, k)).half())
    with pytest.raises(ValueError, match="float32 or float16"):
        dequant_blocks(blocks.to(DEVICE), qtype, dtype=torch.bfloat16)


def _gemv_cases() -> list:
    """A spread of shapes, row counts and activation types for every type (each at least once per type), to keep
    the interpreter run short."""
    full = [
        pytest.param(t, n, k, m, dt, id=f"{t.name}-{n}x{k}-m{m}-{ds}")
        for t in SUPER_TYPES
        # each shape, row count (1, 3 and 8: one padded M tile each) and activation type at least once per type
        for n, k, m, dt, ds in [
            (32, 256, 1, torch.float32, "f32"),
            (96, 512, 8, torch.float32, "f32"),
            (96, 512, 3, torch.float16, "f16"),
            (32, 256, 8, torch.float16, "f16"),
        ]
    ]
    legacy = [
        pytest.param(t, n, k, m, dt, id=f"{t.name}-{n}x{k}-m{m}-{ds}")
        for t in LEGACY_TYPES + IQ4_TYPES
        for n, k, m, dt, ds in [
            (32, 256, 1, torch.float16, "f16"),
            (96, 512, 3, torch.float32, "f32"),
            (32, 256, 8, torch.float32, "f32"),
        ]
    ]
    return full + legacy


@pytest.mark.parametrize(("qtype", "n", "k", "m", "dtype"), _gemv_cases())
def test_gemv_matches_reference(qtype: GGMLType, n: int, k: int, m: int, dtype: torch.dtype) -> None:
    blocks = _weight(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = quant_gemv_reference(x, blocks, qtype)
    got = triton_gemv(x.to(DEVICE), blocks.to(DEVICE), qtype).cpu()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # The reference multiplies the same float32 values (the f16 activations are exact in float32); only the
    # summation order differs.
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= (1e-4 if dtype == torch.float32 else 1e-2), rel
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item() * (k / 256)


class _LaunchCounter:
    """Stands in for a Triton kernel: counts `kernel[grid](...)` launches and passes them on."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("n", "k", "m", "dtype"), [(40, 768, 1, torch.float32), (24, 1280, 3, torch.float16), (16, 1024, 8, torch.float32)]
)
def test_word_kernels_and_sub_tile_kernel_match_reference(
    qtype: GGMLType, n: int, k: int, m: int, dtype: torch.dtype
) -> None:
    """Q4_K's and Q6_K's word kernels and the generic sub-tile kernel all hold to the reference, with super-block
    counts that leave the last step partial (3 and 5 blocks), Q6_K rows and blocks starting off word boundaries
    (210-byte blocks), a partial row tile and 1-8 rows. A view starting off a 4-byte boundary takes the sub-tile
    kernel."""
    from mtpserve.kernels.triton import gemv

    blocks = _weight(qtype, n, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    expected = quant_gemv_reference(x, blocks, qtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    aligned = blocks.to(DEVICE)
    shifted = torch.cat((torch.zeros(n, 1, dtype=torch.uint8, device=DEVICE), aligned), dim=1)[:, 1:]  # 1 byte off
    for source, wide, word_launches in ((aligned, True, 1), (aligned, False, 0), (shifted, True, 0)):
        kernel, *rest = gemv._WORD_KERNELS[qtype]
        counter = _LaunchCounter(kernel)
        with mock.patch.dict(gemv._WORD_KERNELS, {qtype: (counter, *rest)}):
            got = triton_gemv(x.to(DEVICE), source, qtype, wide_words=wide).cpu()
        assert counter.launches == word_launches
        assert ((got - expected).norm() / expected.norm()).item() <= tol


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_rows_are_independent_of_batch_size(qtype: GGMLType) -> None:
    """Verifying m tokens at once gives each row exactly what decoding it alone gives."""
    blocks = _weight(qtype, 48, 256, seed=7).to(DEVICE)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    tiles = {"block_n": 64} if DEVICE == "cpu" else {}  # the interpreter's cost is per program: one program
    alone = torch.cat([triton_gemv(x[i : i + 1], blocks, qtype, **tiles) for i in range(8)])
    for m in range(1, 9):
        assert torch.equal(triton_gemv(x[:m], blocks, qtype, **tiles), alone[:m]), m


def test_more_than_eight_rows_and_dispatcher() -> None:
    qtype = GGMLType.Q8_0
    blocks = _weight(qtype, 33, 64, seed=5)
    weight = QTensor(blocks, qtype, (33, 64), "w")
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(4))  # 12 rows: two kernel launches
    assert use_triton(x, qtype)
    got = quant_gemv(x, weight)
    expected = quant_gemv_reference(x.reshape(12, 64), blocks, qtype).reshape(2, 6, 33)
    assert got.shape == (2, 6, 33)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rejects_unsupported_type_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="no Triton GEMV for Q2_K"):
        triton_gemv(torch.zeros(1, 256), torch.zeros(4, 84, dtype=torch.uint8), GGMLType.Q2_K)
    with pytest.raises(ValueError, match="x must be"):
        triton_gemv(torch.zeros(1, 64), torch.zeros(4, 34, dtype=torch.uint8), GGMLType.Q8_0)
    assert not use_triton(torch.zeros(1, 256, device=DEVICE), GGMLType.Q2_K)
    assert use_triton(torch.zeros(1, 32, device=DEVICE), GGMLType.Q5_0)  # a CPU tensor takes Triton only interpreted
