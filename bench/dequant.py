"""Dequantization throughput, in GB/s of GGUF data read, for mtpserve's torch dequantizers side by side
with gguf-py's numpy reference (llama.cpp's own Python package) in the same run.

    .venv/bin/python bench/dequant.py [--mib 64] [--repeats 5] [--threads 2] [--json out.json]

Inputs are real blocks taken from the project's models (the tinyqwen35 Q4_K_M / Q6_K / Q8_0 fixtures in
../shared, or the cached Gemma 3 270M), tiled to `--mib` MiB so that timings are not cache-resident.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from mtpserve.default_models import GEMMA3, model_path
from mtpserve.gguf import open_gguf
from mtpserve.quant import dequantize

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO.parent / "shared" / "fixtures" / f"tinyqwen35-mtp-{q}.gguf" for q in ("Q4_K_M", "Q6_K", "Q8_0")]
TYPES = (T.Q4_K, T.Q6_K, T.Q8_0)


def real_blocks(ggml_type: T) -> np.ndarray:
    """All blocks of `ggml_type` found in the source models, as uint8 [n_blocks, bytes_per_block]."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    found = []
    for path in [*SOURCES, model_path(GEMMA3)]:
        if path.exists():
            for t in open_gguf(path).tensors.values():
                if t.ggml_type == ggml_type:
                    found.append(np.asarray(t.raw()).reshape(-1, type_size))
    if not found:
        sys.exit(f"no {ggml_type.name} tensors found in {[str(p) for p in SOURCES]}; run `make models`")
    return np.concatenate(found)


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB of GGUF data per type")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    print(f"dequantize {args.mib} MiB of real blocks per type, best of {args.repeats}, torch threads {args.threads}")
    print(f"{'type':6s} {'mtpserve GB/s':>14s} {'gguf-py GB/s':>13s} {'ratio':>7s}")
    for ggml_type in TYPES:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        blocks = real_blocks(ggml_type)
        n_blocks = args.mib * 2**20 // type_size
        data = np.ascontiguousarray(np.resize(blocks, (n_blocks, type_size)))
        shape = (n_blocks, block_size)
        ours = best_seconds(lambda d=data, t=ggml_type, s=shape: dequantize(d, t, s), args.repeats)
        ref = best_seconds(lambda d=data, t=ggml_type: quants.dequantize(d, t), max(1, args.repeats // 2))
        row = {
            "type": ggml_type.name,
            "bytes": data.nbytes,
            "mtpserve_gb_per_s": data.nbytes / ours / 1e9,
            "gguf_py_gb_per_s": data.nbytes / ref / 1e9,
        }
        row["ratio"] = row["mtpserve_gb_per_s"] / row["gguf_py_gb_per_s"]
        rows.append(row)
        print(f"{row['type']:6s} {row['mtpserve_gb_per_s']:14.2f} {row['gguf_py_gb_per_s']:13.2f} {row['ratio']:6.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "mib": args.mib, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
