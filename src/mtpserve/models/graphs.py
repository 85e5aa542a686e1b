"""Forward steps replayed from CUDA graphs: the GPU path's answer to Python in the hot loop.

An eager decode step of the 27B launches about 1,500 kernels from Python (64 layers of projections, norms,
rope, the recurrence, attention); at ~10 us of Python and launch each, that is ~15 ms a token against the
~4 ms the weights take to read at an H200's bandwidth. A captured step launches them all in one call.

Capturing needs a step whose shapes and addresses do not change from call to call, that reads nothing back
to the host, and that runs on one GPU: a layer split's step is one graph per GPU's run of blocks. `StepGraph`
runs the model's own forward pass in that form (`Batch.positions`): the tokens are embedded before the replay
(the table may be in host memory), their positions come from device tensors, K/V rows are written with
`index_copy_` at those positions (`KVCache.write_at`), attention reads every cell of the cache with empty cells
masked by position -1 (`KVCache.attend_static`), rope gathers its angles from a table grown in advance (a copy
on each GPU), recurrent states are updated in place. One graph per step shape: a decode step (1 token, of one
sequence or of several sequences together, each over its own cache), a speculative verification of n_max + 1
tokens (which also keeps every per-token recurrent state, for rollback), and the MTP block's steps: the
catch-up pass after a verification (`MTPRowsGraph`) and the draft (`MTPDraftGraph`, which picks each draft token
on the device; `MTPDrawGraph`, which draws it there from the request's sampler chain). Off CUDA (tests, under the
Triton interpreter) the same static steps run eagerly, which is how their results are held equal to the ordinary
ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..cache import RecurrentState
from ..ops.sampling_chain import ChainInputs, ChainParams, ChainShape, drawn_row
from .base import Batch, CausalLM, ModelState
from .draft_head import DraftHead, candidates
from .mtp import MTPModel, mtp_cache_index, mtp_graphable, mtp_model


class CapturedStep:
    """Runs `_step()` (a static step: fixed shapes and addresses, no host reads) eagerly on the first call, which
    compiles the Triton kernels, captures it on the second and replays it on every later one; off CUDA (or with
    `capture=False`) it always runs eagerly. The outputs are the graph's buffers: the next call overwrites them.

    PyTorch's capture protocol: the eager warm-up runs on a side stream (lazy initialisations, such as a cuBLAS
    workspace, happen outside the capture), and all of it runs with the model's GPU current (a model on the
    second GPU is captured there, not on whichever GPU happens to be current)."""

    def __init__(self, device: torch.device, capture: bool | None) -> None:
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.calls = 0

    def _step(self) -> Any:
        raise NotImplementedError

    def _run(self) -> Any:
        if not self.capture:
            outputs = self._step()
        else:
            with torch.cuda.device(self.device):
                outputs = self._warm_up() if self.calls == 0 else self._replay()
        self.calls += 1
        return outputs

    def _warm_up(self) -> Any:
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outputs = self._step()
        main.wait_stream(side)
        return outputs

    def _replay(self) -> Any:
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream()):
                self.outputs = self._step()
        self.graph.replay()
        return self.outputs


Steps = dict[int, list[list[RecurrentState]]]


class _Segment(CapturedStep):
    """A run of blocks on one device, with the final norm and the LM head when `head`: one graph of a step."""

    def __init__(
        self,
        model: CausalLM,
        states: list[ModelState],
        n_tokens: int,
        keep_steps: bool,
        device: torch.device,
        layers: range,
        head: bool,
        capture: bool | None,
    ) -> None:
        super().__init__(device, capture)
        self.model, self.states, self.n_tokens, self.keep_steps = model, states, n_tokens, keep_steps
        self.layers, self.head = layers, head
        rows = len(states) * n_tokens
        self.inputs = torch.zeros(rows, model.config.n_embd, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # a Batch has them; the blocks read none
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        for table in _rope_tables(model):
            table.reserve(max(st.capacity for st in states), device)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor | None, Steps]:
        batch = Batch(self.tokens, self.states, self.n_tokens, [-1] * len(self.states), positions=self.positions)
        batch.keep_steps = self.keep_steps
        x = self.model.forward_layers(self.inputs, batch, self.layers)
        if not self.head:
            return x, None, batch.steps
        hidden = self.model.final_norm(x)
        return hidden, self.model.logits_on_device(hidden, seq_len=self.n_tokens), batch.steps


class StepGraph:
    """Forward steps of `n_tokens` tokens for each of one or more sequences: `step(tokens)` evaluates them at each
    state's next positions and advances the states, like `model.forward_batch(Batch.of(tokens, states))`.

    The step is captured per device: each run of blocks on one GPU (a layer split has one per GPU) is a graph,
    the last one with the final norm and the LM head, and the hidden state is copied from one GPU to the next
    between replays. The tokens are embedded before the first (`model.embed`: the table may sit in host memory,
    as llama.cpp keeps an untied one). `split_at` cuts extra runs at those blocks (tests: a layer split's
    plumbing on one device). The graphs hold the states' tensors by address, so they stay valid while those live
    (clear, truncate and restore work in place)."""

    def __init__(
        self,
        model: CausalLM,
        states: ModelState | Sequence[ModelState],
        n_tokens: int = 1,
        keep_steps: bool = False,
        capture: bool | None = None,
        split_at: Sequence[int] = (),
    ) -> None:
        if model.tensor_parallel and capture is not False:  # its exchanges run on the host (ops.collective)
            raise ValueError("a tensor-parallel rank's steps are not captured yet: its exchanges run on the host")
        self.states = [states] if isinstance(states, ModelState) else list(states)
        self.model, self.n_tokens, self.keep_steps = model, n_tokens, keep_steps
        self.segments = [
            _Segment(model, self.states, n_tokens, keep_steps, device, layers, head, capture)
            for device, layers, head in _runs(model, split_at)
        ]

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, Steps]:
        """`n_tokens` tokens for each sequence in turn -> (hidden [rows, E] on the device, float32 logits [rows, V]
        on the LM head's device (a copy: the engine's sampler ranks each row there and copies what it keeps), per-token
        recurrent states {layer: [[state after token t] per sequence]} when `keep_steps`). The hidden states and kept
        states are the graphs' buffers: the next call overwrites them."""
        rows = len(self.states) * self.n_tokens
        if len(tokens) != rows:
            raise ValueError(f"this graph evaluates {rows} tokens, not {len(tokens)}")
        for state in self.states:
            if state.n_past + self.n_tokens > state.capacity:
                raise ValueError(f"context size {state.capacity} is full")
        _check_tokens(tokens, self.model.config.n_vocab)
        x = self.model.embed(torch.tensor(tokens))
        positions = torch.tensor([st.n_past + t for st in self.states for t in range(self.n_tokens)])
        steps: Steps = {}
        logits: torch.Tensor | None = None
        for segment in self.segments:
            segment.inputs.copy_(x)  # from the host, or the previous GPU
            segment.positions.copy_(positions)
            x, logits, kept = segment._run()
            steps.update(kept)
        assert logits is not None
        mtp = mtp_cache_index(self.model)
        for state in self.states:
            for layer, kv in state.kv.items():
                if layer != mtp:  # the MTP block's cache keeps its own length
                    kv.length += self.n_tokens
            state.n_past += self.n_tokens
        return x, logits.to(torch.float32, copy=True), steps


