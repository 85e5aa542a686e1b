"""Drafters: what proposes the tokens a speculative step verifies (../shared/spec/mtp-speculative-decoding.md).
Each implements `Drafter` and owns whatever state it keeps per slot; the engine holds one drafter or none.

* `draft-mtp` (`MTPDrafter`): the model's own MTP block, chained: step 0 reads (sampled token, trunk hidden state
  of the position before it), each next step the MTP's own output hidden state; the draft is the argmax of each
  step (a draft stops early when that token's probability, renormalised over the top 10, is below `p_min`;
  drafts shorter than `n_min` are dropped). The MTP KV cache only ever keeps rows computed from the trunk's
  hidden states: draft step 0's row is one (the sampled token and the trunk's state before it) and stays; the
  chained steps' rows go. After a verification only the accepted drafts' rows are missing ("catch-up"); they
  wait and go in the same MTP pass as the next draft's step 0 -- or are written before the slot's cache is
  reused or cut, so that the MTP cache ends where the trunk's does when a request starts. llama.cpp recomputes
  every verified row, step 0's and the rejected drafts' included, in a pass of its own
  (`TAG_SPEC_AVOID_DRAFT_REEVAL` in its source): with few drafts accepted that pass is a third of the MTP work.
* `draft-simple` (`DraftModelDrafter`): a separate small model with the same vocabulary (`--model-draft`),
  greedy, one token at a time from its own state, which catches up on the accepted tokens before each draft
  and returns to them afterwards (its recurrent state, if any, from a snapshot).
* `ngram` (`NGramDrafter`): prompt lookup: the continuation of the latest earlier occurrence of the context's
  last n tokens (n from `ngram_size` down to 1). No model, no state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..models.base import CausalLM, ModelState
from ..models.draft_head import DraftHead, shortlist_pays
from ..models.graphs import MTPDraftGraph, MTPDrawGraph, MTPRowsGraph
from ..models.mtp import mtp_graphable, mtp_model
from ..ops.decode_program import DrawnChain
from ..ops.linear import linear
from ..ops.sampling_chain import ChainParams, ChainShape
from ..tokenizer import Tokenizer
from .config import SpecConfig
from .errors import InvalidRequest
from .rejection import DraftPicker
from .slots import Reuse, Slot

log = logging.getLogger("mtpserve.engine")

DRAFT_TOP_K = 10  # p_min is measured against the draft's top-10, renormalised (llama.cpp)


class Drafter(Protocol):
    """Proposes tokens for a slot's next verification and keeps its own per-slot state in step with the slot."""

    def draft(self, slot: Slot, n_max: int, picker: DraftPicker | None = None) -> list[int]:
        """Up to n_max tokens to follow the slot's sampled, not yet evaluated token (`slot.job.pending`); with a
        `picker` (probabilistic drafting: draft-mtp, draft-simple), each token drawn through it."""
        ...

    def after_prompt(self, slot: Slot, hidden: torch.Tensor, tokens: list[int]) -> None:
        """A prompt chunk of the slot was evaluated: `tokens`, with the trunk's final hidden states [T, E]."""
        ...

    def after_verify(self, slot: Slot, hidden: torch.Tensor, tokens: list[int], n_accepted: int) -> None:
        """A verification evaluated `tokens` ([sampled, *draft]; hidden [T, E]), of whose drafts `n_accepted` are
        kept; the caller then cuts the slot's caches back to them."""
        ...

    def finish(self, slot: Slot) -> None:
        """The slot's request ended: what the slot holds stays for the next request's prefix reuse."""
        ...

    def rewind(self, slot: Slot, reuse: Reuse) -> None:
        """The slot's caches were cut back to `reuse.keep` tokens for a new request (0: cleared)."""
        ...

    def pending_hidden(self, slot: Slot) -> torch.Tensor | None:
        """The trunk's hidden state the idle slot's next MTP row reads (None: a drafter that keeps none)."""
        ...


class NullHooks:
    """The hooks of a drafter that keeps nothing in step with the slots."""

    def after_prompt(self, slot: Slot, hidden: torch.Tensor, tokens: list[int]) -> None:
        pass

    def after_verify(self, slot: Slot, hidden: torch.Tensor, tokens: list[int], n_accepted: int) -> None:
        pass

    def finish(self, slot: Slot) -> None:
        pass

    def rewind(self, slot: Slot, reuse: Reuse) -> None:
        pass

    def pending_hidden(self, slot: Slot) -> torch.Tensor | None:
        return None


