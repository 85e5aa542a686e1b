"""Compiled kernels behind the ops: `cpu` (C, built on first use)."""
