"""The generating slots' step without a drafter: one decode pass for all of them and each one's next token (with a
drafter, `Speculator.step` takes its place)."""

from __future__ import annotations

from .runner import ModelRunner
from .slots import Outcome, Slot


class PlainDecode:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(self, slots: list[Slot], room: dict[int, int]) -> list[Outcome]:
        """One decode pass for `slots` and each one's next token. A failed pass fails them all (their states are
        half-updated); a failed sample only its own."""
        tokens = [s.job.pending for s in slots]  # type: ignore[union-attr]
        try:
            logits = self.runner.run([s.state for s in slots], tokens).logits
            assert logits is not None
        except Exception as e:  # noqa: BLE001 - handed to each slot's outcome
            return [Outcome(slot, error=e) for slot in slots]
        outcomes = []
        for slot, token, row in zip(slots, tokens, logits):
            slot.tokens.append(token)
            try:
                outcomes.append(Outcome(slot, [(*slot.job.sample(row), slot.n_past)]))  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001
                outcomes.append(Outcome(slot, error=e))
        return outcomes
