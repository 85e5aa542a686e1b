"""Model architectures, one file each: config from GGUF metadata, then blocks, then the model."""

from .config import CacheLayout, ModelConfig, TensorSpec
from .memory import MemoryEstimate, estimate_memory
from .registry import SUPPORTED_ARCHITECTURES, config_from_gguf, config_from_metadata

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CacheLayout",
    "MemoryEstimate",
    "ModelConfig",
    "TensorSpec",
    "config_from_gguf",
    "config_from_metadata",
    "estimate_memory",
]
