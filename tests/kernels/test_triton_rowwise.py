"""The row-wise Triton kernels that make a matmul input in one launch (mtpserve.kernels.triton.rowwise), run on CPU
under the Triton interpreter (or on a GPU when there is one): q and d bit-exact to ops.linear's activation rounding
of the kernel's own output (ties and signed-peak ties included), the output itself against the PyTorch twins of
ops.rowwise, and exactly one launch per call."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton row-wise kernels cannot be tested")

from mtpserve.kernels.triton import rowwise as kernels
from mtpserve.ops import quant_gemv, rowwise
from mtpserve.ops.activation_rounding import ActFormat, pair_halves
from mtpserve.ops.linear import quantize_activations_q8_0, quantize_activations_q8_k

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
        reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
    ),
    # The interpreter's numpy warns at IEEE overflow (exp(1e4), f16(7e4)); the kernels select around those values.
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
SHAPES = ((1, 256), (3, 512), (9, 5120))
ACTS = ("silu", "sigmoid", "gelu_f16")


@pytest.fixture(autouse=True)
def _kernels_at_any_rows():
    """The ops dispatchers send prompt-sized inputs to the twins under the interpreter (ops.quant_gemv.triton_for_rows);
    these tests hold the kernels themselves to the twins at every size."""
    with mock.patch.object(quant_gemv, "INTERPRETED_MAX_ROWS", 1 << 30):
        yield


def _fmt(block: int | None) -> ActFormat | None:
    return None if block is None else ActFormat(block)


def _twin_quant(y: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.linear's rounding of y, as (q int8 [M, K], d float32 [M, K / block]) with Q8_0's d rounded to f16."""
    y = y.cpu().float()
    if block == 256:
        q, d = quantize_activations_q8_k(y)
    else:
        q, _, d = quantize_activations_q8_0(y)
    return q.reshape(y.shape).to(torch.int8), d


def _assert_quant(y: torch.Tensor, q: torch.Tensor, d: torch.Tensor, block: int) -> None:
    want_q, want_d = _twin_quant(y, block)
    assert q.dtype == torch.int8 and d.dtype == torch.float32
    assert torch.equal(q.cpu(), want_q)
    assert torch.equal(d.cpu(), want_d)


def _rows(M: int, K: int, seed: int) -> torch.Tensor:
    """Random rows with the cases the rounding must get right: exact ties (a block whose peak is +-127 scales by
    exactly 1, so k + 0.5 is a tie), +a and -a both at a block's peak (the first one's sign decides), zero blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 10
    ties = (torch.randint(-254, 254, (min(K, 256),), generator=gen).float() + 1) / 2  # halves in (-127, 127)
    x[0, : ties.numel()] = ties
    x[0, 5] = -127.0  # the Q8_K peak: iscale = 1 exactly (Q8_0: amax 127 in that 32-block)
    if K >= 512:
        x[0, 256:512] = 0.0  # a zero Q8_K block
    if M > 1:
        x[1, 7], x[1, 9] = 3e3, -3e3  # +a first: q of +a is -127
        x[1, 40], x[1, 33] = 5e3, -5e3  # -a first, in a 32-block too
    if M > 2:
        x[2] = 0.0  # a zero row
    return x


@contextlib.contextmanager
def _counting_launches():
    """Counts the launches of the module's three kernels (each still runs)."""
    counts: list[str] = []
    fns = (kernels._norm_kernel, kernels._quant_kernel, kernels._glu_kernel)
    saved = [f.run for f in fns]
    try:
        for f, run in zip(fns, saved):
            f.run = lambda *a, _run=run, _name=f.__name__, **k: (counts.append(_name), _run(*a, **k))[1]
        yield counts
    finally:
        for f in fns:
            del f.run


@pytest.mark.parametrize("block", (256, 32))
@pytest.mark.parametrize("M,K", SHAPES)
def test_quantize_rows_is_llama_cpp_rounding(M: int, K: int, block: int) -> None:
    x = _rows(M, K, seed=M * K + block)
    with _counting_launches() as launches:
        q, d = rowwise.quantize_rows(x.to(DEVICE), _fmt(block))
    assert launches == ["_quant_kernel"]
    _assert_quant(x, q, d, block)
    assert torch.equal(q.cpu(), rowwise.quantize_rows_reference(x, _fmt(block))[0])


@pytest.mark.parametrize("block", (256, 32))
def test_quantize_rows_of_a_strided_view_and_small_chunks(block: int) -> None:
    x = _rows(3, 1024, seed=3)
    wide = torch.zeros(3, 3000)
    wide[:, 100:1124] = x
    q, d = kernels.quantize_rows(wide[:, 100:1124].to(DEVICE), block, chunk=256)
    _assert_quant(x, q, d, block)


