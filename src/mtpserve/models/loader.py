"""`load(path)`: a GGUF file -> the model object of its architecture, weights left in the memory map (CPU) or
copied to the device they are placed on."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..gguf import open_gguf
from ..ops.device import resolve_device
from .base import CausalLM, WeightStore
from .config import ModelConfig
from .registry import config_from_gguf
from .tensor_parallel import WHOLE, Partition


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    layer_devices: Mapping[int, str | torch.device] | None = None,
    token_embd_device: str | torch.device | None = None,
    partition: Partition = WHOLE,
    use_mmap: bool = True,
    use_mlock: bool = False,
) -> CausalLM:
    """`device` holds the output layer and every tensor not placed otherwise: `layer_devices` maps block indices
    to devices (a layer split or a partial offload, as engine.placement plans it); `token_embd_device` takes the
    embedding table (llama.cpp keeps it on the host) when it is only that: a tied table is the LM head too and
    stays on `device`. `partition`: the tensor-parallel rank to load the share of (models.tensor_parallel).
    `use_mmap` False reads the file into memory, `use_mlock` pins it (--no-mmap, --mlock: gguf.residency)."""
    dev = resolve_device(device)
    placed = {i: resolve_device(d) for i, d in (layer_devices or {}).items()}
    gguf = open_gguf(path, use_mmap, use_mlock)
    config = config_from_gguf(gguf)
    named = {}
    if token_embd_device is not None and "output.weight" in gguf.tensors:
        named["token_embd.weight"] = resolve_device(token_embd_device)
    return build_model(WeightStore.from_gguf(gguf, dev, placed, named, partition), config)


def build_model(weights: WeightStore, config: ModelConfig) -> CausalLM:
    """The model object of `config.architecture` over a weight store (a GGUF file's, or tensors in memory)."""
    arch = config.architecture
    if arch == "qwen35":
        from .qwen35 import Qwen35ForCausalLM

        return Qwen35ForCausalLM(weights, config)  # type: ignore[arg-type]
    if arch == "gemma3":
        from .gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM(weights, config)  # type: ignore[arg-type]
    from .llama import LlamaForCausalLM

    return LlamaForCausalLM(weights, config)  # type: ignore[arg-type]