def make_drafter(
    spec: SpecConfig, model: CausalLM, tokenizer: Tokenizer, graphs: bool, draft_model: CausalLM | None, ubatch: int
) -> Drafter | None:
    """The drafter `spec` asks for (None: no speculation). draft-simple's model is loaded here unless given."""
    if not spec.enabled:
        return None
    if spec.type == "draft-mtp":
        return MTPDrafter(model, spec, graphs)
    if spec.type == "ngram":
        return NGramDrafter(spec)
    assert spec.draft_model is not None  # SpecConfig checks it
    from ..models.loader import load

    check_draft_vocab(tokenizer, Tokenizer.from_gguf(spec.draft_model))
    return DraftModelDrafter(draft_model or load(spec.draft_model), spec, ubatch)


# --- draft-mtp -----------------------------------------------------------------------------------------


@dataclass
class _MTPSlot:
    """What the MTP drafter keeps for one slot."""

    pending_h: torch.Tensor | None = None  # the trunk's hidden state at position n_past - 1
    backlog: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)  # catch-up rows not written yet
    drafted: bool = False  # the MTP cache holds the sampled token's row (draft step 0), not yet verified
    draft_graphs: dict[int, MTPDraftGraph] = field(default_factory=dict)  # chained draft steps, by n_max
    draw_graphs: dict[tuple[int, ChainShape], MTPDrawGraph] = field(default_factory=dict)  # drawn ones, by shape
    rows_graphs: dict[int, MTPRowsGraph] = field(default_factory=dict)  # catch-up passes, by rows


def draft_head(model: CausalLM, config: SpecConfig) -> DraftHead:
    """What scores the MTP drafts (--spec-draft-head): the MTP head, or its first --spec-draft-vocab rows (BPE
    vocabularies put frequent tokens first: a view of the same weights), alone or with a Q4_0 copy shortlisting for
    it (models.draft_head). `auto` makes the copy for a head on a GPU where it reads a quarter fewer bytes; the
    CPU's greedy drafts run as one C call over the whole head. The trunk still verifies over the whole vocabulary."""
    mtp = mtp_model(model)
    assert mtp is not None
    head = mtp.mtp_head.first_rows(config.draft_vocab) if config.draft_vocab else mtp.mtp_head
    if config.draft_head == "q4_0":
        try:
            return DraftHead.shortlisting(head)
        except ValueError as e:  # rows that do not fill q4_0 blocks
            raise InvalidRequest(f"--spec-draft-head q4_0: {e}") from None
    on_gpu = head.data.device.type == "cuda" and not model.tensor_parallel
    if config.draft_head == "auto" and on_gpu and shortlist_pays(head):
        return DraftHead.shortlisting(head)
    return DraftHead(head)


