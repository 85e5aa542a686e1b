"""Assistant prefill as llama-server does it (tools/server/server-common.cpp, oaicompat_chat_params_parse): a
trailing assistant message is continued, not closed; `continue_final_message` (vLLM's name) asks for the same;
the refusals are llama-server's 400s. The output parser reads the prefill as the output's beginning: the answer
holds it, and the stream repeats it unless the request asked for the continuation itself.

The plan and parser are checked directly (tinyqwen35's tokenizer, the `llama3` and Qwen3.5 templates), then
over HTTP on the shared tinyqwen35 server."""

from __future__ import annotations

import json

import httpx
import pytest

from mtpserve.chat import ChatTemplate, resolve_chat_template
from mtpserve.server.chat import ChatOutput, ChatSettings, plan_chat
from mtpserve.server.errors import APIError
from mtpserve.server.params import Body

from ..support.vocabs import model_tokenizer
from .conftest import TINY_ALIAS, TINY_KEY

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
# the end of llama-server's prompt in test_chat_template_assistant_prefill (Llama 3.1 template there, llama3 here)
LLAMA3_GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"
BOOK_END = "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>" + LLAMA3_GEN
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return model_tokenizer("tinyqwen35-mtp-F16")


@pytest.fixture(scope="module")
def llama3() -> ChatTemplate:
    return ChatTemplate(resolve_chat_template("llama3"))


@pytest.fixture(scope="module")
def qwen35(tokenizer) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tokenizer)


def plan(template, tokenizer, settings=None, **body):
    return plan_chat(Body(body), template, tokenizer, settings or ChatSettings())


def refusal(template, tokenizer, **body) -> str:
    with pytest.raises(APIError) as error:
        plan(template, tokenizer, **body)
    assert error.value.code == 400 and error.value.type == "invalid_request_error"
    return error.value.message


@pytest.mark.parametrize(
    ("prefill", "continued"),
    [("Whill", "Whill"), ([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}], "Wh\n\nill")],
)
def test_trailing_assistant_message_is_continued(llama3, tokenizer, prefill, continued):
    p = plan(llama3, tokenizer, messages=[*BOOK, {"role": "assistant", "content": prefill}])
    assert p.prompt_text.endswith(BOOK_END + continued)
    assert p.prompt == tokenizer.encode(p.prompt_text, add_special=True, parse_special=True)
    assert (p.generation_prompt, p.prefill, p.stream_prefill) == (LLAMA3_GEN, continued, True)


