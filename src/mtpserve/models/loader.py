"""`load(path)`: a GGUF file -> the model object of its architecture, weights left in the memory map."""

from __future__ import annotations

from pathlib import Path

from ..gguf import open_gguf
from .base import CausalLM, WeightStore
from .registry import config_from_gguf


def load(path: str | Path, device: str = "cpu") -> CausalLM:
    if device != "cpu":
        raise ValueError(f"device '{device}' is not supported yet (CPU only)")
    gguf = open_gguf(path)
    config = config_from_gguf(gguf)
    weights = WeightStore(gguf)
    arch = config.architecture
    if arch == "qwen35":
        from .qwen35 import Qwen35ForCausalLM

        return Qwen35ForCausalLM(weights, config)
    if arch == "gemma3":
        from .gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM(weights, config)
    from .llama import LlamaForCausalLM

    return LlamaForCausalLM(weights, config)