def _runs(model: CausalLM, split_at: Sequence[int] = ()) -> list[tuple[torch.device, range, bool]]:
    """(device, blocks, with the head) of each run of consecutive blocks on one device; the head (final norm and
    LM head) joins the last run when it is on the same device, else it is a run of its own."""
    runs: list[tuple[torch.device, range, bool]] = []
    start = 0
    n = model.config.n_layer
    for i in range(1, n + 1):
        if i == n or model.device_of(i) != model.device_of(start) or i in split_at:
            runs.append((model.device_of(start), range(start, i), False))
            start = i
    head = model.output_norm.device
    if runs and runs[-1][0] == head:
        runs[-1] = (head, runs[-1][1], True)
    else:
        runs.append((head, range(n, n), True))
    return runs


class MTPRowsGraph(CapturedStep):
    """The MTP block's catch-up pass after a trunk pass, `n_tokens` rows at the next positions of its cache:
    `write(inputs, tokens)` is `model.mtp_step(inputs, tokens, state, with_logits=False)`, the tokens embedded
    before the replay."""

    def __init__(self, model: CausalLM, state: ModelState, n_tokens: int, capture: bool | None = None) -> None:
        mtp, device = _mtp_on_one_device(model)
        super().__init__(device, capture)
        self.model, self.state, self.n_tokens = model, state, n_tokens
        self.kv = state.kv[_index(mtp)]
        self.mtp_step, self.mtp_embed = mtp.mtp_step, mtp.mtp_embed
        self.inputs = torch.zeros(n_tokens, model.config.n_embd, device=device)
        self.embeddings = torch.zeros(n_tokens, model.config.n_embd, device=device)
        self.tokens = torch.zeros(n_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(n_tokens, dtype=torch.long, device=device)
        self._offsets = torch.arange(n_tokens, device=device)
        for table in _rope_tables(model):
            table.reserve(state.capacity, device)

    def _step(self) -> torch.Tensor:
        return self.mtp_step(self.inputs, self.tokens, self.state, False, self.positions, self.embeddings)[1]

    @torch.inference_mode()
    def write(self, inputs: torch.Tensor, tokens: list[int]) -> None:
        if len(tokens) != self.n_tokens:
            raise ValueError(f"this graph writes {self.n_tokens} rows, not {len(tokens)}")
        if self.kv.length + self.n_tokens > self.kv.capacity:
            raise ValueError(f"context size {self.kv.capacity} is full")
        _check_tokens(tokens, self.model.config.n_vocab)
        ids = torch.tensor(tokens)
        self.inputs.copy_(inputs)
        self.tokens.copy_(ids)
        self.embeddings.copy_(self.mtp_embed(ids))
        torch.add(self._offsets, self.kv.length, out=self.positions)
        self._run()
        self.kv.length += self.n_tokens


class _MTPChain(CapturedStep):
    """`n_max` chained MTP draft steps, each choosing its token on the device; the rows they write to the MTP cache
    stay beyond the cache's length (the caller truncates them away, as after eager draft steps). `head` scores the
    draft (models.draft_head).

    `chained` (by default: whether the MTP block's token table is on the model's GPU): all n_max steps in one
    graph, each embedding the token the previous one chose on the device, with one copy to the host at the end.
    Otherwise (the table in host memory, where a captured step cannot read) the graph is one step, replayed
    n_max times with each chosen token read back and embedded on the host in between."""

    def __init__(
        self,
        model: CausalLM,
        state: ModelState,
        n_max: int,
        head: DraftHead,
        top_k: int,
        capture: bool | None = None,
        chained: bool | None = None,
    ) -> None:
        mtp, device = _mtp_on_one_device(model)
        super().__init__(device, capture)
        self.model, self.state, self.n_max, self.head, self.top_k = model, state, n_max, head, top_k
        self.kv = state.kv[_index(mtp)]
        self.mtp_step, self.mtp_embed = mtp.mtp_step, mtp.mtp_embed
        table_device = mtp.mtp_table.data.device
        self.chained = table_device == device if chained is None else chained
        self.n_steps = n_max if self.chained else 1
        self.hidden = torch.zeros(1, model.config.n_embd, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.embedding = torch.zeros(1, model.config.n_embd, device=device)  # unchained: the token's row
        self.positions = torch.zeros(self.n_steps, dtype=torch.long, device=device)
        self._offsets = torch.arange(self.n_steps, device=device)
        for table in _rope_tables(model):
            table.reserve(state.capacity, device)

    def _mtp_hidden(self, hidden: torch.Tensor, token: torch.Tensor, i: int) -> torch.Tensor:
        embeddings = None if self.chained else self.embedding
        return self.mtp_step(hidden, token, self.state, False, self.positions[i : i + 1], embeddings)[1]

    def _start(self, hidden: torch.Tensor, token: int) -> None:
        if self.kv.length + self.n_max > self.kv.capacity:
            raise ValueError(f"context size {self.kv.capacity} is full")
        _check_tokens([token], self.model.config.n_vocab)
        self.hidden.copy_(hidden.reshape(1, -1))
        if self.chained:
            self.token.fill_(token)
            torch.add(self._offsets, self.kv.length, out=self.positions)

    def _step_on_host(self, token: int, i: int) -> Any:
        """Unchained: step i of the draft from `token`, embedded here; the next step reads this one's output."""
        self.embedding.copy_(self.mtp_embed(torch.tensor([token])))
        self.positions.fill_(self.kv.length + i)
        *outputs, h_out = self._run()
        self.hidden.copy_(h_out)
        return outputs


class MTPDraftGraph(_MTPChain):
    """Greedy drafts: each step's token is the argmax, as the top of a top-k, with that token's probability
    renormalised over the top k: `propose(hidden, token)` -> [(token, p)]."""

    def _step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, token, chosen, p_top = self.hidden, self.token, [], []
        for i in range(self.n_steps):
            hidden = self._mtp_hidden(hidden, token, i)
            values, ids = self.head.top(hidden, self.top_k)
            token = ids[:1]
            chosen.append(token)
            p_top.append(torch.softmax(values, 0)[:1])
        return torch.cat(chosen), torch.cat(p_top), hidden

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, token: int) -> list[tuple[int, float]]:
        self._start(hidden, token)
        if self.chained:
            chosen, p_top, _ = self._run()
            return list(zip(chosen.tolist(), p_top.tolist()))
        proposals: list[tuple[int, float]] = []
        for i in range(self.n_max):
            chosen, p_top = self._step_on_host(token, i)
            token = int(chosen[0])
            proposals.append((token, float(p_top[0])))
        return proposals


class MTPDrawGraph(_MTPChain):
    """Drafts drawn at a temperature (--spec-draft-sampling probabilistic): each step draws its token from the
    request's sampler chain over the draft head's scores (ops.sampling_chain: top-k, top-p, min-p, temperature):
    the whole row, or a shortlisting head's rows (models.draft_head: the distribution drawn from is returned, and
    the ratio rule reads it), with uniforms the host takes from the request's draft stream before the replay; an
    eager draw would launch every kernel of the MTP block from Python. One graph per chain shape.
    `draw(hidden, token, chain, uniforms)` -> per step (token, the argmax's probability over the top `top_k`, the
    distribution it was drawn from)."""

    def __init__(
        self,
        model: CausalLM,
        state: ModelState,
        n_max: int,
        head: DraftHead,
        top_k: int,
        shape: ChainShape,
        capture: bool | None = None,
        chained: bool | None = None,
    ) -> None:
        super().__init__(model, state, n_max, head, top_k, capture, chained)
        self.shape = shape
        self.inputs = ChainInputs(self.n_steps, self.hidden.device, head.exact.shape[0] if shape.bans else 0)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each step's row: [token, p_top, survivors, n_top candidate ids, their probabilities] (one float64 copy)."""
        hidden, token, rows, n_top = self.hidden, self.token, [], self.shape.n_top
        k, ban = max(n_top, self.top_k), self.inputs.ban if self.shape.bans else None
        for i in range(self.n_steps):
            hidden = self._mtp_hidden(hidden, token, i)
            # the head's row, or its shortlisted rows (models.draft_head), which a shortlist takes past the bans
            scores = self.head.scores(hidden, k, ban)
            values, ids = candidates(*scores, self.top_k if self.shape.bans else k)
            confidence = values  # the draft's confidence: the row's own argmax (a shortlist's: unbanned)
            if self.shape.bans:  # the chain's candidates from the row with its bans
                values, ids = candidates(*scores, n_top, ban)
            packed, token = drawn_row(confidence, values[:n_top], ids[:n_top], self.shape, self.inputs, i, self.top_k)
            rows.append(packed)
        return torch.stack(rows), hidden

    @torch.inference_mode()
    def draw(
        self, hidden: torch.Tensor, token: int, chain: ChainParams, uniforms: list[float]
    ) -> list[tuple[int, float, dict[int, float]]]:
        """One uniform a step."""
        self._start(hidden, token)
        if self.chained:
            self.inputs.set(chain, uniforms)
            rows, _ = self._run()
            return [self._drawn(row) for row in rows.tolist()]
        drawn = []
        for i in range(self.n_max):
            self.inputs.set(chain, uniforms[i : i + 1])
            (rows,) = self._step_on_host(token, i)
            drawn.append(self._drawn(rows.tolist()[0]))
            token = drawn[-1][0]
        return drawn

    def _drawn(self, row: list[float]) -> tuple[int, float, dict[int, float]]:
        n_top, kept = self.shape.n_top, int(row[2])
        ids, probs = row[3 : 3 + n_top], row[3 + n_top :]
        return int(row[0]), row[1], {int(ids[j]): probs[j] for j in range(kept)}


class DecodeGraph(StepGraph):
    """One token at a time: `decode(token)` -> logits [V] on the CPU, like `model.decode(token, state)`."""

    def __init__(self, model: CausalLM, state: ModelState, capture: bool | None = None) -> None:
        super().__init__(model, state, 1, False, capture)

    def decode(self, token: int) -> torch.Tensor:
        return self.step([token])[1][0].cpu()


def _mtp_on_one_device(model: CausalLM) -> tuple[MTPModel, torch.device]:
    mtp = mtp_model(model)
    if mtp is None or not mtp_graphable(model):
        raise ValueError("the MTP graphs run the MTP block and the LM head on one device; this model splits them")
    return mtp, model.device_of(_index(mtp))


def _index(mtp: MTPModel) -> int:
    assert mtp.mtp_kv_index is not None
    return mtp.mtp_kv_index


def _check_tokens(tokens: list[int], vocab: int) -> None:
    if any(not 0 <= t < vocab for t in tokens):
        raise IndexError(f"token id out of range [0, {vocab})")


def _rope_tables(model: CausalLM) -> list:
    tables = getattr(model, "rope_tables", None)
    return list(tables.values()) if isinstance(tables, dict) else [model.rope_table]  # type: ignore[attr-defined]
