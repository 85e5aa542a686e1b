"""The model base's block walk (models.base.CausalLM.forward_layers) hands each block its input on the block's own
device, whatever device the input rows came from."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mtpserve.models.base import CausalLM


def test_one_device_blocks_get_their_input_on_it_from_an_embedding_on_the_host() -> None:
    """The server keeps the embedding table on the host beside a model on one GPU (llama.cpp's placement,
    engine.placement's too): the rows it looks up are CPU tensors. The first H200 run crashed here, the blocks
    taking their CPU branch on CUDA weights (bench/gpu.py, a segfault in the C DeltaNet kernel). A device of
    its own ('meta') stands for the GPU on a machine without one."""
    seen: list[torch.device] = []

    def block(x: torch.Tensor, rope: object, batch: object) -> torch.Tensor:
        seen.append(x.device)
        return x

    model = SimpleNamespace(layer_devices={}, device=torch.device("meta"), layers=[block, block], rope_table=None)
    batch = SimpleNamespace(rope=lambda table: "rope")
    out = CausalLM.forward_layers(model, torch.zeros(1, 8), batch, range(2))  # type: ignore[arg-type]
    assert seen == [torch.device("meta")] * 2 and out.device == torch.device("meta")
