"""The attention-input Triton kernel (mtpserve.kernels.triton.rope_kv.norm_rope_store: q/k RMSNorm per head, RoPE,
K/V written into the cache), run on CPU under the Triton interpreter, against its PyTorch twin
(mtpserve.ops.rope.norm_rope_store_reference); block caches bit for bit against mtpserve.quant.quantize."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from mtpserve.ops import quant_gemv

pytest.importorskip("triton", reason="triton is not installed: the Triton rope_kv kernel cannot be tested")

from mtpserve.kernels.triton import norm_rope_store
from mtpserve.ops.rope import norm_rope_store_reference, rope_cos_sin
from mtpserve.quant.planar import from_planar, to_planar
from mtpserve.quant.quantize import quantize_q4_0, quantize_q8_0
from mtpserve.quant.types import GGMLType, block_geometry

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
QUANTIZE = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0}
S = 12  # cache cells


@pytest.fixture(autouse=True)
def _kernels_at_any_rows():
    """The ops dispatchers send prompt-sized inputs to the twins under the interpreter (ops.quant_gemv.triton_for_rows);
    these tests hold the kernels themselves to the twins at every size."""
    with mock.patch.object(quant_gemv, "INTERPRETED_MAX_ROWS", 1 << 30):
        yield


def _store(t: GGMLType, n_kv: int, dim: int) -> torch.Tensor:
    """A cache of S cells filled with a pattern (cells not written must keep it)."""
    if t in FLOATS:
        return torch.full((S, n_kv, dim), 7.0, dtype=FLOATS[t])
    block, size = block_geometry(t)
    return torch.full((S, n_kv * dim // block * size), 0x5A, dtype=torch.uint8)


def _run(
    fn, inputs: dict, kt: GGMLType, vt: GGMLType, **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fn (the kernel or its twin) on copies of the inputs placed on `device`; (q out, K store, V store, positions)."""
    n_kv, dim = inputs["k"].shape[1:]
    device = DEVICE if fn is norm_rope_store else "cpu"
    ks, vs = _store(kt, n_kv, dim).to(device), _store(vt, n_kv, dim).to(device)
    cell_pos = torch.full((S,), -1, dtype=torch.long, device=device)
    x = {name: t.to(device) for name, t in inputs.items()}
    out = fn(
        x["q"], x["k"], x["v"], x["cos"], x["sin"], x["cells"], x["positions"], ks, vs, int(kt), int(vt), cell_pos,
        q_norm=x.get("q_norm"), k_norm=x.get("k_norm"), eps=1e-6, **kw,
    )  # fmt: skip
    return out.cpu(), ks.cpu(), vs.cpu(), cell_pos.cpu()


