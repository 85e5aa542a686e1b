"""Warp-level PTX (mtpserve.kernels.triton.warp) against the PTX ISA's definitions, under the Triton interpreter:
each mma's fragments are unpacked here into matrices by the ISA's tables ("Matrix fragments for mma.m8n8k16",
"... mma.m16n8k8"; lane = 4 * groupID + threadID_in_group), multiplied in PyTorch and packed back, two warps at
once, as 1-D tensors and as [A, B, lanes] ones. On a GPU the same kernels run the inline PTX (bench/gpu_smoke.py
runs the attention built on them). `lane_layout_problems` (tests/support/gpu_compile.py), which holds Triton's
layouts to what the PTX assumes, is checked here on layouts it must refuse."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import triton
import triton.language as tl

from mtpserve.kernels.triton.intdot import INLINE_ASM
from mtpserve.kernels.triton.warp import (
    mma_f16_m16n8k8,
    mma_f16_m16n8k16,
    mma_f16_m16n8k16_zero_c,
    mma_s8_m8n8k16,
    opaque,
    other_warp,
    pack_f16x2,
    pack_f16x2_rn,
    scaled_halves,
    scaled_pairs,
    shfl_idx,
    shfl_xor,
    transpose_f16_8x8,
)
from tests.support.gpu_compile import lane_layout_problems

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
LANES = 64  # two warps: nothing may cross between them


@triton.jit
def _ops_kernel(a_ptr, b_ptr, c_ptr, f_ptr, out_ptr, LANES: tl.constexpr, RANK3: tl.constexpr, ASM: tl.constexpr):
    """out[k] = one primitive's result k on lanes of int32 words a, b, c[0..3] and floats f[0..3]."""
    lane = tl.arange(0, LANES)
    if RANK3:  # the same lanes as [2, 2, lanes] (4 copies), as the attention kernel holds registers
        at = tl.zeros([2, 2, 1], tl.int32) + lane[None, None, :]
    else:
        at = lane
    a = tl.load(a_ptr + at)
    b = tl.load(b_ptr + at)
    c = tl.load(c_ptr + at)
    c1 = tl.load(c_ptr + LANES + at)
    f = tl.load(f_ptr + at)
    f1 = tl.load(f_ptr + LANES + at)
    f2 = tl.load(f_ptr + 2 * LANES + at)
    f3 = tl.load(f_ptr + 3 * LANES + at)
    i0, i1 = mma_s8_m8n8k16(a, b, c, c1, ASM)
    d0, d1, d2, d3 = mma_f16_m16n8k8(a, b, c, f, f1, f2, f3, ASM)  # a, b: A's two pair words; c: B's pair
    p0, p1, p2, p3 = scaled_pairs(a, b, c, ASM)
    outs = (i0, i1, d0, d1, d2, d3, p0, p1, p2, p3, shfl_xor(f, 2, ASM), shfl_idx(f, (lane * 7 + 3) % 32, ASM))
    outs = outs + (pack_f16x2(f, f1), opaque(a, ASM), other_warp(f), opaque(a, ASM, VOLATILE=True))
    for k in tl.static_range(len(outs)):
        if outs[k].dtype == tl.float32:
            tl.store(out_ptr + k * LANES + at, outs[k].to(tl.int32, bitcast=True))
        else:
            tl.store(out_ptr + k * LANES + at, outs[k])


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> their signed bytes [..., 4], byte 0 first."""
    return torch.stack([((words << (24 - 8 * i)) >> 24) for i in range(4)], dim=-1)


def _halves(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> the two fp16 in each as float32 [..., 2], the low half first."""
    lo = (words & 0xFFFF).to(torch.int16).view(torch.float16)
    hi = ((words >> 16) & 0xFFFF).to(torch.int16).view(torch.float16)
    return torch.stack([lo, hi], dim=-1).float()


def _f16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