class MTPDrafter:
    def __init__(self, model: CausalLM, config: SpecConfig, graphs: bool = False) -> None:
        mtp = mtp_model(model)
        if mtp is None:
            raise InvalidRequest(
                "--spec-type draft-mtp needs a model with an MTP block (nextn_predict_layers > 0); this one has none"
            )
        n_vocab = model.config.n_vocab
        if config.draft_vocab and not DRAFT_TOP_K <= config.draft_vocab <= n_vocab:
            raise InvalidRequest(
                f"--spec-draft-vocab {config.draft_vocab}: use 0 (the whole vocabulary) or {DRAFT_TOP_K}..{n_vocab} "
                f"(drafts are scored over their top {DRAFT_TOP_K})"
            )
        assert mtp.mtp_kv_index is not None
        self.model, self.mtp, self.config, self.kv_index = model, mtp, config, mtp.mtp_kv_index
        self.graphs = graphs and mtp_graphable(model)
        self.head = draft_head(model, config)
        if self.head.coarse is not None:
            log.info(
                "draft-mtp: drafts scored by a %s copy of the head (%.1f MiB), its top %d ranked by the head itself "
                "(--spec-draft-head full: the head alone)",
                self.head.coarse.ggml_type.name,
                self.head.coarse.nbytes / 2**20,
                self.head.shortlist,
            )
        self._slots: dict[int, _MTPSlot] = {}

    def _of(self, slot: Slot) -> _MTPSlot:
        return self._slots.setdefault(slot.id, _MTPSlot())

    def draft(self, slot: Slot, n_max: int, picker: DraftPicker | None = None) -> list[int]:
        """Up to n_max chained draft tokens after the sampled token (at position n_past). Step 0's row stays in the
        MTP cache (it is the catch-up row of the sampled token); the later steps' rows go. Captured, all n_max
        steps run, and the tokens after the first one below p_min are dropped on the host: the same draft, as
        later steps cannot change earlier ones. With a `picker` (probabilistic drafting) each step's token is
        drawn from its chain and fed to the next step: captured on a GPU, or in the C chain on the CPU, where they
        can run the chain (`DraftPicker.device_chain`), taking n_max uniforms from the draft stream first (steps
        drawn on the host take one a step, and none after a p_min stop)."""
        assert slot.job is not None
        mine = self._of(slot)
        kv = slot.state.kv[self.kv_index]
        sampled = slot.job.pending
        pending_h = mine.pending_h if mine.pending_h is not None else torch.zeros(self.model.config.n_embd)
        proposals: Iterable[tuple[int, float]]
        chain = picker.device_chain(self.head.exact.shape[0]) if self.graphs and picker is not None else None
        if self.graphs and (picker is None or chain is not None):
            self._flush(slot, mine)
            start = kv.length
            if picker is None or chain is None:
                if n_max not in mine.draft_graphs:
                    mine.draft_graphs[n_max] = MTPDraftGraph(self.model, slot.state, n_max, self.head, DRAFT_TOP_K)
                proposals = mine.draft_graphs[n_max].propose(pending_h, sampled)
            else:
                proposals = self._drawn(slot, mine, n_max, picker, chain, pending_h, sampled)
            kv.length = start + 1  # the captured steps leave the length to the caller; step 0's row stays
        else:
            waiting, tokens = self._take_backlog(mine)  # written in step 0's pass
            start = kv.length + len(tokens)
            hidden = pending_h[None] if waiting is None else torch.cat((waiting, pending_h[None]))
            proposals = self._proposals(slot.state, hidden, [*tokens, sampled], n_max, picker)
        draft: list[int] = []
        for token, p_top in proposals:
            if self.config.p_min > 0 and p_top < self.config.p_min:
                break
            draft.append(token)
        kv.truncate(start + 1)
        mine.drafted = True
        return draft if len(draft) >= self.config.n_min else []

    def _drawn(
        self,
        slot: Slot,
        mine: _MTPSlot,
        n_max: int,
        picker: DraftPicker,
        chain: tuple[ChainShape, ChainParams],
        hidden: torch.Tensor,
        sampled: int,
    ) -> list[tuple[int, float]]:
        """The captured draws' tokens, each recorded with the distribution it was drawn from (a draft cut short
        by p_min uses the first of them: the rest have no penalties or grammar to undo, which the chain excludes)."""
        shape, params = chain
        if (n_max, shape) not in mine.draw_graphs:
            graph = MTPDrawGraph(self.model, slot.state, n_max, self.head, DRAFT_TOP_K, shape)
            mine.draw_graphs[n_max, shape] = graph
        uniforms = [picker.rng.random() for _ in range(n_max)]
        drawn = mine.draw_graphs[n_max, shape].draw(hidden, sampled, params, uniforms)
        for token, _, q in drawn:
            picker.record(token, q)
        return [(token, p_top) for token, p_top, _ in drawn]

    def _proposals(
        self, state: ModelState, hidden: torch.Tensor, tokens: list[int], n_max: int, picker: DraftPicker | None
    ) -> Iterator[tuple[int, float]]:
        """Eager draft steps, one at a time (the caller stops pulling at the first token below p_min): each
        step's argmax (or the picker's draw) and the argmax's probability over the top DRAFT_TOP_K. Step 0's pass
        takes every row of `tokens` (the waiting catch-up rows, then the sampled token's) and drafts from the
        last. On the CPU, greedy steps and draws from a chain the C chain runs (`DraftPicker.device_chain`) are one
        C call (`mtp_draft`: the same tokens and cache rows; the draws take n_max uniforms first, as on a GPU);
        other draws one C call a step (`mtp_draft_row`), drawn here."""
        head = self.head.exact
        drawn = None if picker is None else picker.device_chain(head.shape[0])
        if (picker is None and self.head.coarse is None) or drawn is not None:  # the C chain: the whole head
            draws = None if drawn is None or picker is None else DrawnChain(*drawn, picker.rng.random)
            chain = self.mtp.mtp_draft(hidden, tokens, state, n_max, head, DRAFT_TOP_K, self.config.p_min, draws)
            if chain is not None:
                if draws is not None:  # recorded now: the caller takes the distributions of the tokens it keeps
                    for (token, _), q in zip(chain, draws.distributions(len(chain))):
                        picker.record(token, q)
                yield from chain
                return
        for _ in range(n_max):
            # a draw needs the whole row (and its grammar), from the head itself: on the CPU one C call a step
            stepped = None if picker is None else self.mtp.mtp_draft_row(hidden, tokens, state, head, DRAFT_TOP_K)
            if stepped is not None:
                row, hidden, p_top = stepped
            else:
                _, h_mtp = self.mtp.mtp_step(hidden, torch.tensor(tokens), state, with_logits=False)
                hidden = h_mtp[-1:]
                if picker is None:
                    values, ids = self.head.top(hidden, DRAFT_TOP_K)
                else:
                    row = linear(hidden.to(self.head.device), head)[0].float()
                    values, ids = row.topk(DRAFT_TOP_K)
                p_top = float(torch.softmax(values, 0)[0])
            token = int(ids[0]) if picker is None else picker.pick(row)
            if token is None:  # the grammar leaves the draft nothing
                return
            tokens = [token]
            yield token, p_top

    def after_prompt(self, slot: Slot, hidden: torch.Tensor, tokens: list[int]) -> None:
        """The chunk's MTP rows, written now: row i pairs token i with the trunk's state at the position before."""
        mine = self._of(slot)
        previous = mine.pending_h if mine.pending_h is not None else hidden.new_zeros(hidden.shape[-1])
        mine.pending_h = hidden[-1].clone()
        self._flush(slot, mine)
        self._write(slot, mine, torch.cat((previous[None], hidden[:-1])), tokens)

    def after_verify(self, slot: Slot, hidden: torch.Tensor, tokens: list[int], n_accepted: int) -> None:
        """The catch-up rows of the kept tokens wait for the next draft's pass: the sampled token's (unless draft
        step 0 wrote it) and the accepted drafts', each with the trunk's state before it; rejected drafts need
        none. The next row reads the trunk's state at the last kept position."""
        mine = self._of(slot)
        kept = tokens[: n_accepted + 1]
        previous = mine.pending_h if mine.pending_h is not None else hidden.new_zeros(hidden.shape[-1])
        before = torch.cat((previous[None], hidden[:n_accepted]))  # the trunk's state before each kept token
        first = 1 if mine.drafted else 0  # draft step 0 wrote the sampled token's row
        if len(kept) > first:
            mine.backlog.append((before[first:], kept[first:]))
        mine.drafted = False
        mine.pending_h = hidden[n_accepted].clone()

    def finish(self, slot: Slot) -> None:
        """Write the waiting rows (and drop a drafted row no verification confirmed): between requests the MTP
        cache ends where the trunk's does, so a prefix reuse cuts both alike."""
        mine = self._of(slot)
        self._flush(slot, mine)
        if mine.drafted:
            kv = slot.state.kv[self.kv_index]
            kv.truncate(min(kv.length, slot.state.n_past))
            mine.drafted = False

    def rewind(self, slot: Slot, reuse: Reuse) -> None:
        """The next row reads the hidden state of the restored checkpoint (nothing, on a cleared slot)."""
        mine = self._of(slot)
        mine.drafted = False
        if reuse.keep == 0:
            mine.backlog.clear()
            mine.pending_h = None
        elif reuse.checkpoint is not None:
            mine.pending_h = reuse.checkpoint.hidden

    def pending_hidden(self, slot: Slot) -> torch.Tensor | None:
        mine = self._of(slot)
        self._flush(slot, mine)
        return mine.pending_h

    def _flush(self, slot: Slot, mine: _MTPSlot) -> None:
        inputs, tokens = self._take_backlog(mine)
        if inputs is not None:
            self._write(slot, mine, inputs, tokens)

    @staticmethod
    def _take_backlog(mine: _MTPSlot) -> tuple[torch.Tensor | None, list[int]]:
        """The waiting catch-up rows' inputs [n, E] and tokens, in order (None, []: none wait)."""
        if not mine.backlog:
            return None, []
        inputs = torch.cat([h for h, _ in mine.backlog])
        tokens = [t for _, ts in mine.backlog for t in ts]
        mine.backlog.clear()
        return inputs, tokens

    def _write(self, slot: Slot, mine: _MTPSlot, inputs: torch.Tensor, tokens: list[int]) -> None:
        n = len(tokens)
        if self.graphs and n <= self.config.n_max + 1:  # a longer backlog (steps without drafts) is rare
            if n not in mine.rows_graphs:
                mine.rows_graphs[n] = MTPRowsGraph(self.model, slot.state, n)
            mine.rows_graphs[n].write(inputs, tokens)
        else:
            self.mtp.mtp_step(inputs, torch.tensor(tokens), slot.state, with_logits=False)

    def graph_counts(self) -> tuple[int, int]:
        """Captured steps it holds: (draft chains, catch-up passes)."""
        mine = self._slots.values()
        return sum(len(m.draft_graphs) + len(m.draw_graphs) for m in mine), sum(len(m.rows_graphs) for m in mine)


