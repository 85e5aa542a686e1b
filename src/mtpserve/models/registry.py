"""GGUF `general.architecture` -> the config class that reads it, and the checks every file must pass."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ..gguf import GGUFError, GGUFFile, Metadata
from .config import ModelConfig
from .configs.gemma3 import Gemma3Config
from .configs.llama import LlamaConfig
from .configs.qwen35 import Qwen35Config

CONFIG_CLASSES: dict[str, Any] = {
    "qwen35": Qwen35Config,
    "gemma3": Gemma3Config,
    "llama": LlamaConfig,
    "qwen2": LlamaConfig,
    "qwen3": LlamaConfig,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(CONFIG_CLASSES))
# Keys a config divides by (a layer period); 0 or less is refused before the config class reads them.
_PERIOD_KEYS = ("full_attention_interval",)


def config_from_metadata(
    metadata: Mapping[str, Any], tensor_names: Collection[str] = (), source: str | Path = "<metadata>"
) -> ModelConfig:
    md = Metadata(metadata, source)
    arch = md.get_str("general.architecture")
    cls = CONFIG_CLASSES.get(arch)
    if cls is None:
        raise GGUFError(source, f"unknown architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for key in _PERIOD_KEYS:
        if f"{arch}.{key}" in md and md.get_int(f"{arch}.{key}") < 1:
            raise GGUFError(source, f"{arch}.{key} = {md.get_int(f'{arch}.{key}')}: must be at least 1")
    config = cls.from_metadata(md, tensor_names)
    _check_rope(config, source)
    return config


def _check_rope(config: ModelConfig, source: str | Path) -> None:
    """RoPE values the model classes build tables from: rotated dims even (ggml's rope asserts it) and within
    a head, a linear scaling factor they divide by that is positive and finite."""
    n_rot, head_dim = getattr(config, "n_rot", None), getattr(config, "head_dim", None)
    if n_rot is not None and head_dim is not None and not (0 < n_rot <= head_dim and n_rot % 2 == 0):
        problem = f"must be even, from 2 to the head size {head_dim}"
        raise GGUFError(source, f"{config.architecture}.rope.dimension_count = {n_rot}: {problem}")
    scale = getattr(config, "rope_scale", 1.0)
    if not (math.isfinite(scale) and scale > 0):
        raise GGUFError(source, f"{config.architecture}.rope.scaling.factor = {scale}: must be a positive number")


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The typed config of a GGUF model, after checking every tensor the architecture needs is present
    with the shape its metadata implies."""
    config = config_from_metadata(gguf.metadata, gguf.tensors.keys(), gguf.path)
    for spec in config.tensor_specs():
        if any(d <= 0 for d in spec.shape):  # a zero or negative size in the metadata (embedding_length, ...)
            raise GGUFError(gguf.path, f"the metadata gives tensor '{spec.name}' the shape {list(spec.shape)}")
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
