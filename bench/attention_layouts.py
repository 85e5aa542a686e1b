"""What decode attention's inner loop costs over a q8_0 cache, by cache layout and QK arithmetic, without a GPU:
`python bench/attention_layouts.py [--json FILE]` (32 sm_90 compiles, ~4 minutes on 2 cores). `--check` runs each
prototype under the Triton interpreter against float32 attention of the same cache
(tests/bench/test_attention_layouts.py); on a lent GPU `--time 4096,65536` times them beside the server's kernel
(bench/gpu_check.sh's bench stage).

Issue 38 asks decode attention for an instruction-issue bound of 1.5x HBM (7.2 TB/s on an H200) with no spills.
The server's kernel (kernels/triton/attention.py) reaches 1.08 TB/s at the 27B's shapes (24 query heads over 4 KV
heads, D = 256); its fp16-operand choice 1.54 at 8 warps. This script asks why, with small prototypes of the key loop
alone (programs of a KV head and a split of the keys, merged by the caller; no window; positions read and masked as
the server's kernel masks them), compiled for sm_90 and read by bench/gpu_static.py's issue bound:

- layout "blocks": a head row of the cache as it is stored today, 8 GGUF q8_0 blocks of 34 bytes (an fp16 scale, 32
  int8). A block's quants start 2 bytes past a 4-byte boundary every other block, so no load is wider than 16 bits,
  and the compiler spends most of the loop re-packing bytes;
- layout "planar": the same 272 bytes a head row, the 8 scales first (16 bytes) and the 256 quants after, every load
  16-byte aligned. Not the server's layout: what changing it would buy;
- QK "fp16": K dequantized to fp16 (scale applied) and one tensor-core product with Q in fp16, as the server's fp16
  choice does; QK "int8": Q rounded to 8 bits a 32-block (as llama.cpp's CUDA kernels round it, to q8_1), one int8
  tensor-core product a block of K's quants as stored, its int32 sums scaled by both blocks' scales. V is
  dequantized to fp16 in both, the products in fp16 with float32 sums.

These are studies, not kernels the server runs; docs/gpu-decode.md has what they say.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mtpserve.kernels.triton.intdot import int8_to_fp16  # noqa: E402
from mtpserve.quant.dequant import dequantize  # noqa: E402
from mtpserve.quant.quantize import quantize  # noqa: E402
from mtpserve.quant.types import GGMLType  # noqa: E402

N_HEAD, N_HEAD_KV, HEAD_DIM = 24, 4, 256  # Qwen3.6-27B's attention
ROW = HEAD_DIM // 32 * 34  # bytes of one KV head of one cell: 272, a multiple of 16
LAYOUTS = ("blocks", "planar")
QK = ("fp16", "int8")
# (query rows a program, warps, keys a tile): 16 rows hold a decode's 6 (one token x 6 query heads a KV head),
# 32 a verification's 18 in one pass.
SHAPES = ((16, 2, 16), (16, 4, 32), (16, 8, 16), (32, 4, 32))
CONVERSIONS = ("compiler", "packed")  # V's int8 -> fp16: Triton's own, or intdot.int8_to_fp16


@triton.jit
def _study_kernel(q_ptr, qs_ptr, k_ptr, v_ptr, q_pos_ptr, k_pos_ptr, acc_ptr, ml_ptr, n_keys, n_rows, keys_a_split,
                  CELL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
                  PLANAR: tl.constexpr, INT8_QK: tl.constexpr, PACKED_CVT: tl.constexpr):  # fmt: skip
    """The unnormalised partial softmax(q k^T) v of BLOCK_M rows (scores already scaled into base 2 by the caller's
    q) over one split of the n_keys cells of one KV head (programs: KV head, split), with its row max and sum; a key
    is seen by row r iff 0 <= k_pos <= q_pos[r]. The caller merges the splits."""
    NB: tl.constexpr = D // 32
    h, split = tl.program_id(0), tl.program_id(1)
    first = split * keys_a_split
    end = tl.minimum(first + keys_a_split, n_keys)
    m, s, d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_S), tl.arange(0, D)
    blk, e = tl.arange(0, NB), tl.arange(0, 32)
    q_pos = tl.load(q_pos_ptr + m, mask=m < n_rows, other=-1)
    q_rows = (h * BLOCK_M + m)[:, None] * D
    if INT8_QK:  # Q's 32-blocks as int8 with their scales, held in registers for the whole walk
        qi = ()
        qs = ()
        for b in tl.static_range(NB):
            qi = qi + (tl.load(q_ptr.to(tl.pointer_type(tl.int8)) + q_rows + b * 32 + e[None, :]),)
            qs = qs + (tl.load(qs_ptr + (h * BLOCK_M + m) * NB + b),)
    else:
        qf = tl.load(q_ptr.to(tl.pointer_type(tl.float16)) + q_rows + d[None, :])
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for start in range(first, end, BLOCK_S):
        keys = start + s
        k_pos = tl.load(k_pos_ptr + keys, mask=keys < end, other=-1)
        seen = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
        # Loads are not masked: every cell holds finite numbers (the cache starts zeroed), the unseen ones get no
        # weight, and the tail tile re-reads the last cell.
        rows = tl.minimum(keys, end - 1).to(tl.int64) * CELL + h * (NB * 34)  # byte offset of each key's head row
        quants, scales = _block_offsets(blk, NB, PLANAR)  # element (key, block, i) of the head rows
        quant_at = rows[:, None, None] + quants[None, :, None] + e[None, None, :]
        scale_at = rows[:, None, None] + scales[None, :, None]
        if INT8_QK:
            sc = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
            for b in tl.static_range(NB):
                quant_b, scale_b = _block_offsets(b, NB, PLANAR)
                kb = tl.load(k_ptr + rows[:, None] + quant_b + e[None, :]).to(tl.int8, bitcast=True)
                ks = tl.load((k_ptr + rows + scale_b).to(tl.pointer_type(tl.float16)))
                dots = tl.dot(qi[b], tl.trans(kb)).to(tl.float32)
                sc += dots * (qs[b][:, None] * ks.to(tl.float32)[None, :])
        else:
            kq = tl.load(k_ptr + quant_at).to(tl.int8, bitcast=True)
            ks = tl.load((k_ptr + scale_at).to(tl.pointer_type(tl.float16)))
            sc = tl.dot(qf, tl.trans(tl.reshape(kq.to(tl.float16) * ks, (BLOCK_S, D))))
        vq = tl.load(v_ptr + quant_at).to(tl.int8, bitcast=True)
        vs = tl.load((v_ptr + scale_at).to(tl.pointer_type(tl.float16)))
        if PACKED_CVT:
            v = tl.reshape(int8_to_fp16(vq, True) * vs, (BLOCK_S, D))
        else:
            v = tl.reshape(vq.to(tl.float16) * vs, (BLOCK_S, D))
        sc = tl.where(seen, sc, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
    part = (split * tl.num_programs(0) + h) * BLOCK_M + m
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)
    tl.store(ml_ptr + part * 2, m_i)
    tl.store(ml_ptr + part * 2 + 1, l_i)


@triton.jit
def _block_offsets(b, NB: tl.constexpr, PLANAR: tl.constexpr):
    """Bytes from a q8_0 head row's start to block b's quants and to its fp16 scale: GGUF blocks (scale, 32
    quants) one after another, or planar (the NB scales, then the quants)."""
    if PLANAR:
        return 2 * NB + b * 32, b * 2
    else:
        return b * 34 + 2, b * 34


def _q8_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """float [..., D] -> its q8_0 blocks uint8 [..., D / 32, 34] (mtpserve's quantizer, llama.cpp's rounding)."""
    return quantize(x.float().reshape(-1, x.shape[-1]), GGMLType.Q8_0).view(*x.shape[:-1], x.shape[-1] // 32, 34)


def planar_rows(blocks: torch.Tensor) -> torch.Tensor:
    """q8_0 blocks [S, Hkv, NB, 34] -> planar head rows [S, Hkv * ROW]: each head's NB scales, then its quants."""
    return torch.cat([blocks[..., :2].flatten(2), blocks[..., 2:].flatten(2)], dim=2).reshape(blocks.shape[0], -1)


