"""The deployment's cache with llama.cpp's tokens: `-fa on -ctk q8_0 -ctv q8_0` on tinyqwen35 Q4_K_M.

The shared fixtures were made with llama-server's default f16 cache; tests/models/test_parity.py holds a q8_0
cache only to our own f16 tokens. tests/fixtures/tinyqwen35_q8_0_kv_llama.json is llama-server's greedy run with
the deployment's cache flags (bench/record_llama_ref.py --kv q8_0: five prompts, 32 tokens each, the top-1 / top-2
margins). Our CPU path with a q8_0 cache, fed llama.cpp's tokens on its prompt schedule, picks llama.cpp's token at
every position before the first near tie (< 0.05 nats), with llama.cpp's log-probability of it within 0.05 nats
(2026-12-05: at most 0.025 over the 84 positions compared).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import tinyqwen_path
from .test_parity import MODELS, teacher_forced

REFERENCE = Path(__file__).parents[1] / "fixtures" / "tinyqwen35_q8_0_kv_llama.json"
LOGPROB_TOLERANCE = 0.05  # nats
NAME = "tinyqwen35-mtp-Q4_K_M"


def _cases() -> list[dict]:
    ref = json.loads(REFERENCE.read_text())
    assert "-fa on -ctk q8_0 -ctv q8_0" in ref["server_command"]
    return ref["cases"]


@pytest.mark.parametrize("case", range(len(_cases())), ids=lambda i: f"prompt{i}")
def test_q8_0_cache_gives_llama_cpps_tokens(case: int) -> None:
    assert MODELS[NAME]() == tinyqwen_path("Q4_K_M")
    ref = _cases()[case]
    logprobs = teacher_forced(NAME, ref, "q8_0")
    ours = [int(lp.argmax()) for lp in logprobs]
    first_tie = min(ref["near_tie_positions"], default=len(ours))
    diverged = next((i for i, (a, b) in enumerate(zip(ours, ref["generated_token_ids"])) if a != b), None)
    assert diverged is None or diverged >= first_tie, (
        f"prompt {case}: token {diverged} differs before the first near tie ({first_tie}): ours {ours[:first_tie]}, "
        f"llama.cpp's {ref['generated_token_ids'][:first_tie]}"
    )
    for pos in range(first_tie):
        ours_lp = logprobs[pos][ref["generated_token_ids"][pos]].item()
        assert abs(ours_lp - ref["top1_logprob"][pos]) <= LOGPROB_TOLERANCE, (
            case,
            pos,
            ours_lp,
            ref["top1_logprob"][pos],
        )