# --- draft-simple --------------------------------------------------------------------------------------

VOCAB_CHECK_START = 5  # llama.cpp compares token texts from this id on (the first ids are often specials)
VOCAB_MAX_SIZE_DIFFERENCE = 128


def check_draft_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    """llama.cpp's compatibility rule for a draft model: same special tokens, vocabulary sizes within
    128, the same text for every shared token id from 5 on."""
    problems = []
    if (target.bos_id, target.eos_id, target.add_bos) != (draft.bos_id, draft.eos_id, draft.add_bos):
        problems.append(
            f"special tokens differ (bos/eos/add_bos {target.bos_id}/{target.eos_id}/{target.add_bos} vs "
            f"{draft.bos_id}/{draft.eos_id}/{draft.add_bos})"
        )
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(
            f"vocabulary sizes {target.n_vocab} and {draft.n_vocab} differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}"
        )
    else:
        for i in range(VOCAB_CHECK_START, min(target.n_vocab, draft.n_vocab)):
            if target.token_text(i) != draft.token_text(i):
                problems.append(
                    f"token {i} is {target.token_text(i)!r} in the target, {draft.token_text(i)!r} in the draft"
                )
                break
    if problems:
        raise InvalidRequest("the draft model's vocabulary does not match the target's: " + "; ".join(problems))


