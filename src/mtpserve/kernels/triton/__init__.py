"""Triton kernels (GPU; on CPU tensors under TRITON_INTERPRET=1). Importing this package imports triton, so
nothing imports it unconditionally: callers go through `mtpserve.ops.quant_gemv`, which falls back to torch."""

from .attention import ATTENTION_TYPES, auto_splits, decode_attention
from .chain import draw_row
from .gated_delta import (
    chunk_scan_supported,
    gated_delta_chunk_scan,
    gated_delta_decode,
    gated_delta_rule_recurrent_batched,
    gdn_decode_inputs,
)
from .gemm import GEMM_TYPES, quant_matmul
from .gemv import GEMV_TYPES, MAX_ROWS, dequant_blocks, quant_gemv
from .gemv_q8 import L2_AHEAD_TYPES, Q8_GEMV_TYPES, act_block, quant_gemv_q8
from .rope_kv import ROPE_KV_TYPES, norm_rope_store
from .rowwise import GLU_ACTS, QUANT_BLOCKS, glu_quantize, quantize_rows, rms_norm_quantize

__all__ = [
    "ATTENTION_TYPES",
    "GEMM_TYPES",
    "GEMV_TYPES",
    "GLU_ACTS",
    "L2_AHEAD_TYPES",
    "MAX_ROWS",
    "Q8_GEMV_TYPES",
    "QUANT_BLOCKS",
    "ROPE_KV_TYPES",
    "act_block",
    "auto_splits",
    "chunk_scan_supported",
    "decode_attention",
    "dequant_blocks",
    "draw_row",
    "gated_delta_chunk_scan",
    "gated_delta_decode",
    "gated_delta_rule_recurrent_batched",
    "gdn_decode_inputs",
    "glu_quantize",
    "norm_rope_store",
    "quant_gemv",
    "quant_gemv_q8",
    "quant_matmul",
    "quantize_rows",
    "rms_norm_quantize",
]
