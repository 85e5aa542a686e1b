"""`mtpserve quantize IN.gguf OUT.gguf TYPE`: llama-quantize for Q8_0, Q6_K and Q4_K_M.

Types and mix: llama-quantize's, tensor by tensor (../shared/spec/gguf-quant-formats.md §6; the rules are in
`mtpserve.quant.mix`), and the quantizers are ggml's reference ones (no importance matrix), so each tensor's
bytes equal llama-quantize's; with `--llama-order` the whole file does (tensors in llama.cpp's order instead
of the input's). TYPE is case-insensitive and may also be the llama_ftype number (7, 18, 15).

Input: a float model (F32/F16/BF16 tensors). A tensor that is already block-quantized and would change type
is refused, as llama-quantize refuses without --allow-requantize; with `--allow-requantize` it is
dequantized to float32 and quantized again (two roundings: quality is worse than quantizing the original).
Tensors that keep their stored type (norms, 1-D tensors, anything already in its target type) are copied.
The output is written under OUT.part and renamed when complete.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from pathlib import Path

from ..quant.mix import FILE_TYPES
from ..quant.writer import quantize_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="quantize a float GGUF model (Q8_0, Q6_K, Q4_K_M), like llama-quantize")
    p.add_argument("input", type=Path, help="GGUF model with float (F32/F16/BF16) weights")
    p.add_argument("output", type=Path, help="GGUF file to write")
    p.add_argument("type", help=f"file type: {', '.join(FILE_TYPES)} (or its llama_ftype number)")
    p.add_argument("--allow-requantize", action="store_true", help="dequantize and requantize quantized tensors")
    p.add_argument("--llama-order", action="store_true", help="tensors in llama-quantize's order, not the input's")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="torch device for the quantizers, e.g. cuda (default cpu)")
    p.set_defaults(func=run)


def parse_file_type(text: str) -> str:
    by_number = {str(ft.ftype): name for name, ft in FILE_TYPES.items()}
    name = by_number.get(text.strip(), text.strip().upper())
    if name not in FILE_TYPES:
        raise ValueError(f"unsupported quantization type '{text}'; choose one of: {', '.join(FILE_TYPES)}")
    return name


def run(args: argparse.Namespace) -> int:
    file_type = parse_file_type(args.type)
    logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # its "Little Endian only" notice
    result = quantize_model(
        args.input,
        args.output,
        file_type,
        allow_requantize=args.allow_requantize,
        threads=args.threads,
        device=args.device,
        llama_order=args.llama_order,
    )
    counts = Counter(t.name for t in result.types.values())
    mib = 1024 * 1024
    print(
        f"{result.path}: {file_type}, {len(result.types)} tensors ("
        + ", ".join(f"{n} {name}" for name, n in counts.most_common())
        + f"), {result.input_bytes / mib:.2f} MiB -> {result.output_bytes / mib:.2f} MiB",
        file=sys.stderr,
    )
    if result.fallbacks:
        print(
            f"{len(result.fallbacks)} tensor(s) took a fallback type (row length not a multiple of the block size): "
            + ", ".join(f"{n} {result.types[n].name}" for n in result.fallbacks),
            file=sys.stderr,
        )
    for key in result.skipped_keys:
        print(f"warning: metadata key '{key}' was not copied (empty or nested array)", file=sys.stderr)
    return 0