@dataclass
class DraftState:
    state: ModelState
    tokens: list[int] = field(default_factory=list)  # what `state` holds


class DraftModelDrafter(NullHooks):
    """draft-simple: per slot, a state of the draft model that holds the slot's accepted tokens (it catches up
    lazily, at the next draft)."""

    def __init__(self, model: CausalLM, config: SpecConfig, ubatch: int) -> None:
        self.model, self.config, self.ubatch = model, config, ubatch
        self._states: dict[int, DraftState] = {}

    def draft(self, slot: Slot, n_max: int, picker: DraftPicker | None = None) -> list[int]:
        """Up to n_max greedy tokens (or the picker's draws) after the slot's tokens + [sampled]; the draft state
        ends holding the slot's tokens."""
        assert slot.job is not None
        if slot.id not in self._states:
            self._states[slot.id] = DraftState(self.model.new_state(slot.state.capacity))
        draft, accepted, sampled = self._states[slot.id], slot.tokens, slot.job.pending
        state = draft.state
        keep = 0
        for a, b in zip(draft.tokens, accepted):
            if a != b:
                break
            keep += 1
        if keep < len(draft.tokens) and not self._rewind(draft, keep):
            draft.state.clear()
            draft.tokens.clear()
        for start in range(len(draft.tokens), len(accepted), self.ubatch):
            chunk = accepted[start : start + self.ubatch]
            self.model.forward(torch.tensor(chunk), state)
            draft.tokens.extend(chunk)
        base = len(draft.tokens)
        snapshot = {i: s.snapshot() for i, s in state.recurrent.items()}
        tokens: list[int] = []
        token = sampled
        for _ in range(n_max):
            if state.n_past + 1 >= state.capacity:
                break
            logits = self.model.decode(token, state).float()
            top = logits.topk(DRAFT_TOP_K)
            if self.config.p_min > 0 and float(torch.softmax(top.values, 0)[0]) < self.config.p_min:
                break
            picked = int(top.indices[0]) if picker is None else picker.pick(logits)
            if picked is None:  # the grammar leaves the draft nothing
                break
            token = picked
            tokens.append(token)
        for i, s in state.recurrent.items():  # back to the accepted tokens
            s.restore(snapshot[i])
        state.truncate(base)
        return tokens if len(tokens) >= self.config.n_min else []

    def _rewind(self, draft: DraftState, keep: int) -> bool:
        if draft.state.recurrent:  # a recurrent draft model cannot truncate: start over
            return False
        if not all(kv.can_truncate(keep) for kv in draft.state.kv.values()):
            return False
        draft.state.truncate(keep)
        del draft.tokens[keep:]
        return True


# --- ngram ---------------------------------------------------------------------------------------------


class NGramDrafter(NullHooks):
    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def draft(self, slot: Slot, n_max: int, picker: DraftPicker | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the context's last n tokens."""
        assert slot.job is not None
        context = [*slot.tokens, slot.job.pending]
        for n in range(min(self.config.ngram_size, len(context) - 1), 0, -1):
            key = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == key:
                    follow = context[start + n : start + n + n_max]
                    return follow if len(follow) >= max(self.config.n_min, 1) else []
        return []
