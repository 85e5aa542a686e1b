"""Speculative decoding: drafters propose tokens, the trunk verifies them in one pass (the engine runs
the loop; ../shared/spec/mtp-speculative-decoding.md).

* `draft-mtp`: the model's own MTP block, chained: step 0 reads (sampled token, trunk hidden state of the
  position before it), each next step the MTP's own output hidden state; the draft is the argmax of each
  step (a draft stops early when that token's probability, renormalised over the top 10, is below
  `p_min`; drafts shorter than `n_min` are dropped). The MTP KV cache only ever keeps rows computed from
  the trunk's hidden states (the "catch-up" pass after every trunk pass); draft-time rows are removed.
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

from dataclasses import dataclass, field

import torch

from ..models.base import CausalLM, ModelState
from .request import InvalidRequest

SPEC_TYPES = ("none", "draft-mtp", "ngram")
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

    def __post_init__(self) -> None:
        if self.type not in SPEC_TYPES:
            raise InvalidRequest(f"unknown --spec-type '{self.type}' (use one of {', '.join(SPEC_TYPES)})")
        if self.n_max < 0 or self.n_min < 0:
            raise InvalidRequest("--spec-draft-n-max and --spec-draft-n-min must be >= 0")

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

    def draft(self, state: ModelState, pending_h: torch.Tensor, sampled: int, n_max: int) -> list[int]:
        """Up to n_max chained draft tokens after `sampled` (which sits at position state.n_past)."""
        kv = state.kv[self.kv_index]
        start = kv.length
        tokens: list[int] = []
        hidden, token = pending_h[None], sampled
        for _ in range(n_max):
            logits, hidden = self.model.mtp_step(hidden, torch.tensor([token]), state)
            top = logits[0].float().topk(DRAFT_TOP_K)
            if self.config.p_min > 0 and float(torch.softmax(top.values, 0)[0]) < self.config.p_min:
                break
            token = int(top.indices[0])
            tokens.append(token)
        kv.truncate(start)  # draft-time rows go: the catch-up pass rewrites them from the trunk's states
        return tokens if len(tokens) >= self.config.n_min else []

    def write_rows(self, state: ModelState, inputs: torch.Tensor, tokens: list[int]) -> None:
        """MTP cache rows for tokens the trunk evaluated: row i pairs token i with the trunk's hidden
        state at the position before it (`inputs` [T, E])."""
        self.model.mtp_step(inputs, torch.tensor(tokens), state, with_logits=False)


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
