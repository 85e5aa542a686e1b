"""GGUF `general.architecture` -> the config class that reads it, and the checks every file must pass."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..gguf import GGUFError, GGUFFile, Metadata
from .config import ModelConfig
from .gemma3 import Gemma3Config
from .llama import LlamaConfig
from .qwen35 import Qwen35Config

CONFIG_CLASSES: dict[str, Any] = {
    "qwen35": Qwen35Config,
    "gemma3": Gemma3Config,
    "llama": LlamaConfig,
    "qwen2": LlamaConfig,
    "qwen3": LlamaConfig,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(CONFIG_CLASSES))


def config_from_metadata(
    metadata: Mapping[str, Any], tensor_names: Collection[str] = (), source: str | Path = "<metadata>"
) -> ModelConfig:
    md = Metadata(metadata, source)
    arch = md.get_str("general.architecture")
    cls = CONFIG_CLASSES.get(arch)
    if cls is None:
        raise GGUFError(source, f"unknown architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return cls.from_metadata(md, tensor_names)


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The typed config of a GGUF model, after checking every tensor the architecture needs is present
    with the shape its metadata implies."""
    config = config_from_metadata(gguf.metadata, gguf.tensors.keys(), gguf.path)
    for spec in config.tensor_specs():
        tensor = gguf.tensors.get(spec.name)
        if tensor is None:
            if spec.required:
                raise GGUFError(
                    gguf.path, f"required tensor '{spec.name}' is missing (architecture {config.architecture})"
                )
            continue
        if tensor.shape != spec.shape:
            raise GGUFError(
                gguf.path,
                f"tensor '{spec.name}' has shape {list(tensor.shape)}, the metadata implies {list(spec.shape)}",
            )
    return config
