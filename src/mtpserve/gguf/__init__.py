"""The GGUF file format: container parsing and typed metadata. Knows nothing of models or torch."""

from .metadata import Metadata
from .reader import GGUFError, GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFFile", "Metadata", "TensorInfo", "open_gguf"]