def cache_rows(x: torch.Tensor, planar: bool) -> torch.Tensor:
    """float [S, Hkv, D] -> q8_0 head rows uint8 [S, Hkv * ROW]: GGUF blocks, or the same bytes planar."""
    blocks = _q8_0_blocks(x)
    return planar_rows(blocks) if planar else blocks.reshape(x.shape[0], -1)


def study_attention(  # noqa: ANN201
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    planar: bool,
    int8_qk: bool,
    block_m: int = 16,
    num_warps: int = 4,
    block_s: int = 16,
    packed_cvt: bool = False,
    n_splits: int = 1,
    partials_only: bool = False,
):
    """The prototype on q [T, H, D] (T * H / Hkv rows a KV head, at most block_m) -> float32 [T, H, D], its splits
    merged here (`partials_only`: the kernel alone, for timing)."""
    T, H, D = q.shape
    device = k_rows.device
    G, n_rows = H // N_HEAD_KV, T * H // N_HEAD_KV
    scale = D**-0.5 * 1.4426950408889634  # scores in base 2
    rows = (q.float() * scale).view(T, N_HEAD_KV, G, D).permute(1, 0, 2, 3).reshape(N_HEAD_KV, n_rows, D)
    padded = torch.zeros(N_HEAD_KV, block_m, D, device=device)
    padded[:, :n_rows] = rows
    pos = torch.full((block_m,), -1, dtype=torch.int32, device=device)
    pos[:n_rows] = q_pos.to(torch.int32).repeat_interleave(G)
    if int8_qk:  # Q as q8_0 blocks, as llama.cpp's CPU path rounds it for a q8_0 cache
        q_blocks = _q8_0_blocks(padded)
        q_arg = q_blocks[..., 2:].contiguous().view(torch.int8).flatten(-2)
        q_scales = q_blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    else:
        q_arg, q_scales = padded.half(), torch.zeros(1, device=device)
    n_keys = k_pos.shape[0]
    keys_a_split = triton.cdiv(triton.cdiv(n_keys, n_splits), block_s) * block_s
    acc = torch.empty(n_splits, N_HEAD_KV, block_m, D, device=device)
    ml = torch.empty(n_splits, N_HEAD_KV, block_m, 2, device=device)
    _study_kernel[(N_HEAD_KV, n_splits)](q_arg, q_scales, k_rows, v_rows, pos, k_pos.to(torch.int32), acc, ml,
                                n_keys, n_rows, keys_a_split, CELL=N_HEAD_KV * ROW, BLOCK_M=block_m, BLOCK_S=block_s,
                                D=D, PLANAR=planar, INT8_QK=int8_qk, PACKED_CVT=packed_cvt,
                                num_warps=num_warps)  # fmt: skip
    if partials_only:
        return acc
    top = ml[..., 0].amax(0)  # the splits merged by the log-sum-exp rule (base 2)
    weight = torch.exp2(ml[..., 0] - torch.where(top == -float("inf"), 0.0, top))
    out = (acc * weight[..., None]).sum(0) / (ml[..., 1] * weight).sum(0).clamp_min(1e-30)[..., None]
    return out[:, :n_rows].reshape(N_HEAD_KV, T, G, D).permute(1, 0, 2, 3).reshape(T, H, D)