def test_quantize_rows_ties_round_to_even() -> None:
    """A block scaled by exactly 1 (peak -127 for Q8_K; amax 127 for Q8_0): k + 0.5 goes to the even neighbour."""
    x = torch.zeros(1, 256)
    x[0, :6] = torch.tensor([-127.0, 0.5, 1.5, 2.5, -2.5, 126.5])
    x[0, 32:36] = torch.tensor([127.0, 0.5, 1.5, -0.5])
    q, _ = rowwise.quantize_rows(x.to(DEVICE), _fmt(256))
    assert q[0, :6].tolist() == [-127, 0, 2, 2, -2, 126]  # iscale = -127 / -127 = 1
    q, _ = rowwise.quantize_rows(x.to(DEVICE), _fmt(32))
    assert q[0, 32:36].tolist() == [127, 0, 2, 0]
    _assert_quant(x, *rowwise.quantize_rows(x.to(DEVICE), _fmt(256)), 256)


@pytest.mark.parametrize("block", (256, 32, None))
@pytest.mark.parametrize("M,K", SHAPES)
def test_rms_norm_quantize_with_add(M: int, K: int, block: int | None) -> None:
    x, add = _rows(M, K, seed=K + M), torch.randn(M, K) * 0.1
    weight = torch.randn(K) * 0.5 + 1
    with _counting_launches() as launches:
        s, y, q, d = rowwise.rms_norm_quantize(
            x.to(DEVICE), weight.to(DEVICE), 1e-6, add=add.to(DEVICE), fmt=_fmt(block)
        )
    assert launches == ["_norm_kernel"]
    want_s, want_y, _, _ = rowwise.rms_norm_quantize_reference(x, weight, 1e-6, add=add)
    assert torch.equal(s.cpu(), want_s)
    torch.testing.assert_close(y.cpu(), want_y, rtol=2e-6, atol=1e-6)
    if block is None:
        assert q is None and d is None
    else:
        _assert_quant(y, q, d, block)


@pytest.mark.parametrize("block", (256, 32))
def test_paired_quants_are_the_plain_ones_in_pairs(block: int) -> None:
    """With `paired`, each kernel stores the same quants as without, each 32 as (v0, v16, v1, v17, ...): the order
    the IQ4 GEMVs read (ops.activation_rounding.pair_halves)."""
    x, add = _rows(3, 1024, seed=block), torch.randn(3, 1024)
    on, on_add = x.to(DEVICE), add.to(DEVICE)
    plain = kernels.quantize_rows(on, block)
    paired = kernels.quantize_rows(on, block, paired=True)
    assert torch.equal(paired[0].cpu(), pair_halves(plain[0].cpu())) and torch.equal(paired[1], plain[1])
    norm_plain = kernels.rms_norm_quantize(on, None, 1e-6, add=on_add, block=block)
    norm_paired = kernels.rms_norm_quantize(on, None, 1e-6, add=on_add, block=block, paired=True)
    assert torch.equal(norm_paired[2].cpu(), pair_halves(norm_plain[2].cpu()))
    glu_plain = kernels.glu_quantize(on, on_add, "silu", block=block)
    glu_paired = kernels.glu_quantize(on, on_add, "silu", block=block, paired=True)
    assert torch.equal(glu_paired[1].cpu(), pair_halves(glu_plain[1].cpu()))
    twin_q, twin_d = rowwise.quantize_rows_reference(x, ActFormat(block, True))
    assert torch.equal(paired[0].cpu(), twin_q) and torch.equal(paired[1].cpu(), twin_d)


def test_q8_1_keeps_each_blocks_scale_unrounded() -> None:
    """With `q8_1` (Q4_1/Q5_1's activations) every kernel stores the same quants as Q8_0 and each block's d as
    computed, amax / 127 bit for bit as ops.linear's rounding has it, which rounds to Q8_0's f16 d; the twin alike."""
    x, add = _rows(3, 1024, seed=21), torch.randn(3, 1024)
    on, on_add = x.to(DEVICE), add.to(DEVICE)

    def assert_q8_1(y: torch.Tensor, plain: tuple, q8_1: tuple) -> None:
        _, exact_d, d16 = quantize_activations_q8_0(y.cpu().float())
        assert torch.equal(q8_1[0].cpu(), plain[0].cpu()) and torch.equal(q8_1[1].cpu(), exact_d)
        assert torch.equal(plain[1].cpu(), d16) and not torch.equal(exact_d, d16)

    assert_q8_1(x, kernels.quantize_rows(on, 32), kernels.quantize_rows(on, 32, q8_1=True))
    s, y, *plain = kernels.rms_norm_quantize(on, None, 1e-6, add=on_add, block=32)
    assert_q8_1(y, plain, kernels.rms_norm_quantize(on, None, 1e-6, add=on_add, block=32, q8_1=True)[2:])
    y, *plain = kernels.glu_quantize(on, on_add, "silu", block=32)
    assert_q8_1(y, plain, kernels.glu_quantize(on, on_add, "silu", block=32, q8_1=True)[1:])
    assert_q8_1(
        x,
        rowwise.quantize_rows_reference(x, ActFormat(32)),
        rowwise.quantize_rows_reference(x, ActFormat(32, q8_1=True)),
    )
    with pytest.raises(ValueError, match="q8_1"):
        kernels.quantize_rows(on, 256, q8_1=True)


