"""Speculative decoding: drafters propose tokens, the trunk verifies them in one pass (the engine runs
the loop; ../shared/spec/mtp-speculative-decoding.md).

* `draft-mtp`: the model's own MTP block, chained: step 0 reads (sampled token, trunk hidden state of the
  position before it), each next step the MTP's own output hidden state; the draft is the argmax of each
  step (a draft stops early when that token's probability, renormalised over the top 10, is below
  `p_min`; drafts shorter than `n_min` are dropped). The MTP KV cache only ever keeps rows computed from
  the trunk's hidden states (the "catch-up" pass after every trunk pass); draft-time rows are removed.
* `draft-simple`: a separate small model with the same vocabulary (`--model-draft`), greedy, one token
  at a time from its own state, which catches up on the accepted tokens before each draft and returns
  to them afterwards (its recurrent state, if any, from a snapshot).
* `ngram`: prompt lookup: the continuation of the latest earlier occurrence of the context's last n
  tokens (n from `ngram_size` down to 1). No model, no state.

Acceptance is llama.cpp's: sample each position from the trunk with the request's full sampler chain and
keep the draft while the sample equals it (greedy: while the argmax equals it). With deterministic drafts
(an argmax, a lookup) this *is* distribution-preserving speculative sampling: accepting a draft d with
probability min(1, p(d) / q(d)) = p(d) and resampling from the normalised residual p - q is the same as
drawing from p and comparing, so no separate rule is needed; a stochastic drafter would need the ratio rule.

`auto` draft length: each step picks the length k (0..n_max) that maximises expected tokens per second,
from the running acceptance rate of each draft position and the measured cost of drafting and verifying.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..models.base import CausalLM, ModelState
from ..models.graphs import MTPDraftGraph, MTPRowsGraph
from ..ops.linear import linear
from ..tokenizer import Tokenizer
from .request import InvalidRequest

SPEC_TYPES = ("none", "draft-mtp", "draft-simple", "ngram")
AUTO_N_MAX = 4  # --spec-draft-n-max auto tries drafts of up to this many tokens
DRAFT_TOP_K = 10  # p_min is measured against the draft's top-10, renormalised (llama.cpp)


@dataclass(frozen=True)
class SpecConfig:
    """llama-server's --spec-* flags."""

    type: str = "none"
    n_max: int = 3  # --spec-draft-n-max (llama.cpp's default)
    n_min: int = 0
    p_min: float = 0.0
    auto: bool = False  # --spec-draft-n-max auto: n_max is then the longest draft tried
    ngram_size: int = 3
    draft_model: str | None = None  # --model-draft: the GGUF of draft-simple
    draft_vocab: int = 0  # draft-mtp: score only the first N token ids when drafting (0: all)

    def __post_init__(self) -> None:
        if self.type not in SPEC_TYPES:
            raise InvalidRequest(f"unknown --spec-type '{self.type}' (use one of {', '.join(SPEC_TYPES)})")
        if self.n_max < 0 or self.n_min < 0:
            raise InvalidRequest("--spec-draft-n-max and --spec-draft-n-min must be >= 0")
        if self.type == "draft-simple" and not self.draft_model:
            raise InvalidRequest("--spec-type draft-simple needs a draft model (--model-draft FILE)")

    @property
    def enabled(self) -> bool:
        return self.type != "none" and self.n_max > 0


class MTPDrafter:
    def __init__(self, model: CausalLM, config: SpecConfig) -> None:
        index = getattr(model, "mtp_kv_index", None)
        if index is None:
            raise InvalidRequest(
                "--spec-type draft-mtp needs a model with an MTP block (nextn_predict_layers > 0); this one has none"
            )
        self.model, self.config, self.kv_index = model, config, index
        # A trimmed draft vocabulary: the MTP head's first rows (BPE vocabularies put frequent tokens
        # first), a view of the same weights. The trunk still verifies over the whole vocabulary.
        self.head = None
        if config.draft_vocab:
            self.head = model.mtp[0].head.first_rows(config.draft_vocab)  # type: ignore[attr-defined]

    def draft(
        self, state: ModelState, pending_h: torch.Tensor, sampled: int, n_max: int, graph: MTPDraftGraph | None = None
    ) -> list[int]:
        """Up to n_max chained draft tokens after `sampled` (which sits at position state.n_past). With `graph`
        (from `draft_graph(state, n_max)`) the steps run captured, all n_max of them, and the tokens after the
        first one below p_min are dropped on the host: the same draft, as later steps cannot change earlier ones."""
        kv = state.kv[self.kv_index]
        start = kv.length
        tokens: list[int] = []
        if graph is not None:
            proposals: Iterable[tuple[int, float]] = graph.propose(pending_h, sampled)
        else:
            proposals = self._proposals(state, pending_h, sampled, n_max)
        for token, p_top in proposals:
            if self.config.p_min > 0 and p_top < self.config.p_min:
                break
            tokens.append(token)
        kv.truncate(start)  # draft-time rows go: the catch-up pass rewrites them from the trunk's states
        return tokens if len(tokens) >= self.config.n_min else []

    def _proposals(
        self, state: ModelState, pending_h: torch.Tensor, sampled: int, n_max: int
    ) -> Iterator[tuple[int, float]]:
        """Eager draft steps, one at a time (the caller stops pulling at the first token below p_min): each
        step's argmax and its probability over the top DRAFT_TOP_K."""
        hidden, token = pending_h[None], sampled
        for _ in range(n_max):
            logits, hidden = self.model.mtp_step(hidden, torch.tensor([token]), state, with_logits=self.head is None)
            if self.head is not None:
                logits = linear(hidden, self.head)
            assert logits is not None
            top = logits[0].float().topk(DRAFT_TOP_K)
            token = int(top.indices[0])
            yield token, float(torch.softmax(top.values, 0)[0])

    def write_rows(
        self, state: ModelState, inputs: torch.Tensor, tokens: list[int], graph: MTPRowsGraph | None = None
    ) -> None:
        """MTP cache rows for tokens the trunk evaluated: row i pairs token i with the trunk's hidden
        state at the position before it (`inputs` [T, E]). `graph`: `rows_graph(state, T)`."""
        if graph is not None:
            graph.write(inputs, tokens)
        else:
            self.model.mtp_step(inputs, torch.tensor(tokens), state, with_logits=False)

    def draft_graph(self, state: ModelState, n_max: int) -> MTPDraftGraph:
        """`draft`'s steps on `state` captured (a model on one GPU: models.graphs)."""
        head = self.head if self.head is not None else self.model.mtp[0].head  # type: ignore[attr-defined]
        return MTPDraftGraph(self.model, state, n_max, head, DRAFT_TOP_K)

    def rows_graph(self, state: ModelState, n_tokens: int) -> MTPRowsGraph:
        """`write_rows` of `n_tokens` rows on `state`, captured."""
        return MTPRowsGraph(self.model, state, n_tokens)


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


