"""Reasoning split of `<think>` output (../shared/spec/chat-template.md §4): whole text, the references'
parsed messages, and streaming that equals the whole-text split for every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.chat import ChatTemplate, ReasoningSplit, ReasoningStream, ThinkTags, split_reasoning

from ..support.vocabs import REF_MODELS, model_tokenizer, reference

GEN_ON = "<|im_start|>assistant\n<think>\n"
GEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN = ThinkTags()


@pytest.mark.parametrize(
    ("generation_prompt", "text", "reasoning", "content"),
    [
        # The spec's example: the newline before </think> stays; whitespace after it is skipped.
        (GEN_ON, "I'm\nthinking\n</think>\n\nHello", "I'm\nthinking\n", "Hello"),
        (GEN_ON, "\n  plan</think>answer \n", "plan", "answer \n"),
        # Thinking off: the prompt's empty block is empty reasoning, all output is content.
        (GEN_OFF, "\n\nHello</think>", "", "Hello</think>"),
        # Whitespace-only reasoning is dropped.
        (GEN_ON, " \n</think>\nHi", "", "Hi"),
        # Unterminated (a length stop inside reasoning): all reasoning.
        (GEN_ON, "still thinking</thi", "still thinking</thi", ""),
        # <tool_call> ends reasoning and is not consumed.
        (GEN_ON, "need a tool\n<tool_call>\n<function=f>", "need a tool\n", "<tool_call>\n<function=f>"),
        # A prompt without <think> (e.g. Qwen3 style): the model may open the block itself.
        ("<|im_start|>assistant\n", "<think>x</think>y", "x", "y"),
        ("<|im_start|>assistant\n", "  plain answer", "", "plain answer"),
        ("<|im_start|>assistant\n", "", "", ""),
    ],
)
def test_split(generation_prompt, text, reasoning, content):
    assert split_reasoning(text, generation_prompt, QWEN) == ReasoningSplit(reasoning, content)


def test_split_without_extraction_or_thinking():
    """reasoning_format none keeps the prompt's `<think>` part in content; templates without <think> are
    content-only, text untouched."""
    assert split_reasoning("a</think>b", GEN_ON, QWEN, extract=False) == ReasoningSplit("", "<think>\na</think>b")
    assert split_reasoning("  <think>a</think>", "<|im_start|>assistant\n", None) == ReasoningSplit(
        "", "  <think>a</think>"
    )


def test_tool_call_interrupt_only_for_templates_with_tool_calls():
    assert split_reasoning("x<tool_call>y", GEN_ON, ThinkTags(interrupts=())) == ReasoningSplit("x<tool_call>y", "")


@pytest.mark.parametrize("ref", REF_MODELS)
def test_reference_messages(ref):
    """The references' generated_text_raw, parsed with the prompt's generation prompt, gives their message."""
    tmpl = ChatTemplate.for_tokenizer(model_tokenizer(ref))
    for case in reference(ref)["greedy"]["chat"]:
        prompt = tmpl.apply(case["messages"])
        split = split_reasoning(case["generated_text_raw"], prompt.generation_prompt, tmpl.think_tags)
        message = case["message"]
        assert split.content == message["content"], case["name"]
        assert split.reasoning_content == message.get("reasoning_content", ""), case["name"]
        stream = ReasoningStream(prompt.generation_prompt, tmpl.think_tags)
        for piece in case["generated_text_raw"]:
            stream.feed(piece)
        stream.finish()
        assert (stream.reasoning_content, stream.content) == (split.reasoning_content, split.content)


def test_stream_holds_back_a_possible_delimiter():
    stream = ReasoningStream(GEN_ON, QWEN)
    assert stream.feed("\n") == ReasoningSplit("", "")
    assert stream.feed("step one <") == ReasoningSplit("step one ", "")
    assert stream.feed("/thi") == ReasoningSplit("", "")
    assert stream.feed("nk>") == ReasoningSplit("", "")
    assert stream.feed("\n\n") == ReasoningSplit("", "")
    assert stream.feed("Answer <b>") == ReasoningSplit("", "Answer <b>")
    assert stream.finish() == ReasoningSplit("", "")


def test_stream_releases_a_false_alarm():
    stream = ReasoningStream(GEN_ON, QWEN)
    assert stream.feed("a </th") == ReasoningSplit("a ", "")
    assert stream.feed("ere") == ReasoningSplit("</there", "")
    assert stream.feed("<tool_c") == ReasoningSplit("", "")
    assert stream.finish() == ReasoningSplit("<tool_c", "")


_PIECES = ["<think>", "</think>", "<tool_call>", "<", "</", "<t", "</thi", "think", ">", "\n", " ", "a", "b c", "é"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_PIECES), max_size=14).map("".join),
    st.sampled_from([GEN_ON, GEN_OFF, "<|im_start|>assistant\n", ""]),
    st.sampled_from([QWEN, ThinkTags(interrupts=()), None]),
    st.booleans(),
    st.data(),
)
def test_stream_equals_full_split_for_any_chunking(text, generation_prompt, tags, extract, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = ReasoningStream(generation_prompt, tags, extract)
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    expected = split_reasoning(text, generation_prompt, tags, extract)
    assert "".join(d.reasoning_content for d in deltas) == expected.reasoning_content
    assert "".join(d.content for d in deltas) == expected.content
    assert (stream.reasoning_content, stream.content) == (expected.reasoning_content, expected.content)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14).map("".join))
def test_stream_one_character_at_a_time(text):
    stream = ReasoningStream(GEN_ON, QWEN)
    for ch in text:
        stream.feed(ch)
    stream.finish()
    assert ReasoningSplit(stream.reasoning_content, stream.content) == split_reasoning(text, GEN_ON, QWEN)
