"""Perplexity the way llama-perplexity computes it, so the numbers are comparable.

The text is tokenized once (BOS added when the vocabulary adds one) and cut into `ctx_size`-token chunks;
each chunk starts from an empty cache, its first token replaced by BOS when the vocabulary adds BOS, and
only the second half is scored: the negative log-likelihood of tokens first+1 .. ctx-1 with first =
ctx/2. PPL = exp(mean NLL); the error is stderr(NLL) * PPL (llama.cpp's "+/-").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models.base import CausalLM


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float
    chunk_ppl: list[float] = field(default_factory=list)  # running estimate after each chunk
    n_tokens_scored: int = 0


def perplexity(
    model: CausalLM,
    tokens: list[int],
    ctx_size: int,
    n_chunks: int = -1,
    bos_id: int | None = None,
    on_chunk: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """`tokens` already tokenized with add_special; `bos_id` set when the vocabulary adds BOS."""
    if len(tokens) < 2 * ctx_size:
        raise ValueError(f"need at least {2 * ctx_size} tokens for a context of {ctx_size}, got {len(tokens)}")
    available = len(tokens) // ctx_size
    n_chunks = available if n_chunks < 0 else min(n_chunks, available)
    first = ctx_size // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = list(tokens[i * ctx_size : (i + 1) * ctx_size])
        if bos_id is not None:
            chunk[0] = bos_id
        state = model.new_state(ctx_size)
        logits = model.prefill(chunk, state, all_logits=True, logits_from=first)  # [ctx - first, V]
        logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
        targets = torch.tensor(chunk[first + 1 : ctx_size])
        token_nll = -logprobs.gather(1, targets[:, None]).squeeze(1)
        nll += token_nll.sum().item()
        nll2 += token_nll.pow(2).sum().item()
        count += len(targets)
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i, running[-1])
    mean = nll / count
    var = nll2 / count - mean * mean
    stderr = math.sqrt(var / (count - 1)) if var > 0 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(ppl, stderr * ppl, running, count)
