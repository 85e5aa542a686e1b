"""Triton launches on torch's current CUDA device, not on its arguments' device: a kernel over tensors of another GPU
(the second GPU of a layer split) would run in the wrong context. The public wrappers launch on their first
argument's device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., torch.Tensor])


def on_input_device(fn: F) -> F:
    @functools.wraps(fn)
    def launch(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return launch  # type: ignore[return-value]
