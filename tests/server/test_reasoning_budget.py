"""The reasoning budget over HTTP: tinyqwen35 thinks (its template opens `<think>`), the server runs with
`--reasoning-budget 16` and speculates with its MTP head (a forced token never matches a draft), and the OpenAI
client reads `reasoning_content` and `content`; the per-request fields override the server's; the command line
takes the flags."""

from __future__ import annotations

import httpx
import openai
import pytest

from mtpserve.cli import build_parser
from mtpserve.cli.serve import settings_from_args

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

BUDGET = 16
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
END = "</think>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tinyqwen_path("Q4_K_M")
    args = ["-m", str(path), "-a", "tinyqwen", "-c", "2048", "-t", "2", "--spec-type", "draft-mtp"]
    args += ["--reasoning-budget", str(BUDGET)]
    process = ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def n_tokens(server: ServerProcess, text: str) -> int:
    """How many tokens the server forces for `text` (the tag as its special token)."""
    response = httpx.post(f"{server.url}/tokenize", json={"content": text, "parse_special": True}, timeout=30)
    return len(response.json()["tokens"])


def chat(oai: openai.OpenAI, max_tokens: int = 40, **extra):
    """A greedy chat answer with its tokens (logprobs), and the position of the token that closes reasoning."""
    reply = oai.chat.completions.create(
        model="tinyqwen", messages=MESSAGES, max_tokens=max_tokens, temperature=0, logprobs=True, extra_body=extra
    )
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    close = tokens.index(END) if END in tokens else None
    return reply, tokens, close


def streamed(oai: openai.OpenAI, **extra):
    """The same greedy chat as `chat`, streamed."""
    return oai.chat.completions.create(
        model="tinyqwen", messages=MESSAGES, max_tokens=40, temperature=0, stream=True, **extra
    )


def reasoning(reply) -> str:
    return (reply.choices[0].message.model_extra or {}).get("reasoning_content") or ""


def test_the_server_budget_closes_reasoning_after_16_tokens_and_the_answer_follows(server, oai):
    reply, tokens, close = chat(oai)
    n_forced = n_tokens(server, "\n" + END)
    assert close is not None and close + 1 <= BUDGET + n_forced, tokens
    assert reasoning(reply) and reply.choices[0].message.content  # the answer follows
    assert len(tokens) == reply.usage.completion_tokens == reply.model_extra["timings"]["predicted_n"]


def test_a_request_budget_of_0_closes_reasoning_at_once(server, oai):
    reply, tokens, close = chat(oai, reasoning_budget_tokens=0)
    assert tokens[:2] == ["\n", END] and close == 1
    assert reasoning(reply) == "" and reply.choices[0].message.content


def test_the_request_message_is_forced_before_the_end_tag(server, oai):
    message = " Enough thinking."
    reply, tokens, close = chat(oai, thinking_budget_tokens=4, reasoning_budget_message=message)
    n_forced = n_tokens(server, message + "\n" + END)
    assert close is not None and close + 1 <= 4 + n_forced, tokens
    assert reasoning(reply).rstrip().endswith(message.strip())
    assert reply.choices[0].message.content


def test_the_streamed_answer_is_the_whole_answer(oai):
    whole, _, _ = chat(oai, reasoning_budget_tokens=3)
    stream = streamed(oai, extra_body={"reasoning_budget_tokens": 3})
    parts = {"content": "", "reasoning_content": ""}
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"content": whole.choices[0].message.content, "reasoning_content": reasoning(whole)}


def test_with_thinking_off_no_budget_applies(oai):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    free, tokens, _ = chat(oai, max_tokens=12, **off)
    budgeted, _, _ = chat(oai, max_tokens=12, reasoning_budget_tokens=0, **off)
    assert tokens[:2] != ["\n", END]
    assert budgeted.choices[0].message.content == free.choices[0].message.content


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning_budget_tokens": -2},
        {"reasoning_budget_tokens": "8"},
        {"thinking_budget_tokens": 1.5},
        {"reasoning_budget_message": 5},
    ],
)
def test_bad_budget_fields_get_a_400(server, fields):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert next(iter(fields)) in response.json()["error"]["message"]


def test_the_command_line_sets_the_defaults(tmp_path):
    model = str(tinyqwen_path("Q4_K_M"))
    parse = build_parser().parse_args
    settings = settings_from_args(parse(["serve", "-m", model]))
    assert settings.chat.reasoning_budget == -1 and settings.chat.reasoning_budget_message == ""
    args = parse(["serve", "-m", model, "--reasoning-budget", "0", "--reasoning-budget-message", "Done."])
    settings = settings_from_args(args)
    assert settings.chat.reasoning_budget == 0 and settings.chat.reasoning_budget_message == "Done."
    with pytest.raises(ValueError, match="--reasoning-budget"):
        settings_from_args(parse(["serve", "-m", model, "--reasoning-budget", "-2"]))


def test_chat_usage_counts_the_reasoning_tokens(oai):
    """`completion_tokens_details.reasoning_tokens`: the tokens before the first content (opencode showed 0)."""
    reply, tokens, close = chat(oai)
    details = reply.usage.completion_tokens_details
    assert close is not None and close + 1 <= details.reasoning_tokens < len(tokens)
    last = list(streamed(oai, stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    off, _, _ = chat(oai, chat_template_kwargs={"enable_thinking": False})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize(("effort", "budget"), [("low", 1024), ("medium", 8192), ("high", BUDGET), ("minimal", 256)])
def test_an_effort_is_a_thinking_budget(oai, effort, budget):
    """`reasoning_effort` sets the budget when the request sets none (server.chat.EFFORT_BUDGETS; "high": the
    server's); Anthropic's `output_config.effort` and Responses' `reasoning.effort` arrive as it."""
    by_effort, _, _ = chat(oai, reasoning_effort=effort)
    by_budget, _, _ = chat(oai, reasoning_budget_tokens=budget)
    assert by_effort.choices[0].message == by_budget.choices[0].message
    explicit, _, _ = chat(oai, reasoning_effort=effort, reasoning_budget_tokens=0)
    assert reasoning(explicit) == ""  # a budget the request sets wins
