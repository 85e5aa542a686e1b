"""What every model shares: reading weights from the GGUF, the per-sequence state, and the
prefill/decode entry points built on each architecture's `forward`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from ..cache import CellTable, KeptSteps, KVCache, KVPool, RecurrentState
from ..gguf import GGUFFile, TensorInfo
from ..ops.collective import GatheredQTensor, ReducedQTensor
from ..ops.decode_program import DecodeHead, DecodeProgram, run_decode_pass
from ..ops.device import canonical_device, gpu_path
from ..ops.embedding import embedding
from ..ops.linear import keep_packed_tiles, kernel_supports, linear
from ..ops.norm import rms_norm
from ..ops.rope import RopeTable
from ..quant.dequant import dequantize_tensor
from ..quant.qtensor import QTensor
from ..quant.types import GGMLType
from .config import ModelConfig
from .tensor_parallel import WHOLE, Partition, Runs, vocab_share

DEFAULT_UBATCH = 512
CTX_PAD = 256


class WeightStore:
    """Tensors by name, from a GGUF file (`from_gguf`) or from memory (random-weight benchmarks): matrices stay
    quantized (`QTensor`), small vectors become float32. Each lands on its device: a tensor named in
    `tensor_devices` there, block `blk.N.*` tensors on `layer_devices[N]` when given (a layer split), everything
    else on `device`.

    `partition`: the tensor-parallel rank these weights are for (models.tensor_parallel); the architectures ask for
    their share of each tensor by `rows` and `columns` (whole for a single rank, and then not copied)."""

    def __init__(
        self,
        tensors: Mapping[str, TensorInfo | QTensor | torch.Tensor],
        device: torch.device | str = "cpu",
        layer_devices: Mapping[int, torch.device | str] | None = None,
        tensor_devices: Mapping[str, torch.device | str] | None = None,
        partition: Partition = WHOLE,
    ) -> None:
        self.tensors = tensors
        self.partition = partition
        self.device = canonical_device(device)
        self.layer_devices = {i: canonical_device(d) for i, d in (layer_devices or {}).items()}
        self.tensor_devices = {n: canonical_device(d) for n, d in (tensor_devices or {}).items()}

    @classmethod
    def from_gguf(
        cls,
        gguf: GGUFFile,
        device: torch.device | str = "cpu",
        layer_devices: Mapping[int, torch.device | str] | None = None,
        tensor_devices: Mapping[str, torch.device | str] | None = None,
        partition: Partition = WHOLE,
    ) -> WeightStore:
        return cls(gguf.tensors, device, layer_devices, tensor_devices, partition)

    def device_of(self, name: str) -> torch.device:
        if name in self.tensor_devices:
            return self.tensor_devices[name]
        if name.startswith("blk.") and self.layer_devices:
            return self.layer_devices.get(int(name.split(".")[1]), self.device)
        return self.device

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """(rows, row length) of a stored tensor, before any share is taken."""
        return tuple(self.tensors[name].shape)

    def ggml_type(self, name: str) -> GGMLType:
        t = self.tensors[name]
        if isinstance(t, torch.Tensor):
            raise TypeError(f"tensor '{name}' is a dense {type(t).__name__}, a quantized matrix was expected")
        return t.ggml_type

    def matrix(
        self,
        name: str,
        *,
        rows: Runs | None = None,
        columns: Runs | None = None,
        partition: Partition = WHOLE,
        gathered_widths: tuple[int, ...] = (),
    ) -> QTensor:
        """A matrix in its stored blocks; a tensor-parallel share of it (`partition` split): its `rows`
        (column-parallel; with `gathered_widths`, every rank's rows, the ranks' outputs concatenated) or its
        `columns` (row-parallel: the ranks' products added), ops.collective."""
        t = self.tensors[name]
        q = QTensor.from_gguf(t) if isinstance(t, TensorInfo) else t
        if not isinstance(q, QTensor):
            raise TypeError(f"tensor '{name}' is a dense {type(t).__name__}, a quantized matrix was expected")
        if rows is not None and rows != ((0, q.shape[0]),):
            q = q.select_rows(rows)
        if columns is not None and columns != ((0, q.shape[1]),):
            q = q.select_columns(columns)
        q = keep_packed_tiles(q.to(self.device_of(name)))
        if partition.split and columns is not None:
            return ReducedQTensor(q.data, q.ggml_type, q.shape, q.name, partition.group)
        if partition.split and gathered_widths:
            return GatheredQTensor(q.data, q.ggml_type, q.shape, q.name, partition.group, gathered_widths)
        return q

    def dense(self, name: str, rows: Runs | None = None) -> torch.Tensor:
        """A tensor as float32; `rows`: a tensor-parallel share of its first dimension."""
        t = self.tensors[name]
        if isinstance(t, TensorInfo):
            values = dequantize_tensor(t)
        elif isinstance(t, QTensor):
            values = t.dequantize()
        else:
            values = t.float()
        if rows is not None and rows != ((0, values.shape[0]),):
            values = torch.cat([values[a:b] for a, b in rows])
        return values.to(self.device_of(name))


@dataclass
class ModelState:
    """Everything one sequence carries between forward passes."""

    kv: dict[int, KVCache] = field(default_factory=dict)  # attention layer -> its cache
    recurrent: dict[int, RecurrentState] = field(default_factory=dict)  # Gated DeltaNet layer -> state
    n_past: int = 0  # positions already evaluated
    capacity: int = 0  # context size of this sequence
    # CPU decode programs over this state's caches, one C call each (CausalLM.program_over), by what they step:
    # "trunk" (the model's layers), "mtp" (an MTP block). Built at first use; False where the blocks cannot take one.
    programs: dict[str, DecodeProgram | bool] = field(default_factory=dict, repr=False, compare=False)

    @property
    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.kv.values())

    @property
    def recurrent_nbytes(self) -> int:
        return sum(s.nbytes for s in self.recurrent.values())

    def clear(self) -> None:
        """Forget every position: the sequence starts again from an empty context."""
        for kv in self.kv.values():
            kv.truncate(0)
        for state in self.recurrent.values():
            state.conv.zero_()
            state.ssm.zero_()
        self.n_past = 0

    def truncate(self, n: int) -> None:
        """Forget positions >= n of the attention caches (a rejected draft, a prompt that parts from what the
        cache holds). Recurrent state cannot be cut: the caller restores it from a snapshot."""
        if n > self.n_past:
            raise ValueError(f"cannot truncate a sequence of {self.n_past} positions to {n}")
        for kv in self.kv.values():
            kv.truncate(min(n, kv.length))  # an MTP cache may lag by the catch-up rows its drafter holds back
        self.n_past = n


