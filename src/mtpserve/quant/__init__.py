"""Quantized weights: GGML type geometry and dequantization to torch tensors."""

from .dequant import SUPPORTED_TYPES, UnsupportedQuantType, dequantize, dequantize_tensor
from .types import CACHE_TYPES, GGMLType, parse_cache_type

__all__ = [
    "CACHE_TYPES",
    "GGMLType",
    "SUPPORTED_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "dequantize_tensor",
    "parse_cache_type",
]
