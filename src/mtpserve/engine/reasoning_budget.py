"""llama-server's reasoning budget (`--reasoning-budget N`, `reasoning_budget_tokens`; common/reasoning-budget.cpp,
../shared/spec/chat-template.md §3): a request whose output starts inside a `<think>` block may reason for N
generated tokens; then the engine emits the budget message and `\\n</think>` itself, one token per step, and
generation goes on freely with the answer.

What counts, as llama.cpp counts it: every token generated while the block is open, except the one that closes
it (a closing tag is found in the output's text, across token boundaries). The forced tokens are not reasoning
of the model's: they do not count against the budget, but they are generated tokens like any other (timings,
n_predict). When the budget runs out in the middle of a UTF-8 character, the tokens that complete it are let
through first (at most three more), so the reasoning never ends in a broken character.
"""

from __future__ import annotations

import codecs
from enum import Enum

from ..tokenizer import Tokenizer
from .request import ReasoningBudgetSpec


class BudgetState(Enum):
    COUNTING = 1  # inside the block, under the budget
    WAITING_UTF8 = 2  # the budget is spent; a character is still incomplete
    FORCING = 3  # emitting the message and the end tag
    DONE = 4  # the block is closed: nothing more to do


def budget_spec(
    tokenizer: Tokenizer, tokens: int, message: str = "", end_tag: str = "</think>", interrupts: tuple[str, ...] = ()
) -> ReasoningBudgetSpec:
    """The spec of a budget of `tokens` (>= 0): the forced text `message + "\\n" + end_tag` in the model's tokens
    (the tag as its special token where the vocabulary has one), closed early by the tag or an interrupt."""
    forced = tokenizer.encode(message + "\n" + end_tag, add_special=False, parse_special=True)
    return ReasoningBudgetSpec(tokens, tuple(forced), ("\n" + end_tag, end_tag, *interrupts))


def opens_reasoning(generation_prompt: str, start_tag: str, end_texts: tuple[str, ...]) -> bool:
    """Whether the output starts inside a reasoning block: the generation prompt's last `start_tag` is not
    closed after it (Qwen with thinking on ends it with `<think>\\n`; with thinking off, `<think>\\n\\n</think>`)."""
    at = generation_prompt.rfind(start_tag)
    if at < 0:
        return False
    rest = generation_prompt[at + len(start_tag) :]
    return not any(end in rest for end in end_texts)


class ReasoningBudget:
    """One request's budget: `forced()` says which token to emit instead of sampling, `observe()` follows
    every token that was emitted (forced or sampled), in order."""

    def __init__(self, spec: ReasoningBudgetSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.remaining = spec.tokens
        self.n_reasoning = 0  # tokens generated inside the block, forced ones excluded
        self._force_at = 0
        self._ends = [end.encode() for end in spec.end_texts if end]
        self._keep = max((len(end) for end in self._ends), default=1) - 1  # tail bytes a tag may start in
        self._tail = b""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.state = BudgetState.COUNTING
        if self.remaining <= 0:
            self._start_forcing()

    def forced(self) -> int | None:
        """The token this step must emit, or None to sample freely."""
        return self.spec.forced[self._force_at] if self.state is BudgetState.FORCING else None

    def observe(self, token: int) -> None:
        """Follow an emitted token: count it, notice a closing tag, start forcing when the budget is spent."""
        if self.state is BudgetState.DONE:
            return
        if self.state is BudgetState.FORCING:
            self._force_at += 1
            if self._force_at >= len(self.spec.forced):
                self.state = BudgetState.DONE
            return
        piece = self.tokenizer.token_bytes(token, special=True)
        window = self._tail + piece
        if any(end in window for end in self._ends):
            self.state = BudgetState.DONE
            return
        self._tail = window[-self._keep :] if self._keep else b""
        self._utf8.decode(piece)
        self.n_reasoning += 1
        self.remaining -= 1
        if self.remaining <= 0:
            self._start_forcing()

    def _start_forcing(self) -> None:
        if self._utf8.getstate()[0]:  # a character is incomplete: let the next tokens finish it
            self.state = BudgetState.WAITING_UTF8
        elif self.spec.forced:
            self.state = BudgetState.FORCING
        else:
            self.state = BudgetState.DONE
