"""Where a chat prompt tells the engine a later request may resume (`ChatPlan.resume_at`): the end of the system
prompt (where the first user message starts) and the end of the messages (where the generation prompt starts).
The prompt cache keeps recurrent checkpoints there, so they must be where the next turn's prompt and a side
request's prompt part from this one (tinyqwen35's tokenizer, its Qwen3.5 template, and the llama3 template)."""

from __future__ import annotations

import pytest

from mtpserve.chat import ChatTemplate, resolve_chat_template
from mtpserve.server.chat import ChatSettings, plan_chat
from mtpserve.server.params import Body

from ..support.vocabs import model_tokenizer

SYSTEM = "You are a careful coding agent. Keep files small."


@pytest.fixture(scope="module")
def tokenizer():
    return model_tokenizer("tinyqwen35-mtp-F16")


@pytest.fixture(scope="module", params=["qwen35", "llama3"])
def template(request, tokenizer) -> ChatTemplate:
    if request.param == "qwen35":
        return ChatTemplate.for_tokenizer(tokenizer)
    return ChatTemplate(resolve_chat_template("llama3"))


def _plan(template, tokenizer, messages, thinking):
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
    return plan_chat(Body(body), template, tokenizer, ChatSettings())


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("thinking", [False, True])
def test_a_side_request_and_the_next_turn_part_at_the_resume_points(template, tokenizer, thinking):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    plan = _plan(template, tokenizer, first, thinking)
    system_end, messages_end = plan.resume_at
    assert system_end < messages_end < len(plan.prompt)
    assert (
        tokenizer.decode(plan.prompt[system_end:messages_end])
        .lstrip()
        .startswith(("List the files.", "<|im_start|>user", "<|start_header_id|>user"))
    )
    assert tokenizer.decode(plan.prompt[messages_end:]) == plan.generation_prompt

    side = _plan(template, tokenizer, [first[0], {"role": "user", "content": "Summarize the session."}], thinking)
    assert system_end <= _shared(plan.prompt, side.prompt)

    reply = {"role": "assistant", "content": "a.py b.py", "reasoning_content": "The user wants files."}
    turn = _plan(template, tokenizer, [*first, reply, {"role": "user", "content": "And sizes?"}], thinking)
    assert messages_end <= _shared(plan.prompt, turn.prompt)
    assert turn.resume_at[0] == system_end  # the system prompt's end does not move as the conversation grows


def test_tool_choice_none_keeps_the_tools_in_the_prompt(tokenizer):
    """As llama-server renders them: a client that turns calls off for one turn (the turn after a tool result, a
    summary) keeps its conversation's prefix; only no call is parsed or constrained on that turn."""
    qwen35 = ChatTemplate.for_tokenizer(tokenizer)
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "List the files."}]

    def plan(choice: str):
        body = {"messages": messages, "tools": [tool], "tool_choice": choice}
        return plan_chat(Body(body), qwen35, tokenizer, ChatSettings())

    auto, none = plan("auto"), plan("none")
    assert none.prompt == auto.prompt and '"name": "read"' in none.prompt_text
    assert auto.tools == [tool] and none.tools is None and none.grammar is None