def test_continue_final_message_is_the_same_prompt(llama3, tokenizer):
    messages = [*BOOK, {"role": "assistant", "content": "Whill"}]
    implicit = plan(llama3, tokenizer, messages=messages)
    asked = plan(llama3, tokenizer, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert asked.prompt_text == implicit.prompt_text and asked.prompt == implicit.prompt
    assert asked.prefill == "Whill" and not asked.stream_prefill


def test_llama_server_refusals(llama3, tokenizer):
    answer = {"role": "assistant", "content": "Hello"}
    both = refusal(llama3, tokenizer, messages=[*HI, answer], add_generation_prompt=True, continue_final_message=True)
    assert both == "Cannot set both add_generation_prompt and continue_final_message to true."
    two = refusal(llama3, tokenizer, messages=[*HI, answer, answer])
    assert two == "Cannot have 2 or more assistant messages at the end of the list."
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = refusal(llama3, tokenizer, messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert calls == "Cannot continue an assistant message that contains tool calls."


def test_what_is_not_continued(llama3, tokenizer):
    """Without a trailing assistant message, with prefill off, or with continue_final_message false, the prompt
    is the usual one; two trailing answers are fine when the request names the continuation itself."""
    answer = {"role": "assistant", "content": "Hello"}
    closed = llama3.apply([*HI, answer]).prompt
    off = ChatSettings(prefill_assistant=False)
    assert plan(llama3, tokenizer, off, messages=[*HI, answer]).prompt_text == closed
    assert plan(llama3, tokenizer, messages=HI).prefill == ""
    assert plan(llama3, tokenizer, off, messages=[*HI, answer], continue_final_message=False).prefill == ""
    both = plan(
        llama3, tokenizer, messages=[*HI, answer, answer], add_generation_prompt=False, continue_final_message=True
    )
    assert both.prompt_text.endswith("Hello<|eot_id|>" + LLAMA3_GEN + "Hello")


def run(output: ChatOutput, chunks: list[str]) -> list[dict]:
    deltas = [d for chunk in chunks for d in output.feed(chunk)]
    return deltas + output.finish()


def test_the_answer_holds_the_prefill_and_only_an_implicit_one_is_streamed(llama3, tokenizer):
    messages = [*BOOK, {"role": "assistant", "content": "Whill"}]
    implicit = ChatOutput(plan(llama3, tokenizer, messages=messages), llama3)
    assert run(implicit, [" of", " the"]) == [{"content": "Whill"}, {"content": " of"}, {"content": " the"}]
    assert implicit.message() == {"role": "assistant", "content": "Whill of the"}
    p = plan(llama3, tokenizer, messages=messages, add_generation_prompt=False, continue_final_message=True)
    asked = ChatOutput(p, llama3)
    assert run(asked, [" of"]) == [{"content": " of"}]
    assert asked.message() == {"role": "assistant", "content": "Whill of"}
    assert run(ChatOutput(plan(llama3, tokenizer, messages=messages), llama3), []) == [{"content": "Whill"}]


def test_continued_reasoning_is_parsed_as_reasoning(qwen35, tokenizer):
    """Qwen3.5: the prefill reopens `<think>`; the generated text goes on with the reasoning."""
    messages = [*HI, {"role": "assistant", "content": "", "reasoning_content": "The user"}]
    p = plan(qwen35, tokenizer, messages=messages)
    assert p.prompt_text.endswith("<|im_start|>assistant\n<think>\nThe user")
    output = ChatOutput(p, qwen35)
    run(output, [" greets.\n</think>\n\nHello"])
    assert output.message() == {"role": "assistant", "content": "Hello", "reasoning_content": "The user greets.\n"}


def test_continued_content_after_closed_reasoning(qwen35, tokenizer):
    p = plan(qwen35, tokenizer, messages=[*HI, {"role": "assistant", "content": "Hel"}])
    assert p.prompt_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHel")
    output = ChatOutput(p, qwen35)
    run(output, ["lo!"])
    assert output.message() == {"role": "assistant", "content": "Hello!"}


# Over HTTP, on the shared tinyqwen35 server (greedy, a few tokens).


def post(server, body: dict) -> httpx.Response:
    body = {"model": TINY_ALIAS, "max_tokens": 4, "temperature": 0, **body}
    headers = {"Authorization": f"Bearer {TINY_KEY}"}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def streamed_content(server, body: dict) -> list[str]:
    response = post(server, {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return [c["delta"]["content"] for e in events for c in e["choices"] if c["delta"].get("content")]


def test_prefill_over_http(tiny_server):
    messages = [*HI, {"role": "assistant", "content": "Hel"}]
    whole = post(tiny_server, {"messages": messages})
    assert whole.status_code == 200, whole.text
    content = whole.json()["choices"][0]["message"]["content"]
    assert content.startswith("Hel")
    assert "".join(streamed_content(tiny_server, {"messages": messages})) == content
    asked = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert post(tiny_server, asked).json()["choices"][0]["message"]["content"] == content
    assert "Hel" + "".join(streamed_content(tiny_server, asked)) == content


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"continue_final_message": True}, "Cannot set both add_generation_prompt and continue_final_message"),
        (
            {"messages": [*HI, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "2 or more",
        ),
    ],
)
def test_refusals_over_http(tiny_server, extra, says):
    response = post(tiny_server, {"messages": [*HI, {"role": "assistant", "content": "Hel"}], **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and says in error["message"]
