"""The model runner: one call runs a forward pass over a set of slots' states, eagerly or by replaying a
captured step, and owns every graph cache that takes (nano-vllm's ModelRunner).

Decode and verification passes of a model wholly on GPUs replay CUDA graphs (models/graphs.py): one per state
and step shape (tokens, per-token states kept), and one per set of states decoding together, the
`MAX_BATCH_GRAPHS` sets used most recently kept (each holds its own activation memory). Prompt chunks (which ask for no
logits: the last row's come from `logits`) run eagerly, their length changing from chunk to chunk.
MTPSERVE_CUDA_GRAPHS=0 turns graphs off (to measure the difference, or to rule them out); =1 takes the static steps on
any device (off CUDA they run eagerly: how the tests hold them to the ordinary ones).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache import RecurrentState
from ..models.base import Batch, CausalLM, ModelState
from ..models.graphs import StepGraph

MAX_BATCH_GRAPHS = 16  # captured steps of sets of several states kept


@dataclass
class Forward:
    """What a pass gives: final-normed hidden states [rows, E] (on the model's device), float32 logits [rows, V]
    where the LM head lives when asked for (the sampler ranks them there: engine.sampling), per-token recurrent
    states {layer: [[state after token t] per sequence]} with `keep_steps`, and prompt checkpoints
    {position: {layer: state}}."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    steps: dict[int, list[Sequence[RecurrentState]]] = field(default_factory=dict)
    checkpoints: dict[int, dict[int, RecurrentState]] = field(default_factory=dict)


def graphs_wanted(model: CausalLM) -> bool:
    """Whether this model's steps replay CUDA graphs (see the module docstring)."""
    wanted = os.environ.get("MTPSERVE_CUDA_GRAPHS", "auto")
    on_gpus = all(d.type == "cuda" for d in model.devices)  # a layer split too: one graph per GPU's blocks
    return not model.tensor_parallel and (wanted == "1" or (wanted == "auto" and on_gpus))


class ModelRunner:
    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.graphs = graphs_wanted(model)
        self._graphs: OrderedDict[tuple[tuple[int, ...], int, bool], StepGraph] = OrderedDict()
        self.n_passes = 0  # forward passes (llama-server's n_decode_total)
        self.n_sequences = 0  # sequences those passes evaluated, summed
        self.n_program_decodes = 0  # decode passes the CPU decode program served (models.base.program_decode)
        # prompt passes of a few tokens it served (a checkpoint's tail, a prefix's new tokens)
        self.n_program_prompts = 0

    @torch.inference_mode()
    def run(
        self,
        states: list[ModelState],
        tokens: list[int],
        *,
        logits: bool = True,
        keep_steps: bool = False,
        checkpoint_every: int = 0,
        next_checkpoint: int = 0,
        keep_at: tuple[int, ...] = (),
    ) -> Forward:
        """Evaluate `tokens` (len(tokens) / len(states) for each state in turn, at its next positions) and
        advance the states. `logits`: all rows' logits, each sequence rounded as if alone; `keep_steps`: every
        per-token recurrent state (a verification's rollback); `checkpoint_every`/`next_checkpoint`: recurrent
        states kept inside a single prompt, and after the positions `keep_at` (models.base.Batch)."""
        self.n_passes += 1
        self.n_sequences += len(states)
        n_tokens = len(tokens) // len(states)
        if self.graphs and logits and not checkpoint_every:  # decode and verification (prompts ask no logits)
            hidden, out, steps = self._graph(states, n_tokens, keep_steps).step(tokens)
            return Forward(hidden, out, steps)
        if not _keeps_inside(keep_at, states, n_tokens):
            # decode, verification and a prompt's tail of a few tokens: one C call on the CPU (1-8 tokens, fewer
            # than a prompt checkpoint's grid of 64, so no checkpoint falls inside the pass)
            steps: dict[int, list[Sequence[RecurrentState]]] = {}
            if (out := self.model.program_decode(tokens, states, steps if keep_steps else None, logits)) is not None:
                if logits:
                    self.n_program_decodes += 1
                else:
                    self.n_program_prompts += 1
                return Forward(*out, steps)
        batch = Batch.of(torch.tensor(tokens), states, checkpoint_every, next_checkpoint, keep_at)
        batch.keep_steps = keep_steps
        hidden = self.model.forward_batch(batch)
        out = self._logits(hidden, n_tokens) if logits else None
        return Forward(hidden, out, batch.steps, batch.checkpoints)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, V] of hidden states a pass gave without them (a prompt's last row), where `run` gives them."""
        return self._logits(hidden, None)

    def _logits(self, hidden: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        return self.model.logits_on_device(hidden, seq_len).float()

    def _graph(self, states: list[ModelState], n_tokens: int, keep_steps: bool) -> StepGraph:
        """The captured step of these states and this shape, made on first use. One state's graphs stay while
        it lives; of several states' (each its own cache memory, so a graph per set), the most recent
        MAX_BATCH_GRAPHS sets are kept."""
        key = (tuple(id(st) for st in states), n_tokens, keep_steps)
        if key not in self._graphs:
            sets = [k for k in self._graphs if len(k[0]) > 1]
            if len(states) > 1 and len(sets) >= MAX_BATCH_GRAPHS:
                del self._graphs[sets[0]]
            self._graphs[key] = StepGraph(self.model, states, n_tokens, keep_steps)
        self._graphs.move_to_end(key)
        return self._graphs[key]

    def graph_shapes(self) -> list[tuple[int, int, bool]]:
        """(states, tokens per state, per-token states kept) of every captured step it holds."""
        return [(len(ids), n_tokens, keep_steps) for ids, n_tokens, keep_steps in self._graphs]


def _keeps_inside(keep_at: tuple[int, ...], states: list[ModelState], n_tokens: int) -> bool:
    """Whether a pass of n_tokens from each state's position must keep a recurrent state inside it (`keep_at`)."""
    return any(s.n_past < p < s.n_past + n_tokens for p in keep_at for s in states)
