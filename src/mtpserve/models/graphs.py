"""Decode steps replayed from CUDA graphs: the GPU path's answer to Python in the hot loop.

An eager decode step of the 27B launches about 1,500 kernels from Python (64 layers of projections, norms,
rope, the recurrence, attention); at ~10 us of Python and launch each, that is ~15 ms a token against the
~4 ms the weights take to read at an H200's bandwidth. A captured step launches them all in one call.

Capturing needs a step whose shapes and addresses do not change from token to token and that reads nothing
back to the host. `DecodeGraph` runs the model's own forward pass in that form (`Batch.positions`): the token
and its position come from device tensors, K/V rows are written with `index_copy_` at that position
(`KVCache.write_at`), attention reads every cell of the cache with empty cells masked by position -1
(`KVCache.attend_static`), rope gathers its angles from a table grown in advance, recurrent states are updated
in place. Off CUDA (tests, under the Triton interpreter) the same static step runs eagerly, which is how its
results are held equal to the ordinary step's.
"""

from __future__ import annotations

import torch

from .base import Batch, CausalLM, ModelState


class DecodeGraph:
    """Decode steps (one token) of one sequence: `decode(token)` -> logits [V] on the CPU, like
    `model.decode(token, state)`. The first call runs the static step eagerly (it compiles the Triton kernels),
    the second captures it and every later one replays it. The graph holds the state's tensors by address, so
    it stays valid while the state's tensors live (clear, truncate and restore work in place)."""

    def __init__(self, model: CausalLM, state: ModelState, capture: bool | None = None) -> None:
        if model.layer_devices and set(model.layer_devices.values()) != {model.device}:
            raise ValueError("a decode graph runs on one device; this model is split over several")
        self.model, self.state = model, state
        self.capture = model.device.type == "cuda" if capture is None else capture
        device = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        for table in _rope_tables(model):
            table.reserve(state.capacity)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.steps = 0

    def _step(self) -> torch.Tensor:
        batch = Batch(self.token, [self.state], 1, [-1], positions=self.position)
        return self.model.logits_on_device(self.model.forward_batch(batch), seq_len=1)[0]

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        state = self.state
        if state.n_past + 1 > state.capacity:
            raise ValueError(f"context size {state.capacity} is full")
        if not 0 <= token < self.model.config.n_vocab:
            raise IndexError(f"token id {token} out of range [0, {self.model.config.n_vocab})")
        self.token.fill_(token)
        self.position.fill_(state.n_past)
        if not self.capture or self.steps == 0:
            logits = self._step()
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = self._step()
            self.graph.replay()
            assert self.logits is not None
            logits = self.logits
        self.steps += 1
        mtp = getattr(self.model, "mtp_kv_index", None)
        for layer, kv in state.kv.items():
            if layer != mtp:  # the MTP block's cache keeps its own length
                kv.length += 1
        state.n_past += 1
        return logits.float().cpu()


def _rope_tables(model: CausalLM) -> list:
    tables = getattr(model, "rope_tables", None)
    return list(tables.values()) if isinstance(tables, dict) else [model.rope_table]  # type: ignore[attr-defined]
