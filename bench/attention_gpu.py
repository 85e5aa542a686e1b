"""Decode attention's choices measured on a lent GPU: `python bench/attention_gpu.py [--json FILE]`.

The first H200 run (2026-12-04, docs/gpu-decode.md) found decode attention at 2-4% of HBM where the static model
put it at 22% (1.08 TB/s): 193 us a layer at 4,096 tokens, 1.6 ms at 65,536, the same ~190 us for every program
whatever its keys held, i.e. each program's 16 tiles of 16 keys bound by latency, one 8-warp program an SM (210
registers a thread). Only a GPU can say which choice cures it, so this script measures them all in one call at the
27B's shapes (24 query heads over 4 KV heads, D = 256, a q8_0 cache of 262,144 cells filled to each depth, in
order): the kernel's operands (float32 FMAs, tf32, fp16 or bf16 tensor cores), keys a tile, warps, whether a
tile's loads go out together (one memory latency a tile rather than five in a row), the fewest keys a split
takes (at 4,096 tokens the default's 256 leaves 16 splits x 4 heads = 64 programs for 132 SMs), and the query
rows a program holds (a verification's 18 in one 32-row block: one pass over the cache, not two).

Each row: microseconds a call (triton.testing.do_bench, L2 flushed between calls), the cache bytes it must read
over that time (GB/s), and its error against the float32 FMA kernel (relative, whole output). One compile per
(choice, rows), choice after choice at every depth; `--budget-s S` begins no choice after S seconds
(bench/gpu_check.sh's bench stage runs it after the decode numbers with 100: the GEMVs' calibration comes next).
`--device cpu --tiny` runs its wiring under the Triton interpreter (tests/bench/test_attention_gpu.py), the bf16
choices left out there (the interpreter multiplies bf16 as raw bits), each call timed once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from mtpserve.kernels.triton.attention import decode_attention  # noqa: E402
from mtpserve.quant.planar import to_planar  # noqa: E402

N_HEAD, N_HEAD_KV, HEAD_DIM, CELLS = 24, 4, 256, 262144  # Qwen3.6-27B's attention, the deployment's context
# (name, precision, keys a tile, warps, fewest keys a split, loads first, query rows a program or None): the float
# kernel over GGUF blocks first (the first H200 run's), the reference of the errors. "lf": a tile's loads issued
# together (decode_attention's loads_first); "m32": a verification's 18 query rows in one 32-row block, one pass over
# the cache where the float kernel's default makes two (measured at 3 rows only; the tensor-core operands: float32
# FMAs spill there). None: decode_attention's default. Precision None ("int8 ..."): the server's kernel since
# 2026-12-05, the int8 one over the cache laid out planar as the GPU path stores it (attention_int8), at the
# default's 256 fewest keys a split and at fewer (more programs: the first run's latency), for every step (a
# verification's default on sm_80+ is mma16 since 4cb1c59); "mma ...": the same arithmetic as sm_75 runs it
# (attention_mma); "mma16": attention_mma16 (fp16 products), for every step.
VARIANTS = (
    ("float", "ieee", 16, None, 256, False, None),
    ("int8", None, None, None, 256, False, None),
    ("int8 min64", None, None, None, 64, False, None),
    ("int8 min32", None, None, None, 32, False, None),
    # sm_75's int8 kernel (attention_mma: mma.sync written lane by lane), run on this GPU: its issue bound on sm_90
    # (11.4 TB/s for decode) passes tl.dot's (7.4), its verification's 4 warps re-read each tile (2.9 against 4.8)
    ("mma", None, None, None, 256, False, None),
    ("mma min64", None, None, None, 64, False, None),
    # attention_mma16: fp16 products on m16n8k16, K and V converted once a key for every row, the head dims split
    # between 2 warps; sm_90 issue bounds 10.29 TB/s decode (2.14x), 7.57 a verification in one pass (1.58x)
    ("mma16", None, None, None, 256, False, None),
    # the float kernel's default until 2026-12-05: a decode step's 6 rows in a 16-row block of 8 warps (now 8 rows)
    ("ieee m16 w8", "ieee", 16, 8, 256, False, 16),
    # the hypotheses about the first run's latency first (a budget spent cuts the last choices): more programs (one
    # 16-key tile a program where the depth allows: 1,024 at 4,096 tokens where the default has 64), more programs
    # an SM (2 warps, 249 registers a thread: 4 an SM where the default fits 1), both, one latency a tile
    ("ieee min16", "ieee", 16, 8, 16, False, None),
    ("fp16 s16 w2", "fp16", 16, 2, 64, False, None),
    ("fp16 s16 w2 min16", "fp16", 16, 2, 16, False, None),
    ("ieee lf", "ieee", 16, 8, 256, True, None),
    ("ieee min16 lf", "ieee", 16, 8, 16, True, None),
    ("fp16 m32 w8", "fp16", 16, 8, 64, False, 32),
    ("ieee min64", "ieee", 16, 8, 64, False, None),
    ("fp16 s16 w8", "fp16", 16, 8, 64, False, None),  # 160 registers a thread on sm_90 (Triton 3.9): the fewest
    ("bf16 s16 w2", "bf16", 16, 2, 64, False, None),
    ("tf32 s16 w4", "tf32", 16, 4, 64, False, None),
    ("fp16 s16 w4 lf", "fp16", 16, 4, 64, True, None),
    ("tf32 m32 w8", "tf32", 16, 8, 64, False, 32),
    ("bf16 m32 w8", "bf16", 16, 8, 64, False, 32),
    ("ieee min64 lf", "ieee", 16, 8, 64, True, None),
    ("tf32 s16 w4 lf", "tf32", 16, 4, 64, True, None),
    ("tf32 s32 w4", "tf32", 32, 4, 64, False, None),
    ("fp16 s32 w4", "fp16", 32, 4, 64, False, None),
    ("bf16 s32 w4", "bf16", 32, 4, 64, False, None),
    ("bf16 s64 w8", "bf16", 64, 8, 64, False, None),
)


# decode_attention's keywords, in the order of VARIANTS' columns after the name
CHOICE_KEYWORDS = ("precision", "block_s", "num_warps", "min_keys", "loads_first", "block_m")


def choice_kwargs(name: str) -> dict:
    """decode_attention's keywords for the choice called `name` (bench/gpu.py --attention-choices times it in the
    captured decode step, through ops.attention.DECODE_ATTENTION_CHOICE)."""
    for n, *values in VARIANTS:
        if n == name:
            # "int8 ...": tl.dot's int8 kernel for every step (a verification's default is mma16 on sm_80+)
            first = n.split()[0]
            kernel = {"int8_kernel": {"int8": "dot"}.get(first, first)} if first in ("int8", "mma", "mma16") else {}
            return dict(zip(CHOICE_KEYWORDS, values, strict=True)) | kernel
    raise ValueError(f"no attention choice {name!r} (choices: {', '.join(v[0] for v in VARIANTS)})")


def q8_0_cache(cells: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A q8_0 cache of random blocks: f16 scales ~1e-2 and random int8 quants, [cells, Hkv * D / 32 * 34] bytes."""
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    shape = (cells, N_HEAD_KV * HEAD_DIM // 32)
    raw = torch.randint(-127, 128, (*shape, size), generator=gen, dtype=torch.int8, device=device).view(torch.uint8)
    scale = (torch.rand(shape, generator=gen, device=device) * 1e-2 + 5e-3).half()
    raw[..., :2] = scale.view(torch.uint8).reshape(cells, -1, 2)
    return raw.reshape(cells, -1)


def microseconds(call: Callable[[], object], device: torch.device) -> float:
    """A call's time: do_bench's (L2 flushed between calls) on CUDA, one timed call elsewhere (the interpreter)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(call, warmup=10, rep=40)) * 1e3
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def measure(
    depths: list[int], rows: list[int], device: torch.device, cells: int = CELLS, budget_s: float | None = None
) -> tuple[list[dict], list[str]]:
    """(rows measured, choices left unmeasured). Choice after choice, each at every depth and row count, so a budget
    spent leaves whole choices out (the last ones) rather than a depth; the first always runs (the reference)."""
    gen = torch.Generator(device=device).manual_seed(0)  # the caches made where they are read: no host copy
    k_cache, v_cache = q8_0_cache(cells, gen, device), q8_0_cache(cells, gen, device)
    planar = tuple(to_planar(c, N_HEAD_KV) for c in (k_cache, v_cache))  # the same values as the GPU path lays them
    head_bytes = k_cache.shape[1] // N_HEAD_KV
    q8 = int(GGMLQuantizationType.Q8_0)
    cases = []  # (depth, T, q, q_pos, k_pos): the same queries for every choice
    for depth in depths:
        k_pos = torch.full((cells,), -1, dtype=torch.int64, device=device)
        k_pos[:depth] = torch.arange(depth, device=device)
        for T in rows:
            q = torch.randn(T, N_HEAD, HEAD_DIM, generator=gen, device=device)
            cases.append((depth, T, q, torch.arange(depth - T, depth, device=device), k_pos))
    references: dict[tuple[int, int], torch.Tensor] = {}
    out, unmeasured = [], []
    start = time.monotonic()
    for i, (name, precision, *_, block_m) in enumerate(VARIANTS):
        if i and budget_s is not None and time.monotonic() - start > budget_s:
            unmeasured.append(name)
            continue
        for depth, T, q, q_pos, k_pos in cases:
            if precision == "bf16" and device.type != "cuda" or (block_m or 0) > 16 and T == 1:
                continue
            caches, layout = (planar, {"planar": True}) if precision is None else ((k_cache, v_cache), {})
            call = partial(
                decode_attention, q, *caches, q8, q8, q_pos, k_pos, n_kv_heads=N_HEAD_KV,
                head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5, ordered=True, **choice_kwargs(name), **layout,
            )  # fmt: skip
            nbytes = 2 * depth * N_HEAD_KV * head_bytes  # K and V of every filled cell, once
            row = {"variant": name, "depth": depth, "rows": T}
            try:
                got = call()
                reference = references.setdefault((depth, T), got)
                row["error"] = float((got - reference).norm() / reference.norm())
                row["us"] = microseconds(call, device)
                row["gb_per_s"] = nbytes / row["us"] / 1e3
            except Exception as e:  # noqa: BLE001 -- a choice that fails to compile or run leaves the others measured
                row["failed"] = f"{type(e).__name__}: {e}"[:300]
            out.append(row)
            shown = row.get("failed") or f"{row['us']:9.1f} us {row['gb_per_s']:8.0f} GB/s  error {row['error']:.1e}"
            print(f"depth {depth:>6} rows {T}  {name:<18} {shown}", flush=True)
    if unmeasured:
        print(f"budget of {budget_s:g} s spent: {len(unmeasured)} choices unmeasured ({', '.join(unmeasured)})")
    return out, unmeasured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="4096,65536", help="filled cells, comma-separated")
    p.add_argument("--rows", default="1,3", help="query tokens (1: decode; 3: draft-mtp n_max 2's verification)")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 256-cell cache at depth 64 (the wiring, any device)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="no further choice once this many seconds are spent (the GPU "
        "check's stage has the GEMV calibration after this); the first choice always runs",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attention_gpu: no CUDA device", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"attention_gpu: {name}, q8_0 K/V, H={N_HEAD} Hkv={N_HEAD_KV} D={HEAD_DIM}")
    depths = [64] if args.tiny else [int(d) for d in args.depths.split(",")]
    rows, unmeasured = measure(
        depths,
        [int(t) for t in args.rows.split(",")],
        device,
        cells=256 if args.tiny else CELLS,
        budget_s=args.budget_s,
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows, "unmeasured": unmeasured}, indent=1))
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
