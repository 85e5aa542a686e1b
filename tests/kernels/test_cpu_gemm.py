"""The CPU kernels' tiled GEMM (matmul.c: sequences of 8+ rows, and several short sequences together) against their
per-row path, which reproduces llama.cpp's rounding: bit for bit, for every type the tiles take, quantized and random
blocks, partial tiles of weight and activation rows, several sequences in one call (llama.cpp's association depends
on each one's length), groups of weights of mixed types, and thread counts. `mtp_gemm_tiling(0)` is the kernels'
switch back to the per-row path."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from mtpserve.gguf import open_gguf
from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.ops import linear
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.quantize import WEIGHT_QUANTIZERS, quantize
from mtpserve.quant.types import GGMLType, block_geometry

from ..conftest import tinyqwen_path

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernel library did not build here")

TILED_TYPES = tuple(
    GGMLType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)  # every type the tiles take
F16_OFFSETS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # else (0,)
# (m, seq_len): single sequences of 8+ rows around the 6-row register tiles and 4-row Q4_K groups, then several
# sequences per call (rows past the last whole group of 4 in each take Q4_K's other association).
BATCHES = ((8, 8), (9, 9), (13, 13), (64, 64), (130, 130), (26, 13), (22, 11), (32, 16))
# several short sequences (seq_len < 8: sequences decoding together, verifications of several), which the tiles take
# for the 32-element types from 2 rows and Q4_K from 4 (Q4_K's kind 1 rows where a sequence has 4+)
SHORT_BATCHES = ((2, 1), (3, 1), (4, 1), (7, 1), (6, 3), (9, 3), (8, 4), (12, 4), (10, 5), (21, 7))


@contextmanager
def _row_path():
    lib = cpu_kernels.load()
    previous = lib.mtp_gemm_tiling(0)
    try:
        yield
    finally:
        lib.mtp_gemm_tiling(previous)


@contextmanager
def _threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _quantized(qtype: GGMLType, n: int, k: int, seed: int) -> QTensor:
    """A random [n, k] matrix with rows of different scales, quantized by mtpserve (gguf-py for Q4_1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    if qtype in WEIGHT_QUANTIZERS:
        data = quantize(w, qtype)
    else:
        data = torch.from_numpy(gguf_quantize(w.numpy(), GGMLQuantizationType(int(qtype))))
    return QTensor(data.contiguous().view(torch.uint8).reshape(n, -1), qtype, (n, k), f"quantized.{qtype.name}")


def _random(qtype: GGMLType, n: int, k: int, seed: int) -> QTensor:
    """Random bytes with sane f16 scales: every bit pattern of the packing (Q8_0's -128, negative Q6_K scales)."""
    g = torch.Generator().manual_seed(seed)
    qk, size = block_geometry(qtype)
    blocks = torch.randint(0, 256, (n, k // qk, size), generator=g, dtype=torch.uint8)
    for off in F16_OFFSETS.get(qtype.name, (0,)):
        scale = (torch.rand(n, k // qk, generator=g) * 0.02 + 1e-3).half()
        blocks[:, :, off : off + 2] = scale.view(torch.uint8).view(n, k // qk, 2)
    return QTensor(blocks.reshape(n, -1), qtype, (n, k), f"random.{qtype.name}")


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, one of them zero (its Q8 blocks have d = 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (torch.rand(m, 1, generator=g) * 10 + 0.1)
    x[min(1, m - 1)] = 0
    return x


def _assert_tiles_equal_rows(x: torch.Tensor, w: QTensor, seq_len: int) -> None:
    tiled = linear.linear(x, w, seq_len=seq_len)
    with _row_path():
        rows = linear.linear(x, w, seq_len=seq_len)
    assert torch.equal(tiled, rows), (w.name, tuple(w.shape), tuple(x.shape), seq_len)


def test_the_switch_reports_and_restores_the_tiles():
    lib = cpu_kernels.load()
    assert lib.mtp_gemm_tiling(0) == 1
    assert lib.mtp_gemm_tiling(1) == 0
    assert lib.mtp_gemm_tiling(1) == 1


@pytest.mark.parametrize("qtype", TILED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("make", [_quantized, _random], ids=["quantized", "random_bytes"])
def test_tiles_equal_the_row_path(qtype: GGMLType, make):
    qk, _ = block_geometry(qtype)
    ks = (256, 512, 768) + ((96, 160) if qk == 32 else ())  # odd multiples of 32 for the 32-element types
    for k in ks:
        for n in (5, 37):  # under one tile of weight rows; two tiles and a partial one
            w = make(qtype, n, k, seed=n + k)
            for m, seq_len in BATCHES + SHORT_BATCHES:
                _assert_tiles_equal_rows(_activations(m, k, seed=m + k), w, seq_len)


def test_llama_cpp_quantized_matrices():
    """Every 2-D weight of a llama.cpp Q4_K_M file (Q4_K, Q6_K, Q5_0 rows as llama.cpp's quantizer writes them)."""
    seen = {}
    for t in open_gguf(tinyqwen_path("Q4_K_M")).tensors.values():
        if t.ggml_type in TILED_TYPES and len(t.shape) == 2 and t.shape[0] < 5000:
            seen.setdefault((t.ggml_type, tuple(t.shape)), QTensor.from_gguf(t))
    assert {w.ggml_type for w in seen.values()} >= {GGMLType.Q4_K, GGMLType.Q6_K}
    for w in seen.values():
        for m, seq_len in ((9, 9), (64, 64), (26, 13), (4, 1), (9, 3)):
            _assert_tiles_equal_rows(_activations(m, w.shape[1], seed=m), w, seq_len)


@pytest.mark.parametrize("threads", [1, 3])
def test_groups_of_mixed_types_and_row_counts(threads: int):
    """One call over weights whose row counts are not whole tiles: chunks then start inside a weight and end
    in the next; an F16 member stays on the per-row path inside a tiled call."""
    k = 256
    group = [
        _random(GGMLType.Q4_0, 37, k, seed=1),
        _quantized(GGMLType.Q8_0, 20, k, seed=2),
        _random(GGMLType.Q4_K, 45, k, seed=3),
        _quantized(GGMLType.Q6_K, 16, k, seed=4),
        _quantized(GGMLType.Q4_1, 19, k, seed=5),
        QTensor(torch.randn(9, k).half().view(torch.uint8), GGMLType.F16, (9, k), "f16"),
        _random(GGMLType.Q5_K, 33, k, seed=6),
    ]
    with _threads(threads):
        for m, seq_len in ((9, 9), (48, 24), (130, 130), (4, 1), (9, 3)):
            x = _activations(m, k, seed=m)
            tiled = linear.linear_many(x, group, seq_len=seq_len)
            with _row_path():
                rows = linear.linear_many(x, group, seq_len=seq_len)
            for w, a, b in zip(group, tiled, rows):
                assert torch.equal(a, b), (w.name, m, seq_len)
                assert torch.equal(a, linear.linear(x, w, seq_len=seq_len)), (w.name, m, seq_len)


def test_sequences_in_one_call_are_each_computed_as_alone():
    """The tiles keep the kernels' promise: batching sequences together changes no result."""
    for qtype in (GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K):
        w = _random(qtype, 24, 512, seed=7)
        for seq_len in (11, 1, 3):  # sequences of 8+ rows; sequences decoding together; verifications of several
            x = _activations(4 * seq_len, 512, seed=8)
            together = linear.linear(x, w, seq_len=seq_len)
            for s in range(4):
                rows = slice(seq_len * s, seq_len * (s + 1))
                assert torch.equal(together[rows], linear.linear(x[rows], w)), (qtype.name, seq_len, s)


def test_the_weight_helpers_give_whole_finite_blocks():
    """_quantized and _random give whole rows of blocks with finite values (a guard on the helpers themselves)."""
    for qtype in TILED_TYPES:
        qk, size = block_geometry(qtype)
        for make in (_quantized, _random):
            w = make(qtype, 3, 256, seed=0)
            assert w.data.shape == (3, 256 // qk * size) and w.data.dtype == torch.uint8
            assert np.isfinite(w.dequantize().numpy()).all()


@pytest.mark.parametrize("seq_len", [1, 3, 4, 5, 7])
@pytest.mark.parametrize("n_seq", [1, 2, 3, 4, 9])
def test_decode_rows_four_at_a_time_equal_the_row_path(seq_len, n_seq):
    """The decode GEMVs (four weight rows per pass, seq_len < 8: Q4_K, Q6_K and the 32-element types, Q8_0 only where
    AVX-512 VNNI is compiled in, elsewhere it is the row path itself; Q4_K and
    Q6_K take up to four activation rows a pass) against one row at a time: bit for bit, Q4_K's kinds 0 and 1
    (llama.cpp's per-64-value steps for whole groups of 4 rows), row counts not a multiple of 4, 1 to 63 activation
    rows (a decode, a verification, several sequences of either; 4 sequences of one row: Q4_K's streamed rows form
    at 4 rows, which the tiles take from 5 there)."""
    weights = [_quantized(GGMLType.Q4_K, 37, 512, 1), _random(GGMLType.Q4_K, 38, 768, 2)]
    weights += [_quantized(GGMLType.Q6_K, 37, 512, 3), _random(GGMLType.Q6_K, 39, 256, 4)]
    weights += [_random(GGMLType.Q6_K, 38, 768, 5)]  # four rows a pass at every row length, as Q4_K
    weights += [_random(t, 37, 576, 6) for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)]
    weights += [_quantized(GGMLType.Q8_0, 38, 640, 7)]
    for w in weights:
        x = _activations(n_seq * seq_len, w.shape[1], seq_len)
        fast = linear.linear(x, w, seq_len=seq_len)
        with _row_path():
            rows = linear.linear(x, w, seq_len=seq_len)
        assert torch.equal(fast, rows), w.name


# --- kept tiles (llama.cpp's repacking: matmul.c kept_tiles) ------------------------------------------------------


def _kept(w: QTensor) -> QTensor:
    """w registered with the kernels, as WeightStore registers every CPU matrix it hands out."""
    return linear.keep_packed_tiles(w)


@pytest.mark.parametrize("qtype", TILED_TYPES, ids=lambda t: t.name)
def test_kept_tiles_equal_the_row_path(qtype: GGMLType):
    """A registered matrix's tiles are packed on its first tiled call and reused: every batch, short and long, gives
    the per-row path's numbers on the first call and on the later ones."""
    for n in (5, 37):
        w = _kept(_random(qtype, n, 512, seed=n))
        before = cpu_kernels.kept_tile_bytes()
        for m, seq_len in SHORT_BATCHES + BATCHES:
            _assert_tiles_equal_rows(_activations(m, 512, seed=m), w, seq_len)
        assert cpu_kernels.kept_tile_bytes() > before, "the first tiled call kept the tiles"


@pytest.mark.parametrize("threads", [1, 3])
def test_kept_tiles_in_groups_whose_chunks_start_inside_a_tile(threads: int):
    """Weights whose row counts are not whole tiles: a thread's chunk starts inside a kept tile, packs up to that
    tile's end and takes the kept ones from there; a first_rows view (a draft vocabulary) reads the whole matrix's
    tiles."""
    k = 256
    group = [
        _kept(_random(GGMLType.Q4_0, 37, k, seed=11)),
        _kept(_quantized(GGMLType.Q8_0, 20, k, seed=12)),
        _kept(_random(GGMLType.Q4_K, 45, k, seed=13)),
        _kept(_quantized(GGMLType.Q6_K, 19, k, seed=14)),
        _kept(_random(GGMLType.Q4_1, 43, k, seed=15)),
    ]
    with _threads(threads):
        for m, seq_len in ((4, 1), (9, 3), (8, 2), (9, 9), (48, 24)):
            x = _activations(m, k, seed=m)
            for _ in range(2):  # packing, then kept
                kept = linear.linear_many(x, group, seq_len=seq_len)
                with _row_path():
                    rows = linear.linear_many(x, group, seq_len=seq_len)
                for w, a, b in zip(group, kept, rows):
                    assert torch.equal(a, b), (w.name, m, seq_len)
            head = group[3].first_rows(11)
            with _row_path():
                rows = linear.linear(x, head, seq_len=seq_len)
            assert torch.equal(linear.linear(x, head, seq_len=seq_len), rows)


def test_the_limit_bounds_what_is_kept_and_forgetting_frees_it():
    """Under a limit of 0 bytes nothing is kept (each call packs its own, with the same numbers); raised, the refused
    matrix is kept at its next call; when the matrix's bytes go, so do its tiles."""
    x = _activations(4, 256, seed=1)
    previous = cpu_kernels.tile_limit(0)
    try:
        start = cpu_kernels.kept_tile_bytes()
        w = _kept(_random(GGMLType.Q5_0, 40, 256, seed=21))
        _assert_tiles_equal_rows(x, w, 1)
        assert cpu_kernels.kept_tile_bytes() == start
        assert cpu_kernels.tile_limit(previous) == 0
        _assert_tiles_equal_rows(x, w, 1)
        kept = cpu_kernels.kept_tile_bytes() - start
        assert kept >= 40 * 256  # at least a byte a weight
        del w
        gc.collect()
        assert cpu_kernels.kept_tile_bytes() == start
    finally:
        cpu_kernels.tile_limit(previous)


def test_model_weights_are_registered_and_decode_keeps_its_tokens():
    """Loading a model registers its CPU matrices; several sequences decoding together keep each one's numbers."""
    from mtpserve.models.loader import load

    model = load(tinyqwen_path("Q4_K_M"))
    before = cpu_kernels.kept_tile_bytes()
    states = [model.new_state(64) for _ in range(3)]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    alone = []
    for prompt in prompts:
        state = model.new_state(64)
        model.forward(torch.tensor(prompt), state)
        alone.append(model.logits(model.forward(torch.tensor([3]), state)))
    for prompt, state in zip(prompts, states):
        model.forward(torch.tensor(prompt), state)
    together = model.program_decode([3, 3, 3], states, logits=True)[1]
    assert cpu_kernels.kept_tile_bytes() > before
    for s in range(3):
        assert torch.equal(together[s : s + 1], alone[s])
