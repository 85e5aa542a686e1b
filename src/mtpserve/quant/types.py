"""GGML tensor types: block geometry, and the cache types llama-server accepts for `--cache-type-k/v`."""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGMLType = GGMLQuantizationType


def block_geometry(ggml_type: GGMLType) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[ggml_type]


def bytes_per_element(ggml_type: GGMLType) -> float:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return type_size / block_size


def tensor_bytes(ggml_type: GGMLType, n_elements: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return n_elements // block_size * type_size


# llama-server's allowed KV-cache types (common/arg.cpp `kv_cache_types`), by their command-line names.
CACHE_TYPES: dict[str, GGMLType] = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0,
    "q4_0": GGMLType.Q4_0,
    "q4_1": GGMLType.Q4_1,
    "iq4_nl": GGMLType.IQ4_NL,
    "q5_0": GGMLType.Q5_0,
    "q5_1": GGMLType.Q5_1,
}


def parse_cache_type(name: str) -> GGMLType:
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported cache type '{name}'; choose one of: {', '.join(CACHE_TYPES)}") from None
