"""A GGUF file of the deployment's shape: Qwen3.6-27B (qwen35, 64 layers + the MTP block, n_embd 5120, vocab 248,320),
Q4_K_M by llama-quantize's rules, random weights (mtpserve.tuning.synthetic).

    .venv/bin/python bench/make_qwen35_27b.py [--out ~/.cache/mtpserve/synthetic/qwen35-27b-Q4_K_M.gguf]
                                              [--layers 64] [--seed 0]

The full file is 16,799,719,424 bytes (15.65 GiB, the size of the real Q4_K_M file); `--layers 4` writes the same
widths with 4 trunk layers (2.71 GiB), the file the token-parity check uses. Written tensor by tensor in 32 MiB
chunks: memory stays well under 1 GB. The same seed gives the same bytes on any machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from mtpserve.tuning.synthetic import Qwen35Shape, default_path, tensors, write

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
VOCAB = FIXTURES / "vocab" / "ggml-vocab-qwen35.gguf"
TEMPLATE = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", type=int, default=64, help="trunk layers (default 64, the 27B's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = Qwen35Shape(n_layer=args.layers)
    out = args.out or default_path(args.layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(t.nbytes for t in tensors(shape))
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=out.name, file=sys.stderr) as bar:
        size = write(out, shape, VOCAB, TEMPLATE, args.seed, lambda done, _: bar.update(done - bar.n))
    print(f"{out}: {size:,} bytes in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