@pytest.mark.parametrize("weighted", (True, False))
def test_rms_norm_quantize_without_add_returns_x_as_s(weighted: bool) -> None:
    x = _rows(3, 512, seed=1).to(DEVICE)
    weight = (torch.rand(512) + 0.5).to(DEVICE) if weighted else None
    s, y, q, d = rowwise.rms_norm_quantize(x, weight, 1e-5, fmt=_fmt(256))
    assert s is x
    want = rowwise.rms_norm_quantize_reference(x.cpu(), None if weight is None else weight.cpu(), 1e-5)[1]
    torch.testing.assert_close(y.cpu(), want, rtol=2e-6, atol=1e-6)
    assert torch.equal(y[2].cpu(), torch.zeros(512))  # a zero row: 0 * rsqrt(eps)
    _assert_quant(y, q, d, 256)


@pytest.mark.parametrize("block", (256, 32))
def test_rms_norm_quantize_looping_over_chunks(block: int) -> None:
    """Rows longer than the register tile (here a chunk of 512 over K = 5120): two passes, the same results."""
    x, add, weight = _rows(2, 5120, seed=7), torch.randn(2, 5120), torch.randn(5120)
    args = (x.to(DEVICE), weight.to(DEVICE), 1e-6)
    s, y, q, d = kernels.rms_norm_quantize(*args, add=add.to(DEVICE), block=block, chunk=512)
    s1, y1, _, _ = kernels.rms_norm_quantize(*args, add=add.to(DEVICE), block=block)
    assert torch.equal(s.cpu(), s1.cpu())
    torch.testing.assert_close(y.cpu(), y1.cpu(), rtol=2e-6, atol=1e-6)
    _assert_quant(y, q, d, block)


def _f16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many f16 steps apart two f16-representable tensors are."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.half().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _assert_glu(gate: torch.Tensor, up: torch.Tensor, act: str, y: torch.Tensor) -> None:
    want = rowwise.glu_quantize_reference(gate, up, act)[0]
    if act != "gelu_f16":
        torch.testing.assert_close(y.cpu(), want, rtol=2e-6, atol=1e-7)
        return
    # The f16 GELU values may land on the other side of an f16 rounding boundary than torch's tanh puts them (one
    # f16 step), or differ by float32 noise where 1 + tanh cancels (|GELU| < 1e-6, the far left tail).
    want_gelu = rowwise.glu_quantize_reference(gate, torch.ones_like(up), act)[0]
    got_gelu = kernels.glu_quantize(gate.to(DEVICE), torch.ones_like(up).to(DEVICE), act)[0].cpu()
    near = (_f16_ulps(got_gelu, want_gelu) <= 1) | ((got_gelu - want_gelu).abs() < 1e-6)
    assert bool(near.all()), (gate[~near][:8], got_gelu[~near][:8], want_gelu[~near][:8])
    assert (got_gelu != want_gelu).float().mean() < 0.01
    torch.testing.assert_close(y.cpu(), got_gelu * up, rtol=0, atol=0)


@pytest.mark.parametrize("block", (256, 32, None))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,F", SHAPES)
def test_glu_quantize_of_the_halves_of_one_output(M: int, F: int, act: str, block: int | None) -> None:
    gen = torch.Generator().manual_seed(F + M)
    gate_up = torch.randn(M, 2 * F, generator=gen) * 4
    gate, up = gate_up[:, :F], gate_up[:, F:]
    on = gate_up.to(DEVICE)
    with _counting_launches() as launches:
        y, q, d = rowwise.glu_quantize(on[:, :F], on[:, F:], act, fmt=_fmt(block))
    assert launches == ["_glu_kernel"]
    assert y.shape == (M, F) and y.dtype == torch.float32
    _assert_glu(gate, up, act, y)
    if block is None:
        assert q is None and d is None
    else:
        _assert_quant(y, q, d, block)


