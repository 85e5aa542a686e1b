"""Triton kernels (GPU; on CPU tensors under TRITON_INTERPRET=1). Importing this package imports triton, so
nothing imports it unconditionally: callers go through `mtpserve.ops.quant_gemv`, which falls back to torch."""

from .gemv import GEMV_TYPES, MAX_ROWS, dequant_blocks, quant_gemv

__all__ = ["GEMV_TYPES", "MAX_ROWS", "dequant_blocks", "quant_gemv"]
