"""chat.structured: the grammar a chat request's response_format and tool_choice become, checked by matching
strings against it with xgrammar's own matcher (no tokenizer involved)."""

from __future__ import annotations

import json

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from mtpserve.chat import ThinkTags
from mtpserve.chat.structured import (
    QWEN_XML,
    StructuredOutputError,
    json_grammar,
    output_grammar,
    response_schema,
    tool_call_format,
    tuples_as_prefix_items,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"], "additionalProperties": False}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # noqa: E501


def _grammar(kind_source: tuple[str, str] | None) -> Grammar:
    assert kind_source is not None
    kind, source = kind_source
    if kind == "json_schema":
        return Grammar.from_ebnf(json_grammar(json.loads(source)))
    return Grammar.from_structural_tag(source)


def _plan(**kw) -> Grammar:
    args = dict(
        reasoning=None, tools=None, tool_choice="auto", parallel_tool_calls=True, response_schema=None, tool_format=None
    )
    return _grammar(output_grammar(**{**args, **kw}))


def test_json_is_laid_out_with_two_spaces_and_bounded_digits():
    grammar = Grammar.from_ebnf(json_grammar(SCHEMA))
    assert accepts(grammar, '{\n  "n": 1.5\n}')
    assert not accepts(grammar, '{"n": 1.5}')  # one layout: no free whitespace to pad with
    assert accepts(grammar, '{\n  "n": 0.' + "1" * 16 + "\n}")
    assert not accepts(grammar, '{\n  "n": 0.' + "1" * 17 + "\n}")  # llama.cpp's 16 fraction digits
    assert not accepts(grammar, '{\n  "n": 1' + "0" * 16 + "\n}")


def test_nothing_to_constrain_is_none():
    assert (
        output_grammar(
            reasoning=None,
            tools=None,
            tool_choice="auto",
            parallel_tool_calls=True,
            response_schema=None,
            tool_format=None,
        )
        is None
    )


def test_the_reasoning_stays_free_before_the_json():
    grammar = _plan(reasoning=ThinkTags(), response_schema=SCHEMA)
    assert accepts(grammar, 'Any { text ] here.</think>\n\n{\n  "n": 2\n}')
    assert not accepts(grammar, "Thinking.</think>\n\nplain text")


def test_forced_calls_follow_the_tools_schema():
    grammar = _plan(reasoning=ThinkTags(), tools=[TOOL], tool_choice="required", tool_format=QWEN_XML)
    assert accepts(grammar, "Let me check.</think>\n\n" + CALL)
    assert not accepts(grammar, "Let me check.</think>\n\nIt is sunny.")  # a call is required
    assert not accepts(grammar, "Hm.</think>\n\n" + CALL.replace("\n3\n", "\n9\n"))  # days <= 7


def test_auto_leaves_text_free_and_holds_calls_to_their_schema():
    grammar = _plan(tools=[TOOL], tool_choice="auto", tool_format=QWEN_XML)
    assert accepts(grammar, "It is sunny.")
    assert accepts(grammar, "Checking.\n" + CALL)
    assert not accepts(grammar, "Checking.\n" + CALL.replace("days", "weeks"))


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_strict_false_still_holds_calls_to_their_schema(choice):
    """Codex sends `strict: false` on every tool; xgrammar's preset would leave such arguments free (a forced call
    came back as `{}`), where the server enforces every schema."""
    lax = {"type": "function", "function": {**TOOL["function"], "strict": False}}
    grammar = _plan(tools=[lax], tool_choice=choice, tool_format=QWEN_XML)
    assert accepts(grammar, CALL)
    assert not accepts(grammar, "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
    assert not accepts(grammar, CALL.replace("\n3\n", "\n9\n"))


def test_a_json_answer_or_calls_when_both_are_asked_for():
    grammar = _plan(tools=[TOOL], tool_choice="auto", tool_format=QWEN_XML, response_schema=SCHEMA)
    assert accepts(grammar, '{\n  "n": 1\n}') and accepts(grammar, CALL)
    assert not accepts(grammar, "It is sunny.")


@pytest.mark.parametrize(
    "kw,says",
    [
        (dict(tools=[TOOL], tool_choice="required", tool_format=None), "tool-call format"),
        (dict(tools=None, tool_choice="required"), "needs 'tools'"),
        (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}, tool_format=QWEN_XML), "x"),
        (dict(response_schema={"type": "objekt"}), "json schema"),
    ],
)
def test_what_cannot_be_held_is_refused(kw, says):
    args = dict(
        reasoning=None, tools=None, tool_choice="auto", parallel_tool_calls=True, response_schema=None, tool_format=None
    )
    with pytest.raises(StructuredOutputError, match=says):
        kind, source = output_grammar(**{**args, **kw})
        _grammar((kind, source))


def test_response_formats():
    assert response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}) == SCHEMA
    with pytest.raises(StructuredOutputError, match="yaml"):
        response_schema({"type": "yaml"})


def test_the_qwen_template_format_is_recognised():
    assert tool_call_format("... <tool_call>\n<function=x>\n<parameter=y> ...") == QWEN_XML
    assert tool_call_format("{{ messages }}") is None


def test_forced_calls_allow_no_text_after_them_and_no_padding_in_values():
    grammar = _plan(tools=[TOOL], tool_choice="required", tool_format=QWEN_XML)
    assert accepts(grammar, CALL) and accepts(grammar, CALL + "\n" + CALL)
    assert not accepts(grammar, CALL + "\nDone.")
    assert not accepts(grammar, CALL.replace("\n3\n", "\n 3\n"))
    single = _plan(tools=[TOOL], tool_choice="required", tool_format=QWEN_XML, parallel_tool_calls=False)
    assert accepts(single, CALL) and not accepts(single, CALL + "\n" + CALL)


def test_draft_4_tuples_become_prefix_items_and_hold_the_tuple_alone():
    """`items` as an array (draft 4, llama.cpp's test suite sends it) is today's `prefixItems`; the tuple's
    length is fixed unless `additionalItems` says otherwise, as llama.cpp's schema grammars read it."""
    schema = {"type": "object", "properties": {"pair": {"items": [{"type": "integer"}, {"type": "string"}]}}}
    pair = tuples_as_prefix_items(schema)["properties"]["pair"]
    assert pair == {"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}
    more = tuples_as_prefix_items({"items": [{"type": "integer"}], "additionalItems": {"type": "string"}})
    assert more == {"prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
    grammar = Grammar.from_ebnf(json_grammar({"type": "array", "items": [{"type": "integer"}]}))
    assert accepts(grammar, "[\n  -3000\n]") and not accepts(grammar, "[\n  1,\n  2\n]")