@pytest.mark.parametrize("block", (256, 32))
@pytest.mark.parametrize("M,H,D", ((1, 24, 256), (3, 4, 64)))
def test_glu_quantize_of_heads_interleaved_with_others(M: int, H: int, D: int, block: int) -> None:
    """Qwen3.5's attention gate: per head [query | gate] in one GEMV output, the gate heads read in place through
    their stride, the same bits as the gate copied out first (the copy the strided form replaces)."""
    gen = torch.Generator().manual_seed(H * D + M)
    qg = (torch.randn(M, H, 2, D, generator=gen) * 4).to(DEVICE)
    o = (torch.randn(M, H * D, generator=gen) * 2).to(DEVICE)
    gate = qg[:, :, 1]  # [M, H, D], heads 2D apart
    assert not gate.is_contiguous()
    with _counting_launches() as launches:
        y, q, d = rowwise.glu_quantize(gate, o.view(M, H, D), "sigmoid", fmt=_fmt(block))
    assert launches == ["_glu_kernel"]
    assert y.shape == (M, H * D)
    copied = rowwise.glu_quantize(gate.reshape(M, H * D), o, "sigmoid", fmt=_fmt(block))
    for got, want in zip((y, q, d), copied, strict=True):
        assert torch.equal(got, want)
    _assert_glu(gate.reshape(M, H * D).cpu(), o.cpu(), "sigmoid", y)
    _assert_quant(y, q, d, block)


def test_gelu_f16_edges() -> None:
    """0 at or below -10, the identity at or above 10 (also where f16 overflows), and the tail that cancels to 0."""
    edges = [-1e30, -7e4, -1e4, -10.001, -10.0, -9.999, -6.0, -5.0, -0.0, 0.0, 1e-6, 9.999, 10.0, 10.001, 7e4, 1e30]
    gate = torch.zeros(2, 256)
    gate[0, : len(edges)] = torch.tensor(edges)
    gate[1] = torch.linspace(-12, 12, 256)
    up = torch.full_like(gate, 3.0)
    y, q, d = rowwise.glu_quantize(gate.to(DEVICE), up.to(DEVICE), "gelu_f16", fmt=_fmt(256))
    y = y.cpu()
    assert torch.isfinite(y).all()
    assert y[0, :5].tolist() == [0.0] * 5  # <= -10
    assert torch.equal(y[0, 12 : len(edges)], gate[0, 12 : len(edges)] * 3)  # >= 10: the identity (times up = 3)
    _assert_glu(gate, up, "gelu_f16", y)
    _assert_quant(y, q, d, 256)


def test_glu_of_silu_and_sigmoid_at_large_inputs() -> None:
    gate = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 3.0] * 4])
    up = torch.ones_like(gate) * 2
    for act in ("silu", "sigmoid"):
        y, q, d = rowwise.glu_quantize(gate.to(DEVICE), up.to(DEVICE), act, fmt=_fmt(32))
        _assert_glu(gate, up, act, y)
        _assert_quant(y, q, d, 32)


def test_dispatchers_take_the_twins_without_triton() -> None:
    x, add = _rows(3, 512, seed=5), torch.randn(3, 512)
    with mock.patch.object(rowwise, "triton_for_rows", return_value=False), _counting_launches() as launches:
        s, y, q, d = rowwise.rms_norm_quantize(x, None, 1e-6, add=add, fmt=_fmt(32))
        y2, q2, d2 = rowwise.glu_quantize(x, add, "silu", fmt=_fmt(256))
        q3, d3 = rowwise.quantize_rows(x, _fmt(256))
    assert launches == []
    assert torch.equal(s, x + add)
    _assert_quant(y, q, d, 32)
    _assert_quant(y2, q2, d2, 256)
    _assert_quant(x, q3, d3, 256)


def test_bad_arguments_are_refused() -> None:
    x = torch.zeros(2, 300, device=DEVICE)
    with pytest.raises(ValueError, match="block"):
        kernels.quantize_rows(x, 256)
    with pytest.raises(ValueError, match="act"):
        kernels.glu_quantize(x, x, "relu")
    with pytest.raises(ValueError, match="add"):
        kernels.rms_norm_quantize(x, None, 1e-6, add=torch.zeros(2, 301, device=DEVICE))


def test_rms_norm_quantize_of_bf16_rows_writes_a_float32_s() -> None:
    x = _rows(3, 256, seed=2).bfloat16()
    s, y, q, d = rowwise.rms_norm_quantize(x.to(DEVICE), None, 1e-6, fmt=_fmt(256))
    assert s.dtype == torch.float32 and torch.equal(s.cpu(), x.float())
    torch.testing.assert_close(y.cpu(), rowwise.rms_norm_quantize_reference(x, None, 1e-6)[1], rtol=2e-6, atol=1e-6)
    _assert_quant(y, q, d, 256)
