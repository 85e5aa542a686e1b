"""Write a quantized copy of a GGUF model: `mtpserve quantize`'s engine.

The output has every metadata key of the input in the same order with the same value types (split-file
keys dropped; `general.quantization_version` = 2 and `general.file_type` set and moved to the end, as
llama-quantize does) and the tensors in the input's order (or llama-quantize's), each converted to the
type `mix.plan_types` picks with the quantizers of `quantize.py` (byte-identical to llama.cpp's reference
quantizers). The container is written with gguf-py's `GGUFWriter`; tensor data is produced one tensor at a
time, in row chunks, so memory stays at about one output tensor.

Requantizing (a tensor already in a block type that the mix wants in another type) is refused unless
`allow_requantize` is set, as llama-quantize refuses without --allow-requantize: the tensor is then
dequantized to float32 first, which compounds two roundings. Tensors whose stored type is already the
target are copied unchanged.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFValueType, GGUFWriter
from tqdm import tqdm

from ..gguf import GGUFError, GGUFFile, TensorInfo, open_gguf
from .dequant import dequantize
from .mix import FILE_TYPES, FLOAT_TYPES, ModelFacts, plan_types
from .mix import llama_order as order_like_llama
from .quantize import WEIGHT_QUANTIZERS
from .types import GGMLType, tensor_bytes

log = logging.getLogger(__name__)

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
ROW_CHUNK_ELEMENTS = 1 << 24  # values dequantized + quantized per step on a GPU (64 MiB of float32)
PARALLEL_CHUNK_ELEMENTS = 1 << 20  # per step and CPU thread
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_ARRAY_TYPES = {
    np.dtype("uint8"): GGUFValueType.UINT8,
    np.dtype("int8"): GGUFValueType.INT8,
    np.dtype("<u2"): GGUFValueType.UINT16,
    np.dtype("<i2"): GGUFValueType.INT16,
    np.dtype("<u4"): GGUFValueType.UINT32,
    np.dtype("<i4"): GGUFValueType.INT32,
    np.dtype("<f4"): GGUFValueType.FLOAT32,
    np.dtype("<u8"): GGUFValueType.UINT64,
    np.dtype("<i8"): GGUFValueType.INT64,
    np.dtype("<f8"): GGUFValueType.FLOAT64,
    np.dtype("bool"): GGUFValueType.BOOL,
}


@dataclass
class QuantizeResult:
    """What was written: per-tensor types (input order), sizes, and metadata keys that could not be copied."""

    path: Path
    file_type: str
    types: dict[str, GGMLType]
    input_bytes: int
    output_bytes: int
    fallbacks: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)


def _encode(value: Any, vtype: GGUFValueType) -> Any:
    # Strings go in as bytes: the reader keeps invalid UTF-8 (some token texts) as surrogate escapes.
    return value.encode("utf-8", "surrogateescape") if vtype == GGUFValueType.STRING else value


def _copy_metadata(writer: GGUFWriter, src: GGUFFile, ftype: int) -> list[str]:
    """Every key of `src` in order, with llama-quantize's two quantization keys; returns the keys skipped."""
    values = dict(src.metadata)
    # llama-quantize sets these two with gguf_set_val_u32, which drops an existing key and appends it.
    values.pop("general.quantization_version", None)
    values.pop("general.file_type", None)
    values["general.quantization_version"] = QUANTIZATION_VERSION
    values["general.file_type"] = ftype
    types = dict(src.metadata_types)
    types["general.file_type"] = types["general.quantization_version"] = GGUFValueType.UINT32
    return write_metadata(writer, values, types)


def write_metadata(writer: GGUFWriter, values: dict[str, Any], types: dict[str, GGUFValueType]) -> list[str]:
    """Write `values` (as `GGUFFile.metadata` holds them, typed by `types`) in order, in place of GGUFWriter's
    own general.architecture; returns keys skipped because GGUFWriter cannot write them (empty or nested
    arrays). Split-file keys are dropped."""
    writer.kv_data[0].clear()
    skipped = []
    for key, value in values.items():
        if key in _SPLIT_KEYS:
            continue
        vtype = types[key]
        if key == "general.alignment":
            writer.data_alignment = int(value)
        if vtype != GGUFValueType.ARRAY:
            writer.add_key_value(key, _encode(value, vtype), vtype)
        elif isinstance(value, np.ndarray) and len(value):
            writer.add_key_value(key, value.tolist(), vtype, sub_type=_ARRAY_TYPES[value.dtype])
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            writer.add_key_value(key, [_encode(v, GGUFValueType.STRING) for v in value], vtype, GGUFValueType.STRING)
        else:
            log.warning("metadata key '%s' (an empty or nested array) is not copied: GGUFWriter cannot write it", key)
            skipped.append(key)
    return skipped


