"""Forward steps replayed from CUDA graphs: the GPU path's answer to Python in the hot loop.

An eager decode step of the 27B launches about 1,500 kernels from Python (64 layers of projections, norms,
rope, the recurrence, attention); at ~10 us of Python and launch each, that is ~15 ms a token against the
~4 ms the weights take to read at an H200's bandwidth. A captured step launches them all in one call.

Capturing needs a step whose shapes and addresses do not change from call to call and that reads nothing back
to the host. `StepGraph` runs the model's own forward pass in that form (`Batch.positions`): the tokens and their
positions come from device tensors, K/V rows are written with `index_copy_` at those positions
(`KVCache.write_at`), attention reads every cell of the cache with empty cells masked by position -1
(`KVCache.attend_static`), rope gathers its angles from a table grown in advance, recurrent states are updated
in place. One graph per step shape: a decode step (1 token), a speculative verification of n_max + 1 tokens
(which also keeps every per-token recurrent state, for rollback). Off CUDA (tests, under the Triton interpreter)
the same static step runs eagerly, which is how its results are held equal to the ordinary step's.
"""

from __future__ import annotations

import torch

from ..cache import RecurrentState
from .base import Batch, CausalLM, ModelState


class StepGraph:
    """Forward steps of `n_tokens` tokens of one sequence: `step(tokens)` evaluates them at the state's next
    positions and advances it, like `model.forward_batch(Batch.of(tokens, [state]))`. The first call runs the
    static step eagerly (it compiles the Triton kernels), the second captures it and every later one replays it.
    The graph holds the state's tensors by address, so it stays valid while they live (clear, truncate and
    restore work in place)."""

    def __init__(
        self,
        model: CausalLM,
        state: ModelState,
        n_tokens: int = 1,
        keep_steps: bool = False,
        capture: bool | None = None,
    ) -> None:
        if model.layer_devices and set(model.layer_devices.values()) != {model.device}:
            raise ValueError("a step graph runs on one device; this model is split over several")
        self.model, self.state, self.n_tokens, self.keep_steps = model, state, n_tokens, keep_steps
        self.capture = model.device.type == "cuda" if capture is None else capture
        device = model.device
        self.tokens = torch.zeros(n_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(n_tokens, dtype=torch.long, device=device)
        self._offsets = torch.arange(n_tokens, device=device)
        for table in _rope_tables(model):
            table.reserve(state.capacity)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, dict[int, list[list[RecurrentState]]]] | None = None
        self.calls = 0

    def _step(self) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[list[RecurrentState]]]]:
        batch = Batch(self.tokens, [self.state], self.n_tokens, [-1], positions=self.positions)
        batch.keep_steps = self.keep_steps
        hidden = self.model.forward_batch(batch)
        return hidden, self.model.logits_on_device(hidden, seq_len=self.n_tokens), batch.steps

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[list[RecurrentState]]]]:
        """(hidden [T, E] on the device, logits [T, V] on the CPU, per-token recurrent states {layer: [[state
        after token t]]} when `keep_steps`). The hidden states and kept states are the graph's buffers: the next
        call overwrites them."""
        state, vocab = self.state, self.model.config.n_vocab
        if len(tokens) != self.n_tokens:
            raise ValueError(f"this graph evaluates {self.n_tokens} tokens, not {len(tokens)}")
        if state.n_past + self.n_tokens > state.capacity:
            raise ValueError(f"context size {state.capacity} is full")
        if any(not 0 <= t < vocab for t in tokens):
            raise IndexError(f"token id out of range [0, {vocab})")
        self.tokens.copy_(torch.tensor(tokens))
        torch.add(self._offsets, state.n_past, out=self.positions)
        if not self.capture or self.calls == 0:
            hidden, logits, steps = self._step()
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.outputs = self._step()
            self.graph.replay()
            assert self.outputs is not None
            hidden, logits, steps = self.outputs
        self.calls += 1
        mtp = getattr(self.model, "mtp_kv_index", None)
        for layer, kv in state.kv.items():
            if layer != mtp:  # the MTP block's cache keeps its own length
                kv.length += self.n_tokens
        state.n_past += self.n_tokens
        return hidden, logits.float().cpu(), steps


class DecodeGraph(StepGraph):
    """One token at a time: `decode(token)` -> logits [V] on the CPU, like `model.decode(token, state)`."""

    def __init__(self, model: CausalLM, state: ModelState, capture: bool | None = None) -> None:
        super().__init__(model, state, 1, False, capture)

    def decode(self, token: int) -> torch.Tensor:
        return self.step([token])[1][0]


def _rope_tables(model: CausalLM) -> list:
    tables = getattr(model, "rope_tables", None)
    return list(tables.values()) if isinstance(tables, dict) else [model.rope_table]  # type: ignore[attr-defined]
