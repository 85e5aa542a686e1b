"""A CPU decode step's blocks in one C call (`mtp_run_blocks`, kernels/cpu/blocks.c): 1-8 tokens of each of one or
more sequences (a decode, a draft's verification).

On a small model the Python around a token's ~20 kernel calls (argument checks, ctypes conversions, the layer loop)
costs as much as their arithmetic: tinyqwen35 spent ~45 % of a token there. Each block's one-call entry point (the
residual attention, Gated DeltaNet mixer and gated FFN of `blocks.c`) takes its constant arguments from a struct
built once per sequence state (the weights' pointers and the state's own cache and recurrent tensors, fixed for the
state's life); what changes per token (the position, its RoPE rows, the attention's cache view) is one `Step`. The
program runs exactly the calls the layers would make one by one: the same numbers, bit for bit (the tests hold
both). A model builds its program from its layers (`CausalLM.decode_program`); a layer that cannot take part
(quantized or shared KV cache, a ring past its first wrap, a weight the kernels lack) leaves the step to the
layer-by-layer path.

The structs mirror blocks.c's field for field: ctypes lays them out with the C compiler's alignment rules.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from ..kernels import cpu as cpu_kernels
from .attention import decode_cache_view
from .sampling_chain import ChainParams, ChainShape

_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

BLOCK_ATTENTION, BLOCK_GDN, BLOCK_FFN = 0, 1, 2


class Step(ctypes.Structure):
    """What changes per token: each RoPE table's row for the position, the position, the attention's cache view."""

    _fields_ = [
        ("cos", _ptr * 2),
        ("sin", _ptr * 2),
        ("n_rot", _i64 * 2),
        ("start", _i64),
        ("n_cells", _i64),
        ("n_split", _i64),
        ("ring_n_cells", _i64),
        ("ring_n_split", _i64),
    ]


class AttentionBlock(ctypes.Structure):
    _fields_ = [
        ("norm_w", _ptr),
        ("eps", _f32),
        ("qkv_types", _ptr),
        ("qkv_W", _ptr),
        ("H", _i64),
        ("Hkv", _i64),
        ("D", _i64),
        ("q_gated", _int),
        ("neox", _int),
        ("rope", _int),
        ("kv_f16", _int),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("q_scale", _f32),
        ("scale", _f32),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("cell_pos", _ptr),
        ("window", _i64),
        ("t_out", _int),
        ("w_out", _ptr),
        ("post_norm", _ptr),
        ("ring", _i64),
    ]
    kind = BLOCK_ATTENTION


class GDNBlock(ctypes.Structure):
    _fields_ = [
        ("norm_w", _ptr),
        ("eps", _f32),
        ("types", _ptr),
        ("W", _ptr),
        ("dt_bias", _ptr),
        ("a", _ptr),
        ("conv_w", _ptr),
        ("ssm_norm_w", _ptr),
        ("conv_state", _ptr),
        ("ssm", _ptr),
        ("Hk", _i64),
        ("Hv", _i64),
        ("K", _i64),
        ("V", _i64),
        ("n_conv", _i64),
        ("ssm_eps", _f32),
        ("t_out", _int),
        ("w_out", _ptr),
    ]
    kind = BLOCK_GDN


class FFNBlock(ctypes.Structure):
    _fields_ = [
        ("norm_w", _ptr),
        ("eps", _f32),
        ("gelu", _int),
        ("t_gate", _int),
        ("t_up", _int),
        ("t_down", _int),
        ("w_gate", _ptr),
        ("w_up", _ptr),
        ("w_down", _ptr),
        ("F", _i64),
        ("post_w", _ptr),
    ]
    kind = BLOCK_FFN


class _Block(ctypes.Structure):
    _fields_ = [("kind", _int), ("args", _ptr)]


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeProgram:
    """A sequence state's decode step as one call over its blocks (attention, GDN, FFN structs, in layer order).
    `ring_caches`: KV caches that reuse cells once full (Gemma's sliding layers), usable while cell = position;
    `capacity`: positions the ordered caches hold."""

    def __init__(self, blocks: Sequence[ctypes.Structure], caches: Sequence, ring_caches: Sequence, capacity: int):
        self.blocks = list(blocks)  # kept alive: the C side reads them through raw pointers
        self.table = (_Block * len(blocks))(*[_Block(b.kind, ctypes.addressof(b)) for b in blocks])
        self.caches, self.ring_caches, self.capacity = list(caches), list(ring_caches), capacity
        if len({kv.capacity for kv in self.ring_caches}) > 1:
            raise ValueError("a decode program's rings must all be one size (the step has one view of them)")
        self.ring = self.ring_caches[0].capacity if self.ring_caches else 0

    def ready(self, position: int, n_tokens: int = 1) -> bool:
        """Whether tokens at position.. can take the program: within its caches, and every ring without cells a
        rollback emptied (the layer path reads a ring's filled cells only) once it has wrapped."""
        end = position + n_tokens
        rings_whole = all(end <= kv.capacity or not kv.has_holes for kv in self.ring_caches)
        return n_tokens <= MAX_TOKENS and end <= self.capacity and rings_whole

    def advance(self, end: int) -> None:
        """Each KV cache now holds positions up to `end` (the C side wrote their cells)."""
        for kv in self.caches:
            kv.length = end


MAX_TOKENS = 8  # tokens a sequence a program call takes (mtp_run_blocks; a draft's verification at most)


Ropes = Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]
Kept = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


def run_programs(
    programs: Sequence[DecodeProgram], x: torch.Tensor, positions: Sequence[int], ropes: Ropes, kept: Kept | None = None
) -> torch.Tensor:
    """T tokens of each of one or more sequences (their programs, over one model's blocks) in one call: x [n_seq T,
    E] (the tokens' embeddings, a fresh float32 tensor: updated in place), sequence s's rows through `programs[s]`
    at `positions[s]`..; `ropes[s]`: cos, sin [T, n_rot / 2] of those positions from each table the attention
    blocks name. `kept` (ssm, conv): per DeltaNet block in order, then per sequence, buffers [T, *state shape] that
    receive the states after every token. The matmuls take all rows at once; every sequence's numbers are those of
    it stepped alone."""
    T = x.shape[0] // len(programs)
    tables, steps, kept_ptrs = _call_args(programs, T, positions, ropes, kept)
    rc = cpu_kernels.load().mtp_run_blocks(
        tables, len(programs), T, len(programs[0].blocks), x.data_ptr(), x.shape[-1], steps, *kept_ptrs,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"mtp_run_blocks failed ({rc})")
    for program, position in zip(programs, positions):
        program.advance(position + T)
    return x


class DecodeHead(ctypes.Structure):
    """What a whole decode pass reads around its blocks (blocks.c mtp_decode_head): the token table (its rows times
    `embed_scale` where that is not 1: Gemma's), the final norm and the output layer."""

    _fields_ = [
        ("t_table", _int),
        ("table", _ptr),
        ("n_table", _i64),
        ("embed_scale", _f32),
        ("out_norm", _ptr),
        ("eps", _f32),
        ("t_out", _int),
        ("out", _ptr),
        ("n_vocab", _i64),
        ("E", _i64),
    ]


def run_decode_pass(
    head: DecodeHead,
    programs: Sequence[DecodeProgram],
    tokens: Sequence[int],
    positions: Sequence[int],
    ropes: Ropes,
    kept: Kept | None = None,
    logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`run_programs` with the model's first and last steps in the same call (blocks.c mtp_decode_pass): tokens
    [n_seq T] (sequence s's T at positions[s]..) looked up in `head`'s table, and back the final-normed hidden states
    [n_seq T, E] and, with `logits`, the output layer's float32 logits [n_seq T, n_vocab] (each sequence rounded as
    if alone): the layer path's embedding, blocks, final norm and `linear`, the same bits, with no Python between."""
    T = len(tokens) // len(programs)
    tables, steps, kept_ptrs = _call_args(programs, T, positions, ropes, kept)
    ids = (ctypes.c_int64 * len(tokens))(*tokens)
    x = torch.empty(len(tokens), head.E)
    out = torch.empty(len(tokens), head.n_vocab) if logits else None
    rc = cpu_kernels.load().mtp_decode_pass(
        ctypes.byref(head), tables, len(programs), T, len(programs[0].blocks), ids, x.data_ptr(), steps, *kept_ptrs,
        None if out is None else out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"token id out of range [0, {head.n_table}) for the token table")
    if rc != 0:
        raise RuntimeError(f"mtp_decode_pass failed ({rc})")
    for program, position in zip(programs, positions):
        program.advance(position + T)
    return x, out


def _call_args(programs: Sequence[DecodeProgram], T: int, positions: Sequence[int], ropes: Ropes, kept: Kept | None):
    """The C call's per-sequence arguments: the block tables, the steps and the kept states' buffers (ctypes arrays,
    kept alive by the caller for the call)."""
    n_seq = len(programs)
    steps = (Step * n_seq)()
    for step, position, rope, program in zip(steps, positions, ropes, programs, strict=True):
        _set_step(step, position, T, rope, program.ring)
    tables = (_ptr * n_seq)(*[ctypes.addressof(p.table) for p in programs])
    kept_ptrs: list = [None, None]
    if kept is not None:
        kept_ptrs = [(_ptr * len(buffers))(*[b.data_ptr() for b in buffers]) for buffers in kept]
    return tables, steps, kept_ptrs


def _set_step(
    st: Step, position: int, n_tokens: int, ropes: Sequence[tuple[torch.Tensor, torch.Tensor]], ring: int = 0
) -> None:
    for i, (cos, sin) in enumerate(ropes):
        st.cos[i], st.sin[i], st.n_rot[i] = cos.data_ptr(), sin.data_ptr(), 2 * cos.shape[-1]
    st.start = position
    st.n_cells, st.n_split = decode_cache_view(position + n_tokens, n_tokens)
    if ring:  # a ring's filled cells: all of them once it has wrapped
        st.ring_n_cells, st.ring_n_split = decode_cache_view(min(position + n_tokens, ring), n_tokens)


class DraftModel(ctypes.Structure):
    """What `mtp_draft_chain` reads (blocks.c mtp_draft_model): the NextN block's token table, input norms and
    eh_proj, the block's program table, its final norm and the draft head's rows."""

    _fields_ = [
        ("t_table", _int),
        ("table", _ptr),
        ("n_table", _i64),
        ("enorm", _ptr),
        ("hnorm", _ptr),
        ("out_norm", _ptr),
        ("eps", _f32),
        ("t_eh", _int),
        ("eh", _ptr),
        ("blocks", _ptr),
        ("n_blocks", _i64),
        ("t_head", _int),
        ("head", _ptr),
        ("n_head", _i64),
        ("E", _i64),
    ]


class DraftDraws(ctypes.Structure):
    """What a drawn chain reads and writes (blocks.c mtp_draft_draws)."""

    _fields_ = [
        ("n_top", _i64),
        ("min_keep", _i64),
        ("top_p", _f32),
        ("temperature", _f32),
        ("log_min_p", ctypes.c_double),
        ("uniforms", _ptr),
        ("out_ids", _ptr),
        ("out_probs", _ptr),
        ("out_kept", _ptr),
        ("banned", _ptr),
        ("n_banned", _i64),
    ]


class DrawnChain:
    """Drafts drawn in the C chain from the request's sampler chain (blocks.c chain_draw, the CPU twin of
    ops.sampling_chain): its shape and parameters in, and `random` for one uniform a step, taken only once the
    chain runs; each step's distribution out (`distributions`), the survivors in the chain's order."""

    def __init__(self, shape: ChainShape, chain: ChainParams, random: Callable[[], float]) -> None:
        self.shape, self.chain, self.random = shape, chain, random

    def take_uniforms(self, n_steps: int) -> DraftDraws:
        """The struct the C chain reads, with n_steps uniforms drawn now."""
        c, n_top = self.chain, self.shape.n_top
        self.uniforms = torch.tensor([self.random() for _ in range(n_steps)], dtype=torch.float64)
        self.ids = torch.zeros(n_steps, n_top, dtype=torch.int64)
        self.probs = torch.zeros(n_steps, n_top, dtype=torch.float64)
        self.kept = torch.zeros(n_steps, dtype=torch.int64)
        self.banned = torch.tensor(c.banned, dtype=torch.int64)
        return DraftDraws(
            n_top, self.shape.min_keep, c.top_p_bound, c.temperature, c.log_min_p,
            *(t.data_ptr() for t in (self.uniforms, self.ids, self.probs, self.kept, self.banned)), len(c.banned),
        )  # fmt: skip

    def distributions(self, n_steps: int) -> list[dict[int, float]]:
        ids, probs, kept = self.ids.tolist(), self.probs.tolist(), self.kept.tolist()
        return [dict(zip(ids[s][: kept[s]], probs[s][: kept[s]])) for s in range(n_steps)]


def run_draft_chain(
    model: DraftModel,
    program: DecodeProgram,
    hidden: torch.Tensor,
    tokens: Sequence[int],
    start: int,
    n_steps: int,
    rope_spans,
    top_k: int,
    p_min: float,
    out_row: torch.Tensor | None = None,
    out_hidden: torch.Tensor | None = None,
    draws: DrawnChain | None = None,
) -> list[tuple[int, float]]:
    """Up to n_steps chained MTP drafts in one call (blocks.c mtp_draft_chain): step 0 over `tokens` [T0] paired with
    `hidden` [T0, E] at positions start.., each later step over the previous draft at the next position. Returns
    (token, softmax of its logit over the top_k) per step run; the chain stops after the first below p_min. The
    block's cache then holds every step's row (its length advanced past them; the drafter cuts it back).
    `rope_spans(position, n)`: each RoPE table's (cos, sin) rows for n positions from `position`; n_steps >= 1.
    `out_row` [n_head], `out_hidden` [E] (float32, contiguous): filled with the last step's head row and output.
    `draws` (a uniform for each of n_steps): each token drawn from the request's chain, not the argmax; the p
    returned stays the argmax's."""
    T0 = len(tokens)
    positions = [start] + [start + T0 + s for s in range(n_steps - 1)]
    steps = (Step * n_steps)()
    for step, position, n in zip(steps, positions, [T0] + [1] * (n_steps - 1)):
        _set_step(step, position, n, rope_spans(position, n))
    hidden = hidden.float().contiguous()
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    out_tokens, out_p, n_done = (ctypes.c_int64 * n_steps)(), (_f32 * n_steps)(), ctypes.c_int64()
    model.blocks, model.n_blocks = ctypes.addressof(program.table), len(program.blocks)
    rc = cpu_kernels.load().mtp_draft_chain(
        ctypes.byref(model), hidden.data_ptr(), ids.data_ptr(), T0, ctypes.addressof(steps), n_steps, top_k, p_min,
        out_tokens, out_p, ctypes.byref(n_done), ptr(out_row), ptr(out_hidden),
        None if draws is None else ctypes.byref(draws.take_uniforms(n_steps)), torch.get_num_threads(),
    )  # fmt: skip
    if rc == 3:
        raise IndexError(f"token id out of range [0, {model.n_table}) for the MTP block's token table")
    if rc != 0:
        raise RuntimeError(f"mtp_draft_chain failed ({rc})")
    program.advance(start + T0 + n_done.value - 1)  # past the last step's row
    return [(int(out_tokens[s]), float(out_p[s])) for s in range(n_done.value)]