def _inputs(T: int, H: int, n_kv: int, dim: int, n_rot: int, norms: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(T, H, 2, dim, generator=g) * 3  # the joint query + gate projection: q is a strided view
    positions = torch.tensor([40, 7, 1000][:T])
    cos, sin = rope_cos_sin(positions, n_rot, 1e6)
    x = {
        "q": qg[:, :, 0],
        "k": torch.randn(T, n_kv, dim, generator=g) * 2,
        "v": torch.randn(T, n_kv, dim, generator=g),
        "cos": cos,
        "sin": sin,
        "cells": torch.tensor([5, 0, 9][:T]),
        "positions": positions,
    }
    if norms:
        x["q_norm"] = 1 + torch.rand(dim, generator=g)
        x["k_norm"] = 1 + torch.rand(dim, generator=g)
    return x


CASES = [
    (GGMLType.Q8_0, GGMLType.Q8_0),
    (GGMLType.F16, GGMLType.F16),
    (GGMLType.F32, GGMLType.F32),
    (GGMLType.Q4_0, GGMLType.BF16),
]


@pytest.mark.parametrize(("kt", "vt"), CASES, ids=lambda t: t.name)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("norms", [True, False], ids=["normed", "plain"])
def test_kernel_matches_its_twin(kt: GGMLType, vt: GGMLType, neox: bool, norms: bool) -> None:
    """3 rows at cells 5, 0, 9 of a 12-cell cache; 6 query heads over 2 KV heads, 64 dims, 16 rotated. q and the
    float caches to float32 rounding; V blocks (quantized as given) bit for bit; the other cells untouched."""
    x = _inputs(3, 6, 2, 64, 16, norms)
    got = _run(norm_rope_store, x, kt, vt, neox=neox)
    want = _run(norm_rope_store_reference, x, kt, vt, neox=neox)
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    assert torch.equal(got[3], want[3])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[x["cells"]] = False
    for t, g, w in ((kt, got[1], want[1]), (vt, got[2], want[2])):
        assert torch.equal(g[untouched], _store(t, 2, 64)[untouched])
        if t in FLOATS:
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2 if t == GGMLType.BF16 else 2e-3, atol=1e-5)
    if vt not in FLOATS:
        assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("kt", [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_k_blocks_are_the_quantizers_bytes_of_the_kernels_k(kt: GGMLType) -> None:
    """The K blocks the kernel writes are `quantize_q8_0` / `quantize_q4_0` of the k it computes (read back from an
    f32 cache written by the same kernel), bit for bit."""
    x = _inputs(3, 4, 2, 256, 64, norms=True, seed=3)
    k32 = _run(norm_rope_store, x, GGMLType.F32, GGMLType.F32)[1]
    blocks = _run(norm_rope_store, x, kt, GGMLType.F16)[1]
    cells = x["cells"]
    assert torch.equal(blocks[cells], QUANTIZE[kt](k32[cells].reshape(len(cells), -1)))


@pytest.mark.parametrize("vt", [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_quantizer_corners(vt: GGMLType) -> None:
    """V is stored as given: blocks with ggml's corner cases (halves rounding away from zero, 0.49999997, an all-zero
    block led by -0.0, ties of magnitude with opposite signs, the first winning) give the quantizer's bytes."""
    x = _inputs(3, 2, 1, 128, 16, norms=False)
    v = torch.zeros(3, 1, 128)
    v[0, 0, :32] = torch.arange(32) - 15.5  # halves
    v[0, 0, 31] = 127.0
    v[0, 0, 32:64] = 0.0
    v[0, 0, 32] = -0.0
    v[0, 0, 64:96] = torch.tensor([0.49999997, -0.5] * 16)
    v[0, 0, 96:128] = torch.tensor([-3.0, 3.0] * 16)
    v[1, 0] = torch.linspace(-1, 1, 128)
    v[2, 0] = -v[1, 0]
    x["v"] = v
    got = _run(norm_rope_store, x, GGMLType.F16, vt)[2]
    assert torch.equal(got[x["cells"]], QUANTIZE[vt](v.reshape(3, -1)))


def test_qwen_attention_geometry() -> None:
    """Qwen3.6-27B's full attention: 24 query heads over 4 KV heads of 256 dims, 64 rotated, q8_0 cache."""
    x = _inputs(1, 24, 4, 256, 64, norms=True, seed=5)
    got = _run(norm_rope_store, x, GGMLType.Q8_0, GGMLType.Q8_0)
    want = _run(norm_rope_store_reference, x, GGMLType.Q8_0, GGMLType.Q8_0)
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_rejects_bad_shapes() -> None:
    x = _inputs(2, 4, 2, 64, 16, norms=False)
    args = (x["q"], x["k"], x["v"], x["cos"], x["sin"], x["cells"], x["positions"])
    stores = (_store(GGMLType.F16, 2, 64), _store(GGMLType.F16, 2, 64), 1, 1, torch.zeros(S, dtype=torch.long))
    with pytest.raises(ValueError, match="cos/sin"):
        norm_rope_store(*args[:3], x["cos"][:, :0], x["sin"][:, :0], *args[5:], *stores)
    with pytest.raises(ValueError, match="cells and positions"):
        norm_rope_store(*args[:5], x["cells"][:1], x["positions"], *stores)
    with pytest.raises(ValueError, match="a F16 cache must be"):
        norm_rope_store(*args, _store(GGMLType.F16, 1, 64), *stores[1:])


@pytest.mark.parametrize(("kt", "vt"), [(GGMLType.Q8_0, GGMLType.Q8_0), (GGMLType.Q8_0, GGMLType.F16)], ids=str)
def test_a_planar_q8_0_cache_holds_the_blocks_bytes_reordered(kt: GGMLType, vt: GGMLType) -> None:
    """`planar` (the GPU path's q8_0 layout): the kernel and its twin write the same bytes, the GGUF blocks of the
    same call reordered by `to_planar`, and a float cache beside it is written as ever."""
    x = _inputs(3, 6, 2, 64, 16, norms=True, seed=5)
    got = _run(norm_rope_store, x, kt, vt, planar=True)
    want = _run(norm_rope_store_reference, x, kt, vt, planar=True)
    gguf = _run(norm_rope_store, x, kt, vt)
    cells = x["cells"]
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[1][cells], to_planar(gguf[1][cells], 2))
    assert not torch.equal(got[1][cells], gguf[1][cells])  # the layouts do differ
    if vt == GGMLType.F16:
        assert torch.equal(got[2], gguf[2])
    else:
        assert torch.equal(from_planar(got[2][cells], 2), gguf[2][cells])
