"""Triton kernels (GPU; on CPU tensors under TRITON_INTERPRET=1). Importing this package imports triton, so
nothing imports it unconditionally: callers go through `mtpserve.ops.quant_gemv`, which falls back to torch."""

from .attention import ATTENTION_TYPES, auto_splits, decode_attention
from .gated_delta import chunk_scan_supported, gated_delta_chunk_scan, gated_delta_rule_recurrent_batched
from .gemm import GEMM_TYPES, quant_matmul
from .gemv import GEMV_TYPES, MAX_ROWS, dequant_blocks, quant_gemv

__all__ = [
    "ATTENTION_TYPES",
    "GEMM_TYPES",
    "GEMV_TYPES",
    "MAX_ROWS",
    "auto_splits",
    "chunk_scan_supported",
    "decode_attention",
    "dequant_blocks",
    "gated_delta_chunk_scan",
    "gated_delta_rule_recurrent_batched",
    "quant_gemv",
    "quant_matmul",
]
