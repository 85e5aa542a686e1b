"""How fast the CPU GEMVs stream a model's weights from memory, against a `torch.sum` over the same bytes: the ceiling
a decode step (one activation row) or a draft's verification (three) can reach on this machine.

    .venv/bin/python bench/gemv_cpu.py [--model FILE] [--matrices ffn_up,ffn_gate,attn_qkv] [--rows 1,3]
                                       [--threads 1,2] [--layers 16] [--in-cache ROWS] [--sequences]

For each matrix kind, the first `--layers` layers' matrices of that name are called in turn (more bytes than any
cache holds, so each weight comes from memory, as in a decode), `ops.linear.linear` on `rows` activation rows of one
sequence; best of 3 passes, GB/s of weights by type. The default file is `bench/make_qwen35_27b.py --layers 16`'s
(the 27B's widths). The weights are the file's mapping, paged in first; their tiles are not kept (`--repack` keeps
at most 1 GiB, a small part of a 27B), so rows that take the GEMM tiles pack them on each call, as the server does.

`--in-cache ROWS`: the first ROWS rows of each kind's first matrix instead, called again and again (2048 rows of the
27B's ffn_up are 5.9 MB, in the last-level cache): the speed the kernels' instructions allow, without memory's.
`--sequences`: the rows as that many sequences of one row (continuous batching's decode) instead of one sequence.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from dequant import best_seconds  # a sibling script: bench/ is on the path when run

from mtpserve.gguf.reader import open_gguf
from mtpserve.ops.linear import linear
from mtpserve.quant.qtensor import QTensor
from mtpserve.tuning.synthetic import default_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_path(16)))
    ap.add_argument("--matrices", default="ffn_up,ffn_gate,attn_qkv,ffn_down")
    ap.add_argument("--rows", default="1,3")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--in-cache", type=int, default=0, metavar="ROWS", help="ROWS rows of one matrix, repeated")
    ap.add_argument("--sequences", action="store_true", help="each activation row its own sequence")
    args = ap.parse_args()
    tensors = {t.name: t for t in open_gguf(args.model).tensors.values()}
    by_type: dict[tuple[str, str], list[QTensor]] = defaultdict(list)
    for kind in args.matrices.split(","):
        for i in range(args.layers):
            if (t := tensors.get(f"blk.{i}.{kind}.weight")) is not None:
                q = QTensor.from_gguf(t)
                if args.in_cache:
                    q = q.select_rows([(0, min(args.in_cache, q.shape[0]))])
                q.data.view(torch.int64).sum()  # paged in
                by_type[(kind, q.ggml_type.name)].append(q)
    if args.in_cache:  # one matrix a kind and type, repeated: ~0.2 GB a pass
        by_type = {key: ws[:1] * max(1, int(2e8 // ws[0].nbytes)) for key, ws in by_type.items()}
    where = f"{args.in_cache} rows of one matrix, in cache" if args.in_cache else "from memory"
    print(f"{args.model}: GB/s of weights ({where}), best of 3 passes")
    print("| matrices | type | threads | torch.sum | " + " | ".join(f"{r} row(s)" for r in args.rows.split(",")) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(args.rows.split(",")))
    for (kind, type_name), weights in by_type.items():
        n_bytes = sum(w.nbytes for w in weights)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            summed = n_bytes / best_seconds(lambda ws=weights: [w.data.view(torch.int64).sum() for w in ws], 3) / 1e9
            speeds = []
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, weights[0].shape[1])
                seconds = best_seconds(
                    lambda ws=weights, x=x, r=rows: [linear(x, w, seq_len=1 if args.sequences else r) for w in ws], 3
                )
                speeds.append(f"{n_bytes / seconds / 1e9:.1f}")
            count = 1 if args.in_cache else len(weights)
            print(f"| {kind} x {count} | {type_name} | {threads} | {summed:.1f} | " + " | ".join(speeds) + " |")


if __name__ == "__main__":
    main()
