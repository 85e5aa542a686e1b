"""A small model cut from a real GGUF file: its first layers and part of its vocabulary, every kept tensor copied
as stored (same types, same bytes). For the GPU check of a model whose file is too big to travel to the lent
GPU machine (bench/gpu_check.sh carries 64 MiB): Gemma 3 270M's 250 MB become about 33 MB, and the GPU path is
held to the CPU path on the slice, which exercises the same kernels on the same quantized blocks.

    python -m tests.support.gguf_slice SRC DST [--ref REFERENCE.json] [--layers 6] [--tokens 16384]

What a slice keeps: blocks 0..layers-1; the token rows of `token_ids` (the embedding, and an untied output
matrix: its rows are the logits), renumbered 0..len-1 in their order; the tokenizer's arrays cut alike; every
other metadata key as it was, except the block count. The kept original ids are stored as
`mtpserve.slice.token_ids`, so that a prompt's ids can be mapped without the original file. A slice is a model
for comparing two paths of one engine, not a language model: its later layers are gone.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from mtpserve.gguf import open_gguf
from mtpserve.quant.writer import write_metadata

SLICE_IDS_KEY = "mtpserve.slice.token_ids"
TOKEN_ROW_TENSORS = ("token_embd.weight", "output.weight")  # one row per token
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def slice_gguf(src: str | Path, dst: str | Path, *, n_layers: int, token_ids: Iterable[int]) -> list[int]:
    """Write the slice of `src` to `dst`; returns the kept original token ids (sorted: new id = index)."""
    model = open_gguf(src)
    arch = model.architecture
    kept = sorted(set(token_ids))
    n_vocab = len(model.metadata["tokenizer.ggml.tokens"])
    if not kept or kept[0] < 0 or kept[-1] >= n_vocab:
        raise ValueError(f"token ids must lie in 0..{n_vocab - 1}")
    if not 0 < n_layers <= model.metadata[f"{arch}.block_count"]:
        raise ValueError(f"n_layers must be 1..{model.metadata[f'{arch}.block_count']}")
    for key in ("bos", "eos", "unknown", "padding"):  # special ids must keep their meaning
        special = model.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if special is not None and (special >= len(kept) or kept[special] != special):
            raise ValueError(f"the {key} token ({special}) must keep its id: keep ids 0..{special} too")

    values, types = dict(model.metadata), dict(model.metadata_types)
    values[f"{arch}.block_count"] = n_layers
    for key in _TOKEN_ARRAYS:
        if key in values:
            column = values[key]
            values[key] = [column[i] for i in kept] if isinstance(column, list) else column[kept]
    values[SLICE_IDS_KEY] = np.asarray(kept, dtype=np.int32)
    types[SLICE_IDS_KEY] = GGUFValueType.ARRAY

    writer = GGUFWriter(Path(dst), arch)
    write_metadata(writer, values, types)
    for name, tensor in model.tensors.items():
        block = _BLOCK.match(name)
        if block and int(block.group(1)) >= n_layers:
            continue
        data = tensor.numpy()
        if name in TOKEN_ROW_TENSORS:
            data = np.ascontiguousarray(data[kept])
        if data.dtype == np.uint8:  # quantized rows [.., bytes a row]: gguf-py derives the shape from the type
            writer.add_tensor(name, data, raw_dtype=tensor.ggml_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kept


def slice_token_ids(path: str | Path) -> list[int]:
    """The original ids of a slice's tokens (new id = index)."""
    return [int(i) for i in open_gguf(path).metadata[SLICE_IDS_KEY]]


def slice_with_prompts(
    src: str | Path, dst: str | Path, ref: str | Path | None = None, *, n_layers: int = 6, n_tokens: int = 16384
) -> list[int]:
    """The slice the GPU check uses: the first `n_layers` blocks, ids 0..n_tokens-1, and every prompt id of a
    llama.cpp reference JSON of ../shared/fixtures/refs (so its prompts map into the slice)."""
    prompts = []
    if ref is not None:
        completions = json.loads(Path(ref).read_text())["greedy"]["completions"]
        prompts = [i for c in completions for i in c["prompt_token_ids"]]
    return slice_gguf(src, dst, n_layers=n_layers, token_ids=[*range(n_tokens), *prompts])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--ref", default=None, help="a reference JSON whose prompts' ids are kept too")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16384, help="keep ids 0..N-1")
    args = p.parse_args(argv)
    kept = slice_with_prompts(args.src, args.dst, args.ref, n_layers=args.layers, n_tokens=args.tokens)
    print(f"{args.dst}: {args.layers} layers, {len(kept)} tokens, {Path(args.dst).stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