def _convert(tensor: TensorInfo, target: GGMLType, threads: int, device: torch.device) -> np.ndarray:
    """The tensor's bytes in `target`, as a flat uint8 array, converted in chunks of whole rows (on CPU, by
    `threads` workers: the quantizers are long chains of small vector ops, which scale better one chunk per
    thread than split across threads op by op)."""
    raw = tensor.raw()
    if tensor.ggml_type == target:
        return raw
    ne0 = tensor.ne[0]
    rows = tensor.n_elements // ne0
    in_row, out_row = tensor_bytes(tensor.ggml_type, ne0), tensor_bytes(target, ne0)
    out = np.empty(rows * out_row, dtype=np.uint8)
    out_rows = torch.from_numpy(out).view(rows, out_row)
    quantize = WEIGHT_QUANTIZERS[target]
    chunk = ROW_CHUNK_ELEMENTS if device.type != "cpu" else PARALLEL_CHUNK_ELEMENTS
    step = max(1, chunk // ne0)

    def work(r: int) -> None:
        n = min(step, rows - r)
        values = dequantize(raw[r * in_row : (r + n) * in_row], tensor.ggml_type, (n, ne0), name=tensor.name)
        out_rows[r : r + n] = quantize(values.to(device)).cpu()

    starts = range(0, rows, step)
    if device.type == "cpu" and threads > 1 and len(starts) > 1:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            list(pool.map(work, starts))
    else:
        for r in starts:
            work(r)
    return out


def quantize_model(
    src_path: str | Path,
    dst_path: str | Path,
    file_type: str,
    *,
    allow_requantize: bool = False,
    progress: bool = True,
    threads: int = 0,
    device: str | torch.device = "cpu",
    llama_order: bool = False,
) -> QuantizeResult:
    """Write `dst_path`: the model of `src_path` quantized as `file_type` (a key of `mix.FILE_TYPES`).

    The file is written next to `dst_path` under a temporary name and renamed at the end, so a failure
    leaves no partial output. Tensors keep the input's order, or with `llama_order` take llama-quantize's
    (by layer, then name): the file is then byte-identical to llama-quantize's for the same input and type
    (checked on the tinyqwen35 fixtures). `threads` (0: all cores) CPU workers run one row chunk each, with
    torch's own intra-op threads set to 1 meanwhile; on another `device` (e.g. "cuda") the chunks run there
    in turn. Raises ValueError (unknown file type, requantizing refused, a type that cannot be written) or
    GGUFError (unreadable input)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unsupported quantization type '{file_type}'; choose one of: {', '.join(FILE_TYPES)}")
    ft = FILE_TYPES[file_type]
    src_path, dst_path = Path(src_path), Path(dst_path)
    src = open_gguf(src_path)
    if dst_path.exists() and any(dst_path.resolve() == p.resolve() for p in src.paths):
        raise ValueError(f"output {dst_path} is the input file")
    arch = src.architecture
    if arch is None:
        raise GGUFError(src_path, "metadata key 'general.architecture' is missing: not a model file")

    facts = ModelFacts.from_metadata(src.metadata)
    fallbacks: list[str] = []
    types = plan_types({n: (t.ne, t.ggml_type) for n, t in src.tensors.items()}, ft, facts, fallbacks)
    if llama_order:
        types = {name: types[name] for name in order_like_llama(types)}
    for name, target in types.items():
        stored = src.tensors[name].ggml_type
        if target == stored:
            continue
        if stored not in FLOAT_TYPES and not allow_requantize:
            raise ValueError(
                f"tensor '{name}' is already quantized ({stored.name}); requantizing it to {target.name} compounds "
                "two roundings: start from an F16/BF16/F32 file, or pass --allow-requantize"
            )
        if target not in WEIGHT_QUANTIZERS:
            raise ValueError(f"tensor '{name}': mtpserve cannot write {target.name}")

    device = torch.device(device)
    threads = threads if threads > 0 else (os.cpu_count() or 1)
    torch_threads = torch.get_num_threads()
    tmp = dst_path.with_name(dst_path.name + ".part")
    writer = GGUFWriter(tmp, arch)
    try:
        torch.set_num_threads(1)
        skipped = _copy_metadata(writer, src, ft.ftype)
        for name, target in types.items():
            t = src.tensors[name]
            writer.add_tensor_info(
                name, t.shape, np.dtype(np.float32), tensor_bytes(target, t.n_elements), raw_dtype=target
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = tqdm(types.items(), total=len(types), unit="tensor", desc=f"quantize {file_type}", disable=not progress)
        for name, target in bar:
            bar.set_postfix_str(f"{name} -> {target.name}", refresh=False)
            writer.write_tensor_data(_convert(src.tensors[name], target, threads, device))
        writer.close()
        os.replace(tmp, dst_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        torch.set_num_threads(torch_threads)
    out_bytes = sum(tensor_bytes(types[n], t.n_elements) for n, t in src.tensors.items())
    in_bytes = sum(t.n_bytes for t in src.tensors.values())
    return QuantizeResult(dst_path, file_type, types, in_bytes, out_bytes, fallbacks, skipped)
