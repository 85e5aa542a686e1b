"""One request on its way through a slot: its sampler, its output, its timings and its stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from ..ops.verify_drawn import verify_drawn
from ..tokenizer import Tokenizer
from .client import RequestStream, count_accepted
from .grammar import Constraint
from .output import CodeLimits, RequestOutput, Stop
from .reasoning_budget import ReasoningBudget
from .rejection import Distribution, accept_or_resample, spec_stream
from .request import FinishEvent, ProgressEvent, Request, Timings, TokenEvent
from .sampler_order import InfillVocab
from .sampling import Mt19937Uniform, Ranked, Sampler, on_host, post_sampling_probabilities, top_probabilities

Probs = tuple[list[tuple[int, float]], float]  # with n_probs: the top tokens, and the sampled one's probability
NO_PROBS: Probs = ([], 0.0)


class Phase(Enum):
    PROMPT = 1
    GENERATE = 2


@dataclass
class Job:
    request: Request
    stream: RequestStream
    sampler: Sampler | None = None
    constraint: Constraint | None = None  # with request.grammar: its matcher (made when the request is submitted)
    budget: ReasoningBudget | None = None  # with request.reasoning_budget: what it forces
    output: RequestOutput | None = None
    phase: Phase = Phase.PROMPT
    batch_ends: list[int] = field(default_factory=list)  # prompt positions where a forward pass ends
    checkpoint_at: frozenset[int] = frozenset()  # prompt positions to snapshot the recurrent state at
    keep_at: tuple[int, ...] = ()  # ... and where a later prompt may resume, inside a pass (recurrent models)
    pending: int = -1  # sampled, not yet evaluated
    timings: Timings = field(default_factory=Timings)
    t_start: float = 0.0
    t_first: float = 0.0
    t_last_chunk: float = 0.0
    verify_steps: int = 0
    _spec_rng: Mt19937Uniform | None = None

    def begin(self, tokenizer: Tokenizer, n_predict: int, n_ctx: int) -> None:
        """Set up the sampler and the output (`n_predict`: the server's default limit; `n_ctx`: the slot's)."""
        request = self.request
        assert (request.grammar is None) == (self.constraint is None)
        params = request.sampling
        # llama-server: ignore_eos is a -inf bias on every end-of-generation token; with a grammar the end is the
        # grammar's (only allowed once it is complete), so the bias would leave no token to sample there
        if request.ignore_eos and self.constraint is None:
            bias = {t: float("-inf") for t in tokenizer.eog_ids}
            params = replace(params, logit_bias={**params.logit_bias, **bias})
        self.sampler = Sampler(
            params, history=request.prompt, vocab=infill_vocab(tokenizer) if params.samplers else None
        )
        limit = request.n_predict if request.n_predict >= 0 else n_predict
        code = CodeLimits(request.n_indent, request.t_max_predict_ms)
        self.output = RequestOutput(tokenizer, request.stop, limit, n_ctx, request.keep_special, code)
        if request.reasoning_budget is not None:
            self.budget = ReasoningBudget(request.reasoning_budget, tokenizer)

    def sample(self, logits: torch.Tensor, ranked: Ranked | None = None) -> tuple[int, Probs]:
        """The next token from `logits` [V] with the request's sampler, and its probabilities with n_probs.
        `ranked`: the row's top-k, ranked with its verification's other rows (`rows_ranked`)."""
        assert self.sampler is not None
        token = self.budget.forced() if self.budget is not None else None  # a spent reasoning budget decides
        allowed = logits  # a forced token skips the mask: it is not drawn
        if token is None:
            allowed = self.constraint.masked(logits) if self.constraint else logits
            token = self.sampler.sample(allowed, ranked)
        return token, self._take(token, logits, allowed)

    def rows_ranked(self, rows: torch.Tensor) -> list[Ranked | None] | None:
        """A verification's rows [R, V] ranked together on their device (`Sampler.rows_ranked`); None where
        each row is sampled alone (a grammar masks each row after the tokens kept before it)."""
        assert self.sampler is not None
        return None if self.constraint is not None else self.sampler.rows_ranked(rows)

    def verify_draft(
        self, logits: torch.Tensor, drafted: int, q: Distribution, ranked: Ranked | None = None
    ) -> tuple[int, Probs]:
        """The token at a drafted position whose draft was drawn from `q` (engine.rejection): `drafted`, kept with
        probability min(1, p / q) against the request's distribution p at `logits`, or a draw from the residual."""
        assert self.sampler is not None
        if self.budget is not None and self.budget.forced() is not None:
            return self.sample(logits)  # p is the forced token alone: comparing is the same rule
        allowed = self.constraint.masked(logits) if self.constraint else logits
        p = self.sampler.probabilities(allowed, ranked)
        token = accept_or_resample(p, q, drafted, self.spec_rng())
        return token, self._take(token, logits, allowed)

    def verify_drawn(self, rows: torch.Tensor, draft: list[int], qs: list[Distribution]) -> list[tuple[int, Probs]]:
        """The tokens a verification keeps where every draft was drawn from `qs` (`verify_draft`'s rule row after
        row, then `sample`'s draw; ops.verify_drawn, one C call); [] where the rows go one by one: a grammar or a
        reasoning budget reads the tokens kept before each row, or the chain is one the call does not run."""
        assert self.sampler is not None
        drawn = self.sampler.fixed_chain(rows.shape[-1])
        one_by_one = self.constraint is not None or self.budget is not None
        if drawn is None or one_by_one or not draft or len(qs) != len(draft):
            return []
        candidates = None
        if not on_host(rows):  # ranked on their device together, the candidates copied in one
            if (candidates := self.sampler.rows_candidates(rows, drawn[0].n_top)) is None:
                return []
        elif rows.dtype != torch.float32 or not rows.is_contiguous():
            return []
        spec, main = self.spec_rng(), self.sampler.rng
        uniforms = [*spec.ahead(len(draft) + 1), *main.ahead(1)]
        kept = verify_drawn(*drawn, draft, qs, uniforms, None if candidates is not None else rows, candidates)
        if kept is None:
            return []
        tokens, taken = kept
        spec.skip(taken)
        main.skip(int(len(tokens) > len(draft)))  # the last row's draw: every draft was kept
        return [(token, self._take(token, rows[i], rows[i])) for i, token in enumerate(tokens)]

    def spec_rng(self) -> Mt19937Uniform:
        """The draws of probabilistic drafting and its acceptance: a stream of the job's own (engine.rejection)."""
        assert self.sampler is not None
        if self._spec_rng is None:
            self._spec_rng = spec_stream(self.sampler)
        return self._spec_rng

    def _take(self, token: int, logits: torch.Tensor, allowed: torch.Tensor) -> Probs:
        """`token` is the request's next: its probabilities with n_probs; the sampler, grammar and budget move on."""
        assert self.sampler is not None
        n_probs, probs = self.request.n_probs, NO_PROBS
        if n_probs and self.request.post_sampling_probs:  # before accept: the penalties the draw saw
            probs = post_sampling_probabilities(self.sampler, allowed, n_probs, token)
        elif n_probs:
            probs = top_probabilities(logits, n_probs, token)
        self.sampler.accept(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.budget is not None:
            self.budget.observe(token)
        return probs

    def deliver(self, token: int, probs: Probs, position: int) -> Stop | None:
        """Send a sampled token that takes context `position`; why the request ends there, if it does."""
        assert self.output is not None
        text, stop = self.output.add(token, position, 1000.0 * (time.perf_counter() - self.t_first))
        self.timings.predicted_n = len(self.output.tokens)
        self.timings.predicted_ms = max(1000.0 * (time.perf_counter() - self.t_first), 0.001)
        self.stream.put(TokenEvent(token, text, *probs))
        self.pending = token
        return stop

    def report_progress(self, processed: int) -> None:
        """With return_progress: a ProgressEvent for `processed` prompt tokens in the slot."""
        if not self.request.return_progress:
            return
        elapsed = 0.0 if processed == self.timings.cache_n else 1000.0 * (time.perf_counter() - self.t_start)
        total, timings = len(self.request.prompt), replace(self.timings)
        self.stream.put(ProgressEvent(total, self.timings.cache_n, processed, elapsed, timings))

    def count_verification(self, n_drafted: int, n_accepted: int) -> None:
        t = self.timings
        t.draft_n += n_drafted
        t.draft_n_accepted += n_accepted
        self.verify_steps += 1
        count_accepted(t.draft_n_accepted_per_pos, n_drafted, n_accepted)
        count_accepted(t.draft_n_per_pos, n_drafted, n_drafted)

    def finished(self, stop: Stop, id_slot: int) -> FinishEvent:
        """The request's last event."""
        assert self.output is not None
        tail = self.output.finish(stop)
        return FinishEvent(
            finish_reason=stop.reason,
            stop_type=stop.stop_type,
            text=self.output.text,
            tokens=list(self.output.tokens),
            tail=tail,
            timings=self.timings,
            stopping_word=stop.word,
            truncated=stop.truncated,
            n_prompt_tokens=len(self.request.prompt),
            id_slot=id_slot,
            accepted_per_position=list(self.timings.draft_n_accepted_per_pos),
            verify_steps=self.verify_steps,
        )


def infill_vocab(tokenizer: Tokenizer) -> InfillVocab:
    """What an own sampler chain's infill stage reads of the vocabulary (llama.cpp: pieces without control text)."""
    end = tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.eos_id
    return InfillVocab(lambda t: tokenizer.token_bytes(t, special=False), tokenizer.eog_ids, int(end or 0))
