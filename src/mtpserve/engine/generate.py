"""A single-sequence generation loop for the command line and tests: prompt, then one token at a time.
(The server's scheduler, with slots and batching, is a separate issue; it reuses the same model calls.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models.base import CausalLM, ModelState


@dataclass
class GeneratedToken:
    id: int
    top: list[tuple[int, float]]  # (token id, probability) of the n_probs most likely, before sampling


def generate(
    model: CausalLM,
    state: ModelState,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    n_probs: int = 0,
    stop_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Iterator[GeneratedToken]:
    """Evaluate `prompt`, then yield up to `max_tokens` tokens (greedy at temperature 0), stopping after a
    token in `stop_ids`. Probabilities are the model's raw softmax, as llama-server's n_probs."""
    logits = model.prefill(prompt, state)
    for i in range(max_tokens):
        logits = logits.float()
        top: list[tuple[int, float]] = []
        if n_probs:
            probs = torch.softmax(logits, -1)
            values, indices = probs.topk(n_probs)
            top = list(zip(indices.tolist(), values.tolist()))
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        yield GeneratedToken(token, top)
        if token in stop_ids or i + 1 == max_tokens:
            return
        logits = model.decode(token, state)
