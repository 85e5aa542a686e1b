"""The reasoning budget's state machine on tinyqwen35's real tokenizer: it counts tokens inside the block,
sees closing tags across token boundaries, waits for a whole character, then forces the message and the end tag
one token per step; and `Job.sample` emits what it forces."""

from __future__ import annotations

import pytest
import torch

from mtpserve.engine.client import RequestStream
from mtpserve.engine.job import Job
from mtpserve.engine.reasoning_budget import BudgetState, ReasoningBudget, budget_spec, opens_reasoning
from mtpserve.engine.request import Request
from mtpserve.engine.sampling import SamplingParams
from mtpserve.tokenizer import Tokenizer

from ..conftest import tinyqwen_path

END_TEXTS = ("\n</think>", "</think>", "<tool_call>")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tinyqwen_path("Q4_K_M"))


def plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as ordinary tokens (special-token text split into pieces, as a model may write it)."""
    return tokenizer.encode(text, add_special=False, parse_special=False)


def run(budget: ReasoningBudget, proposals: list[int]) -> list[int]:
    """What is emitted when the model would say `proposals` in turn (a forced token replaces its proposal)."""
    out = []
    for proposal in proposals:
        forced = budget.forced()
        token = proposal if forced is None else forced
        budget.observe(token)
        out.append(token)
    return out


def test_the_spec_forces_the_message_then_the_end_tag_as_its_special_token(tokenizer):
    spec = budget_spec(tokenizer, 16, "Time is up.", "</think>", ("<tool_call>",))
    end = tokenizer.token_id("</think>")
    assert end is not None and spec.forced[-1] == end
    assert tokenizer.decode(spec.forced) == "Time is up.\n</think>"
    assert spec.tokens == 16 and spec.end_texts == END_TEXTS
    assert budget_spec(tokenizer, 0).forced == tuple(tokenizer.encode("\n</think>", False, parse_special=True))


def test_after_n_tokens_the_message_and_end_tag_are_forced_then_sampling_is_free(tokenizer):
    spec = budget_spec(tokenizer, 4, "Enough.", "</think>")
    budget = ReasoningBudget(spec, tokenizer)
    words = plain(tokenizer, " one two three four five six seven eight nine ten eleven twelve")
    out = run(budget, words)
    assert out[:4] == words[:4]
    assert out[4 : 4 + len(spec.forced)] == list(spec.forced)
    assert out[4 + len(spec.forced) :] == words[4 + len(spec.forced) :]  # free again: the answer
    assert budget.state is BudgetState.DONE and budget.n_reasoning == 4
    assert tokenizer.decode(out).count("</think>") == 1


def test_a_zero_budget_forces_from_the_first_token(tokenizer):
    spec = budget_spec(tokenizer, 0)
    budget = ReasoningBudget(spec, tokenizer)
    assert budget.state is BudgetState.FORCING
    words = plain(tokenizer, " a b c d e")
    out = run(budget, words)
    assert out[: len(spec.forced)] == list(spec.forced) and tokenizer.decode(spec.forced) == "\n</think>"
    assert budget.n_reasoning == 0 and budget.forced() is None


def test_a_closing_special_token_ends_the_budget_and_is_not_counted(tokenizer):
    budget = ReasoningBudget(budget_spec(tokenizer, 5), tokenizer)
    tokens = (
        plain(tokenizer, " ab") + [tokenizer.token_id("</think>")] + plain(tokenizer, " one two three four five six")
    )
    assert run(budget, tokens) == tokens  # nothing forced
    assert budget.state is BudgetState.DONE and budget.n_reasoning == len(plain(tokenizer, " ab"))


@pytest.mark.parametrize("tag", ["</think>", "<tool_call>"])
def test_a_closing_tag_written_in_pieces_is_seen_across_token_boundaries(tokenizer, tag):
    pieces = plain(tokenizer, tag)
    assert len(pieces) > 1  # the tag spans several ordinary tokens
    budget = ReasoningBudget(budget_spec(tokenizer, len(pieces) + 1, "", "</think>", ("<tool_call>",)), tokenizer)
    tokens = plain(tokenizer, "x") + pieces + plain(tokenizer, " more text goes on here")
    assert run(budget, tokens) == tokens
    assert budget.state is BudgetState.DONE and budget.n_reasoning == len(pieces)  # x and all but the last piece


def test_the_budget_never_ends_inside_a_character(tokenizer):
    emoji = plain(tokenizer, "😀")
    assert len(emoji) == 4  # four byte tokens
    spec = budget_spec(tokenizer, 2)
    budget = ReasoningBudget(spec, tokenizer)
    out = run(budget, emoji + plain(tokenizer, " a b c d"))
    assert out[:4] == emoji  # the character is finished first
    assert out[4 : 4 + len(spec.forced)] == list(spec.forced)
    assert "\ufffd" not in tokenizer.decode(out)


@pytest.mark.parametrize(
    ("generation_prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("", False),
        ("<think>\n<tool_call>", False),
    ],
)
def test_only_a_generation_prompt_that_opens_reasoning_gets_a_budget(generation_prompt, opened):
    assert opens_reasoning(generation_prompt, "<think>", END_TEXTS) is opened


def test_job_sample_emits_the_forced_tokens_whatever_the_logits(tokenizer):
    spec = budget_spec(tokenizer, 3, "Stop.")
    job = Job(Request([1, 2, 3], SamplingParams(temperature=0), reasoning_budget=spec), RequestStream())
    job.begin(tokenizer, -1, 4096)
    logits = torch.zeros(tokenizer.n_vocab)
    favourite = plain(tokenizer, " x")[0]
    logits[favourite] = 10.0
    out = [job.sample(logits)[0] for _ in range(3 + len(spec.forced) + 2)]
    assert out == [favourite] * 3 + list(spec.forced) + [favourite] * 2
