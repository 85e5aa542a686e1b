"""Compiled kernels behind the ops: `cpu` (C, built on first use) and `triton` (GPU kernels: fused
dequantize + GEMV for GGUF blocks; tested under the Triton interpreter on CPU machines, not wired into
the models until the CUDA backend is)."""
