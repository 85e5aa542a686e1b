"""`mtpserve inspect`: what a GGUF file holds and what serving it will cost in memory."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from itertools import groupby
from pathlib import Path
from typing import Any

from gguf.constants import LlamaFileType

from ..gguf import open_gguf
from ..models import config_from_gguf, estimate_memory
from ..models.memory import kv_bytes_per_cell, weight_bytes
from ..quant import CACHE_TYPES

KIND_SYMBOLS = {
    "gated_deltanet": ("D", "Gated DeltaNet"),
    "attention": ("A", "full attention"),
    "sliding_attention": ("S", "sliding-window attention"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="show a GGUF model's layers, tensor types and memory estimate")
    p.add_argument("model_file", nargs="?", help="GGUF file (default: the embedded default model)")
    p.add_argument("-m", "--model", dest="model_opt", help="GGUF file (same as the positional argument)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size for the estimate (0 = trained)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="number of slots (sequences)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(CACHE_TYPES), help="K cache type")
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(CACHE_TYPES), help="V cache type")
    p.add_argument("--kv-unified", action="store_true", help="one KV stream shared by all slots")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..default_models import default_model_path

    path = Path(args.model_opt or args.model_file or default_model_path())
    report = inspect_model(
        path, args.ctx_size, args.parallel, args.cache_type_k, args.cache_type_v, kv_unified=args.kv_unified
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def inspect_model(
    path: Path,
    ctx_size: int = 0,
    parallel: int = 1,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    *,
    kv_unified: bool = False,
) -> dict[str, Any]:
    gguf = open_gguf(path)
    config = config_from_gguf(gguf)
    kinds = config.layer_kinds()
    mtp = config.mtp_layers()
    mtp_prefixes = tuple(f"blk.{i}." for i in mtp)

    types: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "parameters": 0})
    n_params = n_mtp_params = 0
    for t in gguf.tensors.values():
        row = types[t.type_name]
        row["tensors"] += 1
        row["bytes"] += t.n_bytes
        row["parameters"] += t.n_elements
        n_params += t.n_elements
        if mtp_prefixes and t.name.startswith(mtp_prefixes):
            n_mtp_params += t.n_elements

    total_w, mtp_w = weight_bytes(gguf, config)
    est = estimate_memory(config, total_w, mtp_w, ctx_size, parallel, cache_type_k, cache_type_v, kv_unified=kv_unified)
    layout = config.cache_layout()
    file_type = gguf.metadata.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        file_type_name = f"unknown ({file_type})"
    return {
        "file": str(gguf.path),
        "files": [str(p) for p in gguf.paths],
        "file_size": gguf.file_size,
        "gguf_version": gguf.version,
        "architecture": config.architecture,
        "name": gguf.metadata.get("general.name"),
        "file_type": file_type_name,
        "parameters": n_params,
        "mtp_parameters": n_mtp_params,
        "n_vocab": config.n_vocab,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "context_length": config.context_length,
        "layer_kinds": kinds,
        "mtp_layers": mtp,
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
        "memory": {
            "ctx_size": est.ctx_size,
            "parallel": est.parallel,
            "cache_type_k": est.cache_type_k,
            "cache_type_v": est.cache_type_v,
            "kv_unified": kv_unified,
            "kv_bytes_per_token": round(
                sum(
                    kv_bytes_per_cell(s, cache_type_k, cache_type_v)
                    for s in layout.attention
                    if s.sliding_window is None
                )
            ),
            "weights_bytes": est.weights_bytes,
            "mtp_weights_bytes": est.mtp_weights_bytes,
            "kv_bytes": est.kv_bytes,
            "mtp_kv_bytes": est.mtp_kv_bytes,
            "recurrent_bytes": est.recurrent_bytes,
            "total_bytes": est.total_bytes,
        },
    }


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 4, 5, 6] -> "0-2, 4-6"."""
    runs = [[i for _, i in group] for _, group in groupby(enumerate(indices), key=lambda p: p[1] - p[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _pattern(kinds: list[str]) -> str:
    """Layer kinds as symbols, folded when they repeat with a short period: "DDDA x 16"."""
    symbols = "".join(KIND_SYMBOLS[k][0] for k in kinds)
    for period in range(1, min(len(symbols), 12) + 1):
        if len(symbols) % period == 0 and symbols == symbols[:period] * (len(symbols) // period):
            reps = len(symbols) // period
            return symbols if reps == 1 else f"{symbols[:period]} x {reps}"
    return symbols


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def render(r: dict[str, Any]) -> str:
    kinds: list[str] = r["layer_kinds"]
    lines = [
        f"file           {r['file']}" + (f" (+{len(r['files']) - 1} split parts)" if len(r["files"]) > 1 else ""),
        f"file size      {_size(r['file_size'])} ({r['file_size']:,} bytes), GGUF v{r['gguf_version']}",
        f"architecture   {r['architecture']}" + (f"  ({r['name']})" if r["name"] else ""),
        f"file type      {r['file_type'] or 'unknown'}",
        f"parameters     {_count(r['parameters'])}"
        + (f" (MTP block: {_count(r['mtp_parameters'])})" if r["mtp_parameters"] else ""),
        f"vocab / embd   {r['n_vocab']} / {r['n_embd']}",
        f"trained ctx    {r['context_length']}",
        f"layers         {r['n_layer']}" + (f" + {len(r['mtp_layers'])} MTP" if r["mtp_layers"] else ""),
        f"layer pattern  {_pattern(kinds)}   ("
        + ", ".join(f"{sym} = {name}" for kind, (sym, name) in KIND_SYMBOLS.items() if kind in kinds)
        + ")",
    ]
    for kind, (_, name) in KIND_SYMBOLS.items():
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx:
            lines.append(f"  {name + ':':27s} {len(idx):3d} layers  {_ranges(idx)}")
    if r["mtp_layers"]:
        lines.append(f"  {'MTP (NextN) block:':27s} {len(r['mtp_layers']):3d} layer   {_ranges(r['mtp_layers'])}")
    lines.append("tensor types")
    for name, row in r["tensor_types"].items():
        lines.append(
            f"  {name:7s} {row['tensors']:5d} tensors  {_count(row['parameters']):>10s} params  "
            f"{_size(row['bytes']):>11s}"
        )
    m = r["memory"]
    lines += [
        f"memory estimate  ctx {m['ctx_size']}, parallel {m['parallel']}, "
        f"K {m['cache_type_k']}, V {m['cache_type_v']}" + (", unified KV" if m["kv_unified"] else ""),
        f"  weights          {_size(m['weights_bytes']):>11s}"
        + (f"  (MTP block {_size(m['mtp_weights_bytes'])})" if m["mtp_weights_bytes"] else ""),
        f"  KV cache         {_size(m['kv_bytes']):>11s}  "
        f"({m['kv_bytes_per_token']:,} bytes per token in full-attention layers)",
    ]
    if m["mtp_kv_bytes"]:
        lines.append(f"  MTP KV cache     {_size(m['mtp_kv_bytes']):>11s}")
    if m["recurrent_bytes"]:
        lines.append(f"  recurrent state  {_size(m['recurrent_bytes']):>11s}  (conv + SSM, float32)")
    lines.append(f"  total            {_size(m['total_bytes']):>11s}")
    return "\n".join(lines)