def reference(q, k, v, q_pos, k_pos) -> torch.Tensor:  # noqa: ANN001
    """float32 attention of q [T, H, D] over the q8_0-rounded k, v [S, Hkv, D] (as the cache holds them)."""
    k, v = (dequantize(quantize(x.float(), GGMLType.Q8_0), GGMLType.Q8_0, x.shape) for x in (k, v))
    return reference_values(q, k, v, q_pos, k_pos)


def check(n_keys: int = 40) -> list[dict]:
    """Every prototype under the interpreter at a verification's 3 tokens, with empty cells and a tail tile."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(3, N_HEAD, HEAD_DIM),
        torch.randn(n_keys, N_HEAD_KV, HEAD_DIM),
        torch.randn(n_keys, N_HEAD_KV, HEAD_DIM),
    )
    k_pos = torch.arange(n_keys)
    k_pos[5] = -1  # an empty cell
    q_pos = torch.arange(3) + n_keys - 5  # the last keys are in the future of some rows
    want = reference(q, k, v, q_pos, k_pos)
    rows = []
    for layout in LAYOUTS:
        k_rows, v_rows = (cache_rows(x, layout == "planar") for x in (k, v))
        for qk in QK:
            got = study_attention(q, k_rows, v_rows, q_pos, k_pos, planar=layout == "planar",
                                  int8_qk=qk == "int8", block_m=32, n_splits=2)  # fmt: skip
            err = ((got - want).norm() / want.norm()).item()
            rows.append({"layout": layout, "qk": qk, "relative_error": err})
    return rows


def random_cache(n_cells: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q8_0 heads [S, Hkv, D] as (float values, GGUF-block rows, planar rows), made on the device."""
    quants = torch.randint(-127, 128, (n_cells, N_HEAD_KV, HEAD_DIM // 32, 32), device=device, dtype=torch.int8)
    scales = (torch.rand(n_cells, N_HEAD_KV, HEAD_DIM // 32, 1, device=device) * 0.02 + 0.005).half()
    values = (quants.float() * scales.float()).flatten(2)
    blocks = torch.cat([scales.view(torch.uint8), quants.view(torch.uint8)], dim=3)
    return values, blocks.reshape(n_cells, -1), planar_rows(blocks)


# What --time measures beside the server's kernel, likeliest first (a budget may cut the list): (layout, QK, V's
# conversion, (rows, warps, keys a tile)). 16 rows: a decode's 6; 32: a verification's 18 in one pass.
TIMED = (
    ("planar", "int8", "packed", (16, 2, 16)),
    ("planar", "int8", "packed", (16, 4, 32)),
    ("blocks", "int8", "packed", (16, 2, 16)),
    ("planar", "int8", "compiler", (16, 2, 16)),
    ("blocks", "fp16", "compiler", (16, 4, 32)),
    ("planar", "int8", "packed", (32, 4, 32)),
    ("blocks", "int8", "packed", (32, 4, 32)),
)


def time_rows(depths: tuple[int, ...], budget_s: float, device: str = "cuda") -> list[dict]:
    """The server's kernel and TIMED's prototypes at each depth, for a decode (1 token) then a verification (3):
    microseconds a call (triton.testing.do_bench, L2 flushed; on the CPU one call, the interpreter's wiring only),
    the cache's GB/s, and the error against float32 attention of the same cache. No call begins after budget_s."""
    from gguf.constants import GGMLQuantizationType

    from mtpserve.kernels.triton.attention import decode_attention

    out, began = [], time.perf_counter()
    for n_tok in (1, 3):
        for depth in depths:
            values, blocks, planar = random_cache(depth, device)
            k_pos = torch.arange(depth, device=device)
            gb = 2 * blocks.numel() / 1e9  # K and V
            q = torch.randn(n_tok, N_HEAD, HEAD_DIM, device=device)
            q_pos = torch.arange(n_tok, device=device) + depth - n_tok
            want = reference_values(q, values, values, q_pos, k_pos)
            server = functools.partial(decode_attention, q, blocks, blocks, GGMLQuantizationType.Q8_0,
                                       GGMLQuantizationType.Q8_0, q_pos, k_pos, n_kv_heads=N_HEAD_KV,
                                       head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5, ordered=True)  # fmt: skip
            server_planar = functools.partial(decode_attention, q, planar, planar, GGMLQuantizationType.Q8_0,
                                              GGMLQuantizationType.Q8_0, q_pos, k_pos, n_kv_heads=N_HEAD_KV,
                                              head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5, ordered=True,
                                              planar=True)  # fmt: skip
            calls = [
                ("server kernel (blocks)", server, server),
                ("server kernel (planar)", server_planar, server_planar),
            ]
            for layout, qk, cvt, (block_m, warps, block_s) in TIMED:
                if block_m < n_tok * N_HEAD // N_HEAD_KV or (cvt == "packed" and device == "cpu"):
                    continue  # too few rows; PTX the interpreter cannot run
                kw = dict(
                    planar=layout == "planar",
                    int8_qk=qk == "int8",
                    block_m=block_m,
                    num_warps=warps,
                    block_s=block_s,
                    packed_cvt=cvt == "packed",
                    n_splits=max(1, min(256, depth // 256)),
                )
                rows = planar if layout == "planar" else blocks
                call = functools.partial(study_attention, q, rows, rows, q_pos, k_pos, **kw)
                label = f"{layout} {qk} {cvt} rows={block_m} warps={warps} keys={block_s}"
                calls.append((label, call, functools.partial(call, partials_only=True)))
            for label, call, timed in calls:
                row = {"depth": depth, "tokens": n_tok, "kernel": label}
                if time.perf_counter() - began > budget_s:
                    out.append({**row, "skipped": "budget"})
                    continue
                try:
                    got = call()
                    row["relative_error"] = ((got - want).norm() / want.norm()).item()
                    if device == "cpu":
                        t0 = time.perf_counter()
                        timed()
                        row["us"] = (time.perf_counter() - t0) * 1e6
                    else:
                        row["us"] = triton.testing.do_bench(timed) * 1e3
                    row["gb_s"] = gb / (row["us"] * 1e-6)
                except Exception as e:  # noqa: BLE001 - a failing kernel is a row of the report
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def reference_values(q, k, v, q_pos, k_pos) -> torch.Tensor:  # noqa: ANN001
    """float32 attention of q [T, H, D] over k, v [S, Hkv, D] as given."""
    G = q.shape[1] // N_HEAD_KV
    scores = torch.einsum("thd,shd->ths", q.float(), k.repeat_interleave(G, 1)) * HEAD_DIM**-0.5
    seen = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    weights = torch.softmax(scores.masked_fill(~seen[:, None, :], -float("inf")), dim=-1)
    return torch.einsum("ths,shd->thd", weights, v.repeat_interleave(G, 1))


def static_rows() -> list[dict]:
    """Each (layout, QK, shape) compiled for sm_90: registers, spills, the key loop's SASS and its issue bound."""
    import gpu_static

    from tests.support import gpu_compile

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
    launches, labels = [], []
    for layout in LAYOUTS:
        for qk in QK:
            for (block_m, warps, block_s), cvt in itertools.product(SHAPES, CONVERSIONS):
                q = torch.empty(N_HEAD_KV, block_m, HEAD_DIM, dtype=torch.int8 if qk == "int8" else torch.float16)
                cache = torch.empty(64, N_HEAD_KV * ROW, dtype=torch.uint8)
                args = (q, torch.empty(N_HEAD_KV, block_m, 8), cache, cache, torch.empty(block_m, dtype=torch.int32),
                        torch.empty(64, dtype=torch.int32), torch.empty(N_HEAD_KV, block_m, HEAD_DIM),
                        torch.empty(N_HEAD_KV, block_m, 2), 4096, 6, 1024)  # fmt: skip
                kwargs = dict(CELL=N_HEAD_KV * ROW, BLOCK_M=block_m, BLOCK_S=block_s, D=HEAD_DIM,
                              PLANAR=layout == "planar", INT8_QK=qk == "int8", PACKED_CVT=cvt == "packed",
                              num_warps=warps)  # fmt: skip
                launches.append(gpu_compile.Launch("attn_study", "", _study_kernel, args, kwargs,
                                                   bytes_per_iteration=block_s * 2 * ROW, decode=True))  # fmt: skip
                labels.append({"layout": layout, "qk": qk, "v_conversion": cvt, "rows": block_m, "warps": warps,
                               "keys_a_tile": block_s})  # fmt: skip
    gpu_compile._LAUNCHES[:] = launches
    out = []
    for i, label in enumerate(labels):
        row = gpu_static.analyse((i, 90))
        out.append({**label, **{k: row[k] for k in ("registers", "spill_bytes", "sass_instructions_per_iteration",
                                                    "issue_bound_tbps", "note")}})  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--check", action="store_true", help="run the prototypes under the interpreter instead")
    parser.add_argument("--time", help="on a CUDA device: time the prototypes at these depths (e.g. 4096,65536)")
    parser.add_argument("--budget-s", type=float, default=90.0, help="--time begins no call after this many seconds")
    parser.add_argument("--device", default="cuda", help="--time's device (cpu: the interpreter's wiring, tests)")
    args = parser.parse_args(argv)
    if args.time:
        depths = tuple(int(d) for d in args.time.split(","))
        name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        result = {"device": name, "time": time_rows(depths, args.budget_s, args.device)}
        bad = [r for r in result["time"] if "error" in r or r.get("relative_error", 0.0) > 2e-2]
    elif args.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--check runs under the Triton interpreter: set TRITON_INTERPRET=1")
        result = {"check": check()}
        for row in result["check"]:
            print(f"{row['layout']:>6} {row['qk']:>4}: relative error {row['relative_error']:.2e}")
        bad = [r for r in result["check"] if not r["relative_error"] < 2e-2]
    else:
        result = {"sm_90": static_rows(), "goal_tbps": 7.2}
        bad = [r for r in result["sm_90"] if r["issue_bound_tbps"] is None]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