class DraftModelDrafter:
    """draft-simple: per slot, a state of the draft model that holds the slot's accepted tokens."""

    def __init__(self, model: CausalLM, config: SpecConfig, ubatch: int) -> None:
        self.model, self.config, self.ubatch = model, config, ubatch

    def new_state(self, ctx: int) -> DraftState:
        return DraftState(self.model.new_state(ctx))

    def draft(self, draft: DraftState, accepted: list[int], sampled: int, n_max: int) -> list[int]:
        """Up to n_max greedy tokens after `accepted` + [sampled]; `draft` ends holding `accepted`."""
        state = draft.state
        keep = 0
        for a, b in zip(draft.tokens, accepted):
            if a != b:
                break
            keep += 1
        if keep < len(draft.tokens) and not self._rewind(draft, keep):
            self._reset(draft)
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
            token = int(top.indices[0])
            tokens.append(token)
        for i, s in state.recurrent.items():  # back to the accepted tokens
            s.restore(snapshot[i])
        for kv in state.kv.values():
            kv.truncate(base)
        state.n_past = base
        return tokens if len(tokens) >= self.config.n_min else []

    def _rewind(self, draft: DraftState, keep: int) -> bool:
        if draft.state.recurrent:  # a recurrent draft model cannot truncate: start over
            return False
        for kv in draft.state.kv.values():
            if not kv.can_truncate(keep):
                return False
            kv.truncate(keep)
        draft.state.n_past = keep
        del draft.tokens[keep:]
        return True

    def _reset(self, draft: DraftState) -> None:
        draft.state.clear()
        draft.tokens.clear()


@dataclass
class DraftState:
    state: ModelState
    tokens: list[int] = field(default_factory=list)  # what `state` holds


class NGramDrafter:
    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def draft(self, context: list[int], n_max: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the context's last n tokens."""
        for n in range(min(self.config.ngram_size, len(context) - 1), 0, -1):
            key = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == key:
                    follow = context[start + n : start + n + n_max]
                    return follow if len(follow) >= max(self.config.n_min, 1) else []
        return []


@dataclass
class AdaptiveLength:
    """Picks the draft length that maximises expected tokens per second (spec config `auto`)."""

    n_max: int
    accepted: list[float] = field(default_factory=list)  # per draft position: P(accepted | reached)
    verify_ms: dict[int, float] = field(default_factory=dict)  # batch size -> running mean time
    draft_ms: float = 0.0  # one draft step
    decay: float = 0.95

    def __post_init__(self) -> None:
        self.accepted = [0.7] * self.n_max  # a prior that lets every length be tried early on

    explore_every: int = 16  # steps: a length the model has stopped choosing still gets tried now and then
    steps: int = 0

    def choose(self, cap: int) -> int:
        self.steps += 1
        if self.steps % self.explore_every == 0:
            return min(cap, 1 + (self.steps // self.explore_every) % self.n_max)
        best, best_rate = 0, 0.0
        expected, reach = 1.0, 1.0
        for k in range(0, min(cap, self.n_max) + 1):
            if k:
                reach *= self.accepted[k - 1]
                expected += reach
            cost = self.verify_ms.get(k + 1, self.verify_ms.get(1, 1.0) * (1 + 0.1 * k)) + k * self.draft_ms
            rate = expected / max(cost, 1e-6)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def update(self, n_drafted: int, n_accepted: int, verify_ms: float, draft_ms: float) -> None:
        for i in range(min(n_drafted, n_accepted + 1)):  # positions reached: accepted ones and the first miss
            hit = 1.0 if i < n_accepted else 0.0
            self.accepted[i] = self.decay * self.accepted[i] + (1 - self.decay) * hit
        size = n_drafted + 1
        previous = self.verify_ms.get(size)
        self.verify_ms[size] = verify_ms if previous is None else self.decay * previous + (1 - self.decay) * verify_ms
        if n_drafted:
            per_step = draft_ms / n_drafted
            self.draft_ms = per_step if not self.draft_ms else self.decay * self.draft_ms + (1 - self.decay) * per_step