@dataclass(frozen=True)
class SharedKV:
    """--kv-unified: the full-attention layers' pools, shared by every sequence, and the cells one sequence's
    positions sit in (`CellTable`, filled by whoever hands the pools' cells out)."""

    pools: Mapping[int, KVPool]
    table: CellTable


def padded_context(ctx_size: int, config: ModelConfig) -> int:
    ctx = ctx_size or config.context_length
    return -(-ctx // CTX_PAD) * CTX_PAD


def new_kv_caches(
    config: ModelConfig,
    ctx: int,
    cache_type_k: str,
    cache_type_v: str,
    *,
    ubatch: int = DEFAULT_UBATCH,
    mtp: bool = False,
    devices: Mapping[int, torch.device] | None = None,
    shared: SharedKV | None = None,
    kv_heads: Mapping[int, int] | None = None,
) -> dict[int, KVCache]:
    """Each attention layer's cache, on `devices[layer]` (CPU when not given); with `shared`, the full-attention
    layers' over the shared pools (sliding-window rings stay the sequence's own). `kv_heads`: the heads a
    tensor-parallel rank holds of a layer (`CausalLM.kv_heads`), where not all."""
    layout = config.cache_layout()
    caches = {}
    for spec in layout.mtp_attention if mtp else layout.attention:
        spec = replace(spec, n_kv_heads=(kv_heads or {}).get(spec.layer, spec.n_kv_heads))
        if shared is not None and spec.layer in shared.pools:
            pool = shared.pools[spec.layer]
            caches[spec.layer] = KVCache(ctx, spec.n_kv_heads, spec.k_dim, spec.v_dim, pool=pool, table=shared.table)
            continue
        capacity = ctx
        if spec.sliding_window is not None:
            capacity = min(ctx, -(-(spec.sliding_window + ubatch) // CTX_PAD) * CTX_PAD)
        caches[spec.layer] = KVCache(
            capacity,
            spec.n_kv_heads,
            spec.k_dim,
            spec.v_dim,
            cache_type_k,
            cache_type_v,
            window=spec.sliding_window,
            ring=capacity < ctx,
            device=(devices or {}).get(spec.layer, torch.device("cpu")),
        )
    return caches


@dataclass
class Rope:
    """Positions of a batch's rows and their rotary cos/sin [rows, n_rot // 2]."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    static: bool = False  # positions came as a device tensor (a captured step): caches index by them
    copies: dict[torch.device, Rope] = field(default_factory=dict, repr=False)

    def to(self, device: torch.device) -> Rope:
        """This rope on `device`, copied once per device (every block of a layer split asks for it)."""
        if self.cos.device == device:
            return self
        if device not in self.copies:
            self.copies[device] = Rope(self.positions.to(device), self.cos.to(device), self.sin.to(device), self.static)
        return self.copies[device]


@dataclass
class Batch:
    """One forward pass over several sequences, each adding `n_tokens` tokens: rows s * n_tokens ..
    (s + 1) * n_tokens - 1 of every activation belong to states[s], whose first new token sits at
    position starts[s]. Each sequence is rounded as if evaluated alone (ops.linear's `seq_len`), so
    batching changes no result."""

    tokens: torch.Tensor  # [len(states) * n_tokens]
    states: list[ModelState]
    n_tokens: int
    starts: list[int]
    # A single-sequence prompt batch may ask recurrent layers to keep their state on the way: at the
    # first chunk boundary at or after position `next_checkpoint`, then every `checkpoint_every`
    # tokens after the last one kept. They land in `checkpoints`: position -> layer -> state.
    checkpoint_every: int = 0
    next_checkpoint: int = 0
    checkpoints: dict[int, dict[int, RecurrentState]] = field(default_factory=dict)
    # ... and after these positions (where a later prompt may resume: the prompt cache's), wherever they fall: the
    # CPU's token-by-token recurrence keeps any position without a batch boundary there; the GPU's chunked rule
    # keeps chunk boundaries only (the engine ends a batch at the others)
    keep_at: tuple[int, ...] = ()
    # Draft verification: recurrent layers keep their state after every token of the batch, so a
    # rejected draft rolls back without recomputing: layer -> per sequence [(conv, ssm) per token].
    keep_steps: bool = False
    steps: dict[int, list[Sequence[RecurrentState]]] = field(default_factory=dict)
    # A static step (models.graphs): the positions as a device tensor [n_tokens]; nothing reads a position on the
    # host, and the caller advances the state's counters after the step. Its rows come embedded (`model.embed`,
    # done before the step: the table may live in host memory, which a captured step cannot read).
    positions: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        tokens: torch.Tensor,
        states: list[ModelState],
        checkpoint_every: int = 0,
        next_checkpoint: int = 0,
        keep_at: tuple[int, ...] = (),
    ) -> Batch:
        """Tokens [n_seq * n_tokens] continuing each state at its `n_past`."""
        n_tokens = len(tokens) // len(states)
        starts = [st.n_past for st in states]
        return cls(tokens, states, n_tokens, starts, checkpoint_every, next_checkpoint, keep_at=keep_at)

    def checkpoint_offsets(self, chunk: int) -> list[int]:
        """Offsets into this batch (before its end) where recurrent state is kept: multiples of `chunk` on the
        checkpoint grid, and the `keep_at` positions inside the batch."""
        if len(self.states) != 1:
            return []
        offsets, target = [], self.next_checkpoint
        for n in range(chunk, self.n_tokens, chunk) if self.checkpoint_every else ():
            if self.starts[0] + n >= target:
                offsets.append(n)
                target = self.starts[0] + n + self.checkpoint_every
        extra = [p - self.starts[0] for p in self.keep_at if 0 < p - self.starts[0] < self.n_tokens]
        return sorted({*offsets, *extra})

    def rows(self, s: int) -> slice:
        return slice(s * self.n_tokens, (s + 1) * self.n_tokens)

    def rope(self, table: RopeTable) -> Rope:
        if self.positions is not None:
            return Rope(self.positions, *table.gather(self.positions), static=True)
        if len(self.starts) == 1:
            start = self.starts[0]
            return Rope(
                torch.arange(start, start + self.n_tokens, device=table.device), *table.span(start, self.n_tokens)
            )
        spans = [table.span(start, self.n_tokens) for start in self.starts]
        positions = torch.cat([torch.arange(start, start + self.n_tokens) for start in self.starts]).to(table.device)
        return Rope(positions, torch.cat([c for c, _ in spans]), torch.cat([s for _, s in spans]))

    def advance(self) -> None:
        if self.positions is not None:
            return
        for state in self.states:
            state.n_past += self.n_tokens


class CausalLM:
    """A decoder-only language model; subclasses implement `forward` and `new_state`."""

    config: ModelConfig
    token_embd: QTensor  # [n_vocab, n_embd]
    output_norm: torch.Tensor
    output: QTensor  # LM head [n_vocab, n_embd]
    ubatch: int = DEFAULT_UBATCH
    device: torch.device = torch.device("cpu")  # where activations start (the embedding's device)
    layer_devices: Mapping[int, torch.device] = MappingProxyType({})  # blocks not on `device` (a layer split)
    kv_heads: Mapping[int, int] = MappingProxyType({})  # a tensor-parallel rank's KV heads of a layer, where not all

    def device_of(self, layer: int) -> torch.device:
        return self.layer_devices.get(layer, self.device)

    tensor_parallel: bool = False  # a rank's share (--split-mode row): its passes exchange with the other ranks'

    def _place(self, weights: WeightStore) -> None:
        """Take the devices the weights were loaded to, and whether they are a tensor-parallel rank's share."""
        self.device, self.layer_devices = weights.device, dict(weights.layer_devices)
        self.tensor_parallel = weights.partition.split

    @property
    def devices(self) -> set[torch.device]:
        """Every device that computes part of a forward pass."""
        return {self.device, *self.layer_devices.values()}

    def _output_layer(self, w: WeightStore) -> QTensor:
        """The LM head: `output.weight`, or the embedding table it is tied to; for a tensor-parallel rank its rows of
        the vocabulary, the logits gathered."""
        c, name = self.config, "token_embd.weight" if self.config.tied_embeddings else "output.weight"
        if w.partition.split:
            return w.matrix(name, **vocab_share(w.partition, c.n_vocab))
        return self.token_embd if c.tied_embeddings else w.matrix(name)

    def _layer_device_map(self) -> dict[int, torch.device]:
        n_layer = getattr(self.config, "n_layer", 0) + getattr(self.config, "n_nextn", 0)
        return {i: self.device_of(i) for i in range(n_layer)}

    def forward_batch(self, batch: Batch) -> torch.Tensor:
        """Evaluate a batch and advance its states. Returns the final normalized hidden states
        [rows, n_embd]."""
        x = self.forward_layers(self._inputs(batch), batch, range(self.config.n_layer))
        batch.advance()
        return self.final_norm(x)

    def forward_layers(self, x: torch.Tensor, batch: Batch, layers: range) -> torch.Tensor:
        """Blocks `layers` in order over x [rows, n_embd], each on its device (a captured step runs a run of
        blocks of one device this way: models.graphs). This one is for blocks called as (x, rope, batch) with
        one rope table (`rope_table`); Gemma 3 has two."""
        rope = batch.rope(self.rope_table)  # type: ignore[attr-defined]
        blocks = self.layers[layers.start : layers.stop]  # type: ignore[attr-defined]
        if not self.layer_devices:  # one device: no per-block moves to ask for (a small model's decode notices)
            x = x.to(self.device)  # the embedding table may stay on the host (llama.cpp's placement, ours too)
            for layer in blocks:
                x = layer(x, rope, batch)
            return x
        for layer in blocks:
            device = self.device_of(layer.index)
            x = layer(x.to(device), rope.to(device), batch)
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        eps: float = self.config.rms_eps  # type: ignore[attr-defined]
        return rms_norm(x.to(self.output_norm.device), self.output_norm, eps)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows for tokens [T] (float32 [T, n_embd], where the table lives)."""
        return embedding(self.token_embd, tokens)

    def _inputs(self, batch: Batch) -> torch.Tensor:
        return self.embed(batch.tokens) if batch.embeddings is None else batch.embeddings

    def forward(self, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
        """Evaluate tokens [T] of one sequence at positions state.n_past.. (hidden states [T, n_embd])."""
        return self.forward_batch(Batch.of(torch.as_tensor(tokens, dtype=torch.long), [state]))

    def new_state(
        self, ctx_size: int = 0, cache_type_k: str = "f16", cache_type_v: str = "f16", *, shared: SharedKV | None = None
    ) -> ModelState:
        raise NotImplementedError

    def new_kv_pools(
        self, n_cells: int, cache_type_k: str = "f16", cache_type_v: str = "f16", mtp: bool = False
    ) -> dict[int, KVPool]:
        """--kv-unified: a pool of `n_cells` for each full-attention layer (and the MTP block's, with `mtp`), each on
        its layer's device; `new_state(shared=...)` makes sequences over them."""
        layout = self.config.cache_layout()
        devices = self._layer_device_map()
        heads = lambda s: self.kv_heads.get(s.layer, s.n_kv_heads)  # noqa: E731
        return {
            s.layer: KVPool(n_cells, heads(s), s.k_dim, s.v_dim, cache_type_k, cache_type_v, devices[s.layer])
            for s in (*layout.attention, *(layout.mtp_attention if mtp else ()))
            if s.sliding_window is None
        }

    def logits(self, hidden: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Logits [rows, V] on the CPU, where the sampler runs."""
        return self.logits_on_device(hidden, seq_len).cpu()

    def logits_on_device(self, hidden: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Logits [rows, V] where the LM head lives."""
        return linear(hidden.to(self.output.data.device), self.output, seq_len=seq_len)

    @torch.inference_mode()
    def prefill(
        self, tokens: list[int] | torch.Tensor, state: ModelState, all_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        """Evaluate a prompt in chunks of `ubatch` tokens. Returns the logits of the last token [V], or
        with `all_logits` those of tokens logits_from.. [T - logits_from, V]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if state.n_past + len(tokens) > state.capacity:
            raise ValueError(f"{state.n_past + len(tokens)} tokens exceed the context size {state.capacity}")
        outs = []
        for start in range(0, len(tokens), self.ubatch):
            chunk = tokens[start : start + self.ubatch]
            hidden = self.forward(chunk, state)
            if all_logits:
                skip = max(0, logits_from - start)
                if skip < len(hidden):
                    outs.append(self.logits(hidden[skip:]))
            else:
                outs.append(hidden[-1:])
        return torch.cat(outs) if all_logits else self.logits(outs[-1])[0]

    @torch.inference_mode()
    def decode(self, token: int, state: ModelState) -> torch.Tensor:
        """Evaluate one token; its logits [V]."""
        return self.decode_batch([token], [state])[0]

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], states: list[ModelState]) -> torch.Tensor:
        """One new token for each of several sequences, in one forward pass; logits [n_seq, V], each row
        what `decode` would give for its sequence alone."""
        for state in states:
            if state.n_past + 1 > state.capacity:
                raise ValueError(f"context size {state.capacity} is full")
        if (out := self.program_decode(tokens, states, logits=True)) is not None:
            return out[1].cpu()
        return self.logits(self.forward_batch(Batch.of(torch.tensor(tokens), states)), seq_len=1)

    def program_decode(
        self,
        tokens: list[int],
        states: list[ModelState],
        steps: dict[int, list[Sequence[RecurrentState]]] | None = None,
        logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The next len(tokens) / len(states) tokens (1 to 8: a decode, or a draft's verification) of each sequence
        through the CPU decode program (one C call for the embedding, every block of every sequence, the final norm
        and the output layer: ops.decode_program): the final-normed hidden states [len(tokens), n_embd] and with
        `logits` their float32 logits (`logits_on_device`'s, each sequence rounded as if alone), or None where the
        program cannot serve one of them (`decode_program`, a ring a rollback left cells empty in, a full context,
        no C head: `decode_head`); the layer path then does, to the same bits. With `steps`, each DeltaNet layer's
        states after every token go there as `Batch.steps` keeps them."""
        if gpu_path(self.output_norm) or (head := self.decode_head()) is None:  # GPU (or emulated), or no C head
            return None
        T = len(tokens) // len(states)
        programs = [self.decode_program(state) for state in states]
        if not all(p is not None and p.ready(s.n_past, T) for p, s in zip(programs, states)):
            return None
        tables = self.decode_rope_tables()
        ropes = [[table.span(state.n_past, T) for table in tables] for state in states]
        kept = None
        if steps is not None:  # per DeltaNet layer in order (the program's blocks), then per sequence
            layers = sorted(states[0].recurrent)
            kept_ssm = [torch.empty(T, *s.recurrent[i].ssm.shape) for i in layers for s in states]
            kept_conv = [torch.empty(T, *s.recurrent[i].conv.shape) for i in layers for s in states]
            kept = kept_ssm, kept_conv
        in_c = logits and head.n_vocab > 0
        positions = [state.n_past for state in states]
        hidden, out = run_decode_pass(head, programs, tokens, positions, ropes, kept, in_c)  # type: ignore[arg-type]
        for state in states:
            state.n_past += T
        if kept is not None:
            n = len(states)
            for g, layer in enumerate(layers):
                per_sequence = zip(kept_conv[g * n : (g + 1) * n], kept_ssm[g * n : (g + 1) * n])
                steps[layer] = [KeptSteps(conv, ssm) for conv, ssm in per_sequence]
        if logits and not in_c:
            out = self.logits_on_device(hidden, T).float()
        return hidden, out

    embed_scale: float = 1.0  # the token table's rows times this on the way in (Gemma's sqrt(n_embd))

    def head_is_product(self) -> bool:
        """Whether the logits are the output layer's product as it is (Gemma's soft-capping says otherwise): a
        whole decode pass then makes them in C."""
        return True

    def decode_head(self) -> DecodeHead | None:
        """The token table, final norm and output layer as a whole decode pass reads them (ops.decode_program), made
        at first use; None where the table or final norm is not the C kernels' to read (a type they lack, a
        tensor-parallel share), no output layer (n_vocab 0) where only that one is not, or the logits are not its
        plain product."""
        if not hasattr(self, "_decode_head"):
            table, out, eps = self.token_embd, self.output, self.config.rms_eps  # type: ignore[attr-defined]
            on_cpu = lambda w: w.data.device.type == "cpu" and kernel_supports(w)  # noqa: E731
            self._decode_head = None
            if on_cpu(table) and self.output_norm.device.type == "cpu":
                head = on_cpu(out) and self.head_is_product()
                self._decode_head = DecodeHead(
                    int(table.ggml_type), table.data.data_ptr(), table.shape[0], self.embed_scale,
                    self.output_norm.data_ptr(), eps, int(out.ggml_type) if head else 0,
                    out.data.data_ptr() if head else None, out.shape[0] if head else 0, table.shape[1],
                )  # fmt: skip
        return self._decode_head

    def decode_program(self, state: ModelState) -> DecodeProgram | None:
        """The CPU decode step over `state` as one C call (ops.decode_program), built at the state's first decode;
        None where a block cannot take part (GPU or split devices, quantized or shared KV caches, weights the
        kernels lack): the layer-by-layer path then serves."""
        return self.program_over(state, "trunk", self.layers)  # type: ignore[attr-defined]

    def program_over(self, state: ModelState, name: str, layers: Sequence) -> DecodeProgram | None:
        """The decode program of `layers` over `state`'s caches, kept in `state.programs[name]` from its first use;
        None where a block cannot take part."""
        if name not in state.programs:
            state.programs[name] = self._build_program(state, layers) or False
        return state.programs[name] or None

    def _build_program(self, state: ModelState, layers: Sequence) -> DecodeProgram | None:
        if self.layer_devices or self.tensor_parallel or self.device.type != "cpu":
            return None
        blocks = []
        for layer in layers:
            layer_blocks = layer.decode_blocks(state) if hasattr(layer, "decode_blocks") else None
            if layer_blocks is None:
                return None
            blocks += layer_blocks
        caches = [state.kv[layer.index] for layer in layers if layer.index in state.kv]
        capacity = min([kv.capacity for kv in caches if not kv.ring] + [state.capacity])
        return DecodeProgram(blocks, caches, [kv for kv in caches if kv.ring], capacity)

    def decode_rope_tables(self) -> list[RopeTable]:
        """The RoPE tables a decode program's attention blocks index (`rope` of ops.decode_program's blocks)."""
        return [self.rope_table]  # type: ignore[attr-defined]