def _run(rank3: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-(2**31), 2**31, (LANES,), generator=g, dtype=torch.int64).to(torch.int32)
    b = torch.randint(-(2**31), 2**31, (LANES,), generator=g, dtype=torch.int64).to(torch.int32)
    scales = _f16_bits(torch.randn(LANES, 2, generator=g))  # c's first word: a pair of fp16 scales
    c = torch.stack(
        [scales[:, 0] | (scales[:, 1] << 16), torch.randint(-5000, 5000, (LANES,), generator=g, dtype=torch.int32)]
    )
    f = torch.randn(4, LANES, generator=g)
    # A and B of the fp16 mma as pairs of small fp16 (exact products); its B pair is c's word
    pair = _f16_bits(torch.randn(3, LANES, 2, generator=g))
    af, bf, cf = (pair[i, :, 0] | (pair[i, :, 1] << 16) for i in range(3))
    inputs = {"a": a, "b": b, "c": c.flatten(), "f": f.flatten()}
    outs = []
    for words in ((a, b, c.flatten()), (af, bf, torch.cat([cf, c[1]]))):
        out = torch.empty(16, LANES, dtype=torch.int32)
        args = [t.to(DEVICE) for t in (*words, inputs["f"])]
        _ops_kernel[(1,)](*args, out.to(DEVICE), LANES=LANES, RANK3=rank3, ASM=INLINE_ASM)
        outs.append(out)
    return {"int": outs[0], "f16": outs[1]}, {"a": a, "b": b, "c": c, "f": f, "af": af, "bf": bf, "cf": cf}


@pytest.fixture(scope="module", params=[False, True], ids=["1-D", "[A, B, lanes]"])
def run(request: pytest.FixtureRequest) -> tuple[dict, dict]:
    return _run(request.param)


def _lane(w: int, g: int, t: int) -> int:
    return 32 * w + 4 * g + t


def test_mma_s8_m8n8k16_is_the_isa_product(run: tuple[dict, dict]) -> None:
    out, x = run
    for w in range(2):
        A = torch.zeros(8, 16, dtype=torch.int64)  # row-major: lane (g, t) holds A[g, 4t..4t+3]
        B = torch.zeros(16, 8, dtype=torch.int64)  # lane (g, t) holds B[4t..4t+3, g]
        for g in range(8):
            for t in range(4):
                A[g, 4 * t : 4 * t + 4] = _bytes(x["a"][_lane(w, g, t)])
                B[4 * t : 4 * t + 4, g] = _bytes(x["b"][_lane(w, g, t)])
        D = A @ B
        for g in range(8):
            for t in range(4):
                i = _lane(w, g, t)  # lane (g, t) holds D[g, 2t], D[g, 2t + 1]
                assert out["int"][0, i] == D[g, 2 * t] + x["c"][0, i]
                assert out["int"][1, i] == D[g, 2 * t + 1] + x["c"][1, i]


def test_mma_f16_m16n8k8_is_the_isa_product(run: tuple[dict, dict]) -> None:
    out, x = run
    for w in range(2):
        A = torch.zeros(16, 8)  # a0 = A[g, 2t..2t+1], a1 = A[g + 8, 2t..2t+1]
        B = torch.zeros(8, 8)  # b = B[2t..2t+1, g]
        for g in range(8):
            for t in range(4):
                i = _lane(w, g, t)
                A[g, 2 * t : 2 * t + 2] = _halves(x["af"][i])
                A[g + 8, 2 * t : 2 * t + 2] = _halves(x["bf"][i])
                B[2 * t : 2 * t + 2, g] = _halves(x["cf"][i])
        D = A.double() @ B.double()
        got = out["f16"][2:6].view(torch.float32)
        for g in range(8):
            for t in range(4):
                i = _lane(w, g, t)  # D[g, 2t], D[g, 2t + 1], D[g + 8, 2t], D[g + 8, 2t + 1]
                want = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
                for k in range(4):
                    assert got[k, i].item() == pytest.approx(want[k].item() + x["f"][k, i].item(), rel=1e-6, abs=1e-6)


def test_scaled_pairs_are_fp16_products_of_two_keys_bytes(run: tuple[dict, dict]) -> None:
    out, x = run
    scales = _halves(x["c"][0])  # c's word as the pair of scales
    xb, yb = _bytes(x["a"]).float(), _bytes(x["b"]).float()
    for k in range(4):  # pair k: (x's byte k * scale lo, y's byte k * scale hi), each rounded to fp16
        lo = (xb[:, k].half() * scales[:, 0].half()).float()
        hi = (yb[:, k].half() * scales[:, 1].half()).float()
        got = _halves(out["int"][6 + k])
        assert torch.equal(got[:, 0], lo) and torch.equal(got[:, 1], hi)


