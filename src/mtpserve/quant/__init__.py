"""Quantized weights: GGML type geometry and dequantization to torch tensors.

The dequantizers load on first use (PEP 562): `.types` is read by commands that only plan (`mtpserve inspect`),
which should not wait for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .types import CACHE_TYPES, GGMLType, parse_cache_type

if TYPE_CHECKING:
    from .dequant import SUPPORTED_TYPES, UnsupportedQuantType, dequantize, dequantize_tensor

_DEQUANT = ("SUPPORTED_TYPES", "UnsupportedQuantType", "dequantize", "dequantize_tensor")

__all__ = [
    "CACHE_TYPES",
    "GGMLType",
    "SUPPORTED_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "dequantize_tensor",
    "parse_cache_type",
]


def __getattr__(name: str) -> Any:
    if name in _DEQUANT:
        from . import dequant

        return getattr(dequant, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
