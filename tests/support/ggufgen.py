"""Synthetic GGUF files for tests, written with llama.cpp's own `gguf.GGUFWriter`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

# Types gguf-py can quantize from float (K-quants it can only dequantize: tests take those from fixtures).
WRITABLE_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)


def encode(values: np.ndarray, ggml_type: T) -> np.ndarray:
    """float32 [..., n] -> what GGUFWriter.add_tensor takes for `ggml_type`."""
    values = values.astype(np.float32)
    if ggml_type == T.F32:
        return values
    if ggml_type == T.F16:
        return values.astype(np.float16)
    return quants.quantize(values, ggml_type)


def write_gguf(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any] = {},
    tensors: Iterable[tuple[str, np.ndarray, T]] = (),
    *,
    split_max_tensors: int = 0,
) -> None:
    """Write a GGUF: `metadata` values typed by Python type (int -> u32, float -> f32, str, bool, lists),
    tensors given as float32 arrays in torch order and stored as the given type."""
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    for name, values, ggml_type in tensors:
        data = encode(values, ggml_type)
        w.add_tensor(name, data, raw_dtype=ggml_type if ggml_type not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_llama_metadata(n_layer: int = 2, n_vocab: int = 64) -> dict[str, Any]:
    return {
        "llama.block_count": n_layer,
        "llama.context_length": 128,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(n_vocab)],
    }


def tiny_model_tensors(specs, rng: np.random.Generator, quant: T = T.Q8_0, omit: Iterable[str] = ()):
    """Random tensors for every required `TensorSpec`: matrices as `quant`, vectors as F32."""
    omit = set(omit)
    for spec in specs:
        if not spec.required or spec.name in omit:
            continue
        values = rng.standard_normal(spec.shape).astype(np.float32)
        yield spec.name, values, (quant if len(spec.shape) == 2 and spec.shape[-1] % 32 == 0 else T.F32)


def with_metadata(src: Path, dst: Path, values: Mapping[str, int]) -> Path:
    """A copy of the GGUF `src` at `dst` with `values` added to (or replacing) its metadata as u32 keys, every tensor
    byte for byte: a real model given what its file lacks (e.g. FIM token ids)."""
    from gguf import GGUFValueType

    from mtpserve.gguf.reader import open_gguf
    from mtpserve.quant.writer import write_metadata

    g = open_gguf(src)
    metadata, types = dict(g.metadata), dict(g.metadata_types)
    for key, value in values.items():
        metadata[key], types[key] = value, GGUFValueType.UINT32
    w = GGUFWriter(dst, str(metadata["general.architecture"]))
    write_metadata(w, metadata, types)
    for name, t in g.tensors.items():
        w.add_tensor_info(name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in g.tensors.values():
        w.write_tensor_data(t.raw())
    w.close()
    return dst