def test_shuffles_pack_opaque_and_the_other_warp(run: tuple[dict, dict]) -> None:
    out, x = run
    f = x["f"][0]
    lanes = torch.arange(LANES)
    assert torch.equal(out["int"][10].view(torch.float32), f[lanes ^ 2])
    assert torch.equal(out["int"][11].view(torch.float32), f[lanes // 32 * 32 + (lanes * 7 + 3) % 32])
    assert torch.equal(out["int"][12], _f16_bits(f) | (_f16_bits(x["f"][1]) << 16))
    assert torch.equal(out["int"][13], x["a"])
    assert torch.equal(out["int"][14].view(torch.float32), f[lanes ^ 32])  # the other warp's lane
    assert torch.equal(out["int"][15], x["a"])


@triton.jit
def _sm80_ops_kernel(w_ptr, f_ptr, out_ptr, LANES: tl.constexpr, ASM: tl.constexpr):
    """out[k] = result k of the sm_80 primitives on lanes of int32 words w[0..6] (A's four pair words, B's two, any
    bits) and floats f[0..3] (C)."""
    lane = tl.arange(0, LANES)
    w = ()
    for i in tl.static_range(7):
        w = w + (tl.load(w_ptr + i * LANES + lane),)
    f = ()
    for i in tl.static_range(4):
        f = f + (tl.load(f_ptr + i * LANES + lane),)
    outs = mma_f16_m16n8k16(w[0], w[1], w[2], w[3], w[4], w[5], f[0], f[1], f[2], f[3], ASM)
    outs = outs + mma_f16_m16n8k16_zero_c(w[0], w[1], w[2], w[3], w[4], w[5], ASM)
    outs = outs + scaled_halves(w[6], w[4], ASM) + (transpose_f16_8x8(w[6], ASM), pack_f16x2_rn(f[0], f[1], ASM))
    for k in tl.static_range(len(outs)):
        if outs[k].dtype == tl.float32:
            tl.store(out_ptr + k * LANES + lane, outs[k].to(tl.int32, bitcast=True))
        else:
            tl.store(out_ptr + k * LANES + lane, outs[k])


@pytest.fixture(scope="module")
def sm80() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, w, f) of `_sm80_ops_kernel` on random small fp16 pairs (exact products) and scales."""
    g = torch.Generator().manual_seed(5)
    pairs = _f16_bits(torch.randn(7, LANES, 2, generator=g))
    w = pairs[:, :, 0] | (pairs[:, :, 1] << 16)
    scale = _f16_bits(torch.randn(LANES, generator=g))
    w[4] = scale | (scale << 16)  # B's first word doubles as scaled_halves' scale pair
    w[6] = torch.randint(-(2**31), 2**31, (LANES,), generator=g, dtype=torch.int64).to(torch.int32)  # any bits
    f = torch.randn(4, LANES, generator=g)
    out = torch.empty(12, LANES, dtype=torch.int32)
    if DEVICE != "cpu" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("m16n8k16 and cvt.rn.f16x2.f32 need sm_80")
    _sm80_ops_kernel[(1,)](w.to(DEVICE), f.to(DEVICE), out.to(DEVICE), LANES=LANES, ASM=INLINE_ASM)
    return out, w, f


def test_mma_f16_m16n8k16_is_the_isa_product(sm80: tuple) -> None:
    """A [16 x 16]: a0 = A[g, 2t..], a1 = A[g + 8, 2t..], a2 = A[g, 2t + 8..], a3 = A[g + 8, 2t + 8..]; B [16 x 8]:
    b0 = B[2t.., g], b1 = B[2t + 8.., g]; D as m16n8k8's. With C, and with C = 0."""
    out, w, f = sm80
    for wp in range(2):
        A = torch.zeros(16, 16)
        B = torch.zeros(16, 8)
        for g in range(8):
            for t in range(4):
                i = _lane(wp, g, t)
                A[g, 2 * t : 2 * t + 2] = _halves(w[0][i])
                A[g + 8, 2 * t : 2 * t + 2] = _halves(w[1][i])
                A[g, 2 * t + 8 : 2 * t + 10] = _halves(w[2][i])
                A[g + 8, 2 * t + 8 : 2 * t + 10] = _halves(w[3][i])
                B[2 * t : 2 * t + 2, g] = _halves(w[4][i])
                B[2 * t + 8 : 2 * t + 10, g] = _halves(w[5][i])
        D = A.double() @ B.double()
        for g in range(8):
            for t in range(4):
                i = _lane(wp, g, t)
                want = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
                for k in range(4):
                    c = f[k, i].item()
                    got = out[k, i].view(torch.float32).item()
                    zero_c = out[4 + k, i].view(torch.float32).item()
                    assert got == pytest.approx(want[k].item() + c, rel=1e-5, abs=1e-5)
                    assert zero_c == pytest.approx(want[k].item(), rel=1e-5, abs=1e-5)


def test_scaled_halves_transpose_and_pack_rn(sm80: tuple) -> None:
    """scaled_halves: (byte 0 * s, byte 1 * s), (byte 2 * s, byte 3 * s), each rounded to fp16; transpose_f16_8x8:
    lane (g, t) gets (M[2t, g], M[2t + 1, g]) of the 8 x 8 matrix the lanes' pairs hold; pack_f16x2_rn: pack_f16x2."""
    out, w, f = sm80
    s = _halves(w[4])[:, 0].half()
    b = _bytes(w[6]).float().half()
    for k in range(2):
        got = _halves(out[8 + k])
        assert torch.equal(got[:, 0], (b[:, 2 * k] * s).float()) and torch.equal(
            got[:, 1], (b[:, 2 * k + 1] * s).float()
        )
    for wp in range(2):
        M = torch.zeros(8, 8)
        for r in range(8):
            for q in range(4):
                M[r, 2 * q : 2 * q + 2] = _halves(w[6][_lane(wp, r, q)])
        for g in range(8):
            for t in range(4):
                got = _halves(out[10, _lane(wp, g, t)])
                want = torch.stack([M[2 * t, g], M[2 * t + 1, g]])
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: NaNs too
    assert torch.equal(out[11], _f16_bits(f[0]) | (_f16_bits(f[1]) << 16))


_I32 = "tensor<128xi32, #blocked1>"
_SLICED = "tensor<1x128xf32, #ttg.slice<{dim = 1, parent = #ttg.slice<{dim = 2, parent = #blocked2}>}>>"
GOOD = "\n".join(
    [
        "#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, 4], "
        "order = [1, 0]}>",
        "#blocked1 = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]}>",
        '%1 = tt.elementwise_inline_asm "mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {$0, $1}, {$2}, {$3}, '
        '{$4, $5};" {constraints = "=r,=r,r,r,r,r", packed_element = 1 : i32, pure = true} %a, %b, %c, %c : '
        f"{_I32}, {_I32}, {_I32}, {_I32} -> {_I32}, {_I32}",
        '%2 = tt.elementwise_inline_asm "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;" {constraints = '
        f'"=r,r,r", packed_element = 1 : i32, pure = true}} %x, %m : {_SLICED}, tensor<8x128xi32, #blocked> -> '
        "tensor<8x128xi32, #blocked>",
        "#blocked2 = #ttg.blocked<{sizePerThread = [1, 4, 1, 1], threadsPerWarp = [1, 1, 1, 32], "
        "warpsPerCTA = [1, 1, 1, 4], order = [3, 1, 2, 0]}>",
    ]
)


def test_lane_layouts_are_checked() -> None:
    """Lane-per-element layouts pass (slices of slices included); a layout that puts threads on a register dim (what
    Triton 3.6 chose for an early version of the attention kernel), two elements a thread, or fewer warps than the
    launch has are refused."""
    assert lane_layout_problems(GOOD, 4) == []
    assert lane_layout_problems(GOOD, 2)  # 128 lanes on 2 warps: not one element a thread
    bad_threads = GOOD.replace("threadsPerWarp = [1, 1, 1, 32]", "threadsPerWarp = [1, 8, 1, 4]")
    assert any("mma" in p or "shfl" in p for p in lane_layout_problems(bad_threads, 4))
    two_a_thread = GOOD.replace(
        "sizePerThread = [1], threadsPerWarp = [32]", "sizePerThread = [2], threadsPerWarp = [32]"
    )
    assert lane_layout_problems(two_a_thread, 4)
    elementwise = GOOD.replace("mma.sync", "dp4a").replace("shfl.sync", "prmt")  # per-thread asm: any layout
    assert lane_layout_problems(elementwise.replace("threadsPerWarp = [32]", "threadsPerWarp = [8]"), 4) == []
