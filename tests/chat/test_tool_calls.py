"""Tool calls in Qwen3.5/3.6 content (../shared/spec/chat-template.md §2, §4): whole text, and streaming
that equals the whole-text parse for every chunking."""

from __future__ import annotations

import itertools
import json
import re
from functools import cache

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mtpserve.chat.tool_calls import (
    ToolCallDelta,
    ToolCallSplit,
    ToolCallStream,
    parse_tool_calls,
    random_call_id,
)


def _tool(name: str, **props: object) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    _tool("get_weather", city={"type": "string"}, days={"type": "integer"}),
    _tool(
        "configure",
        enabled={"type": "boolean"},
        ratio={"type": "number"},
        options={"type": "object"},
        tags={"type": "array", "items": {"type": "string"}},
        zip={"type": "string"},
        limit={"type": ["integer", "string"]},
        mode={"enum": ["fast", "slow"]},
    ),
    _tool("python", code={"type": "string"}),
    _tool("ping"),
]


def ids():
    """Deterministic ids: call_0, call_1, ... for each parse."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name: str, args: dict, i: int = 0) -> dict:
    arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return {"type": "function", "function": {"name": name, "arguments": arguments}, "id": f"call_{i}"}


def block(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = block("get_weather", ("city", "Paris"), ("days", "3"))


def parse(text: str, parallel: bool = True):
    return parse_tool_calls(text, TOOLS, parallel, make_id=ids())


def test_no_call_is_all_content():
    assert parse("Just text.\n") == ToolCallSplit("Just text.\n", [])
    assert parse("Hi <tool_call").content == "Hi <tool_call"


def test_one_call_with_text_before():
    split = parse("Let me check.\n\n" + WEATHER)
    assert split.content == "Let me check."
    assert split.tool_calls == [call("get_weather", {"city": "Paris", "days": 3})]
    assert split.tool_calls[0]["function"]["arguments"] == '{"city":"Paris","days":3}'


def test_typed_params():
    text = block(
        "configure",
        ("enabled", "true"),
        ("ratio", "0.5"),
        ("options", '{"a": [1, 2], "b": null}'),
        ("tags", '["x", "ü"]'),
        ("zip", "01234"),  # string-typed: stays raw although it looks like a number
        ("limit", "7"),
        ("mode", "fast"),
    )
    args = json.loads(parse(text).tool_calls[0]["function"]["arguments"])
    assert args == {
        "enabled": True,
        "ratio": 0.5,
        "options": {"a": [1, 2], "b": None},
        "tags": ["x", "ü"],
        "zip": "01234",
        "limit": 7,
        "mode": "fast",
    }
    assert list(args) == ["enabled", "ratio", "options", "tags", "zip", "limit", "mode"]  # order written
    assert "ü" in parse(text).tool_calls[0]["function"]["arguments"]  # ensure_ascii=False


@pytest.mark.parametrize(
    ("name", "key", "raw", "value"),
    [
        ("get_weather", "days", "three", "three"),  # not JSON: the raw string
        ("get_weather", "days", "NaN", "NaN"),  # not JSON either
        ("get_weather", "city", "3", "3"),
        ("configure", "limit", "none", "none"),  # string-or-integer: JSON only if an integer
        ("configure", "limit", '"q"', '"q"'),
        ("get_weather", "extra", "[1]", [1]),  # unknown param: JSON if it parses
        ("get_weather", "extra", "Lyon", "Lyon"),
        ("unknown_tool", "n", "42", 42),  # unknown tool: same
        ("unknown_tool", "s", "a b", "a b"),
    ],
)
def test_value_typing_fallbacks(name, key, raw, value):
    assert json.loads(parse(block(name, (key, raw))).tool_calls[0]["function"]["arguments"]) == {key: value}


def test_multiline_string_keeps_indent_and_inner_newlines():
    code = '    def f():\n        return "</function>"\n\nf()\n'  # ends in a newline: "\n\n</parameter>"
    split = parse(block("python", ("code", code)))
    assert json.loads(split.tool_calls[0]["function"]["arguments"]) == {"code": code}


def test_two_calls_parallel_and_not():
    text = "Two.\n" + WEATHER + "\n" + block("ping")
    both = [call("get_weather", {"city": "Paris", "days": 3}), call("ping", {}, 1)]
    assert parse(text) == ToolCallSplit("Two.", both)
    assert parse(text, parallel=False).tool_calls == both[:1]


def test_unterminated_call_keeps_complete_params():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    assert parse(text) == ToolCallSplit("", [call("get_weather", {"city": "Paris"})])
    # Name cut short: no call, the text was prose.
    assert parse("Calling <tool_call>\n<function=get_wea").content == "Calling <tool_call>\n<function=get_wea"
    # After a call, a cut-short block without a name is dropped.
    assert parse(WEATHER + "\n<tool_call>\n<func").tool_calls == [call("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize(
    "tail,arguments",
    [
        ("<parameter=city>\nPar", '{"city":"Par'),  # a string value begun: left open
        ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1", '{"city":"Paris","days":1'),
        ("<parameter=city>\nParis\n</parameter>\n<param", '{"city":"Paris"'),  # the next tag not yet whole
        ("<parame", "{"),
    ],
)
def test_a_call_cut_by_the_token_limit_keeps_the_arguments_generated(tail, arguments):
    """finish(cut=True) (finish_reason "length"): the arguments as far as the model wrote them, an unfinished JSON
    prefix as OpenAI returns it, never a closed object; streamed or whole, the same text. Without `cut` (the model
    ended the output) the call is closed with its complete params, as before (issue 36, finding 8: a cut call
    came back as `"{}"`)."""
    text = "<tool_call>\n<function=get_weather>\n" + tail
    for pieces in ([text], [text[:9], text[9:30], text[30:]]):
        stream = ToolCallStream(TOOLS, make_id=ids())
        streamed = "".join(d["function"].get("arguments", "") for p in pieces for d in stream.feed(p).tool_calls)
        streamed += "".join(d["function"].get("arguments", "") for d in stream.finish(cut=True).tool_calls)
        assert stream.cut_call and streamed == arguments == stream.tool_calls[0]["function"]["arguments"]
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)
    ended = ToolCallStream(TOOLS, make_id=ids())
    ended.feed(text)
    ended.finish()
    assert not ended.cut_call and json.loads(ended.tool_calls[0]["function"]["arguments"]) == (
        {"city": "Paris"} if "Paris\n</parameter>" in tail else {}
    )
    closed = ToolCallStream(TOOLS, make_id=ids())  # `</function>` written: the call is whole, cut or not
    closed.feed(WEATHER.removesuffix("\n</tool_call>"))
    closed.finish(cut=True)
    assert not closed.cut_call and closed.tool_calls == [call("get_weather", {"city": "Paris", "days": 3})]


def test_malformed_blocks():
    # A block without a function is dropped once another block is a call; text after the calls too.
    text = "A <tool_call>junk</tool_call>" + block("ping") + " trailing"
    assert parse(text) == ToolCallSplit("A", [call("ping", {})])
    # Nothing is a call: all content, untouched.
    assert parse("x <tool_call>junk</tool_call> y").content == "x <tool_call>junk</tool_call> y"
    # A new <tool_call> ends an unclosed block; params stop at anything that is not a param.
    text = "<tool_call>\n<function=ping>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n?"
    assert parse(text).tool_calls == [call("ping", {}), call("get_weather", {"city": "X"}, 1)]


def test_random_ids():
    split = parse_tool_calls(WEATHER + block("ping"), TOOLS)
    assert all(re.fullmatch(r"[0-9A-Za-z]{32}", c["id"]) for c in split.tool_calls)
    assert split.tool_calls[0]["id"] != split.tool_calls[1]["id"] and random_call_id() != random_call_id()


def test_without_tools_everything_is_content():
    assert parse_tool_calls(WEATHER, None).content == WEATHER
    stream = ToolCallStream([])
    assert stream.feed("a \n<tool_") == ToolCallDelta("a \n<tool_")
    assert stream.feed(WEATHER) == ToolCallDelta(WEATHER)
    assert stream.finish() == ToolCallDelta()


def test_stream_deltas():
    stream = ToolCallStream(TOOLS, make_id=ids())
    assert stream.feed("Checking <") == ToolCallDelta("Checking")
    assert stream.feed("b> \n") == ToolCallDelta(" <b>")
    assert stream.feed("<tool_call>\n<function=get_wea") == ToolCallDelta()
    header = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert stream.feed("ther>\n<parameter=city>\nParis\n</parameter>\n") == ToolCallDelta("", [header])
    assert stream.feed("</function>") == ToolCallDelta(
        "", [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]
    )
    assert stream.feed("\n</tool_call>\n") == ToolCallDelta()
    assert stream.finish() == ToolCallDelta()
    assert (stream.content, stream.tool_calls) == ("Checking <b>", [call("get_weather", {"city": "Paris"})])


def assemble(deltas: list[ToolCallDelta]) -> tuple[str, list[dict]]:
    """Content and whole calls from stream deltas, as an OpenAI client rebuilds them."""
    calls: list[dict] = []
    for d in deltas:
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] == len(calls)
                calls.append({"type": tc["type"], "function": dict(tc["function"]), "id": tc["id"]})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return "".join(d.content for d in deltas), calls


TEXTS = [
    "Plain answer \n",
    "Let me check.\n\n" + WEATHER + "\n" + block("python", ("code", "x = '<tool_call>'[1:]\n")) + "\n",
    block("configure", ("options", '{"a": 1}'), ("zip", "007")) + block("ping"),
    "Cut " + WEATHER[:-30],
    "Prose about <tool_call> and <tool_ca",
]
_PIECES = [
    "<tool_call>\n<function=get_weather>\n",
    "<tool_call>",
    "</tool_call>",
    "<function=ping>",
    "</function>",
    "<parameter=days>\n3\n</parameter>\n",
    "<parameter=city>",
    "</parameter>",
    "<tool_",
    "</",
    "<",
    ">",
    "\n",
    " ",
    "3",
    "x é",
]


def _chunks(text: str, data: st.DataObject) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _check_stream(text: str, chunks: list[str], parallel: bool) -> None:
    stream = ToolCallStream(TOOLS, parallel, make_id=ids())
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    expected = parse(text, parallel)
    assert assemble(deltas) == (expected.content, expected.tool_calls)
    assert (stream.content, stream.tool_calls) == (expected.content, expected.tool_calls)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TEXTS), st.booleans(), st.data())
def test_stream_equals_whole_parse_for_any_chunking(text, parallel, data):
    _check_stream(text, _chunks(text, data), parallel)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=16).map("".join), st.booleans(), st.data())
def test_stream_equals_whole_parse_on_random_fragments(text, parallel, data):
    _check_stream(text, _chunks(text, data), parallel)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_one_character_at_a_time(text):
    _check_stream(text, list(text), True)


def test_an_enum_value_loses_the_whitespace_around_it_a_free_string_one_character_a_side():
    """Constrained calls may put one whitespace character where the template writes a newline
    (`<parameter=unit> celsius`): that character is not the value's; a value from a fixed set has no whitespace
    of its own at all."""
    tools = [
        _tool(
            "pick",
            unit={"type": "string", "enum": ["celsius", "fahrenheit"]},
            note={"type": "string"},
            cmd={"const": "ls"},
        )
    ]
    text = "<tool_call>\n<function=pick>\n<parameter=unit> celsius\n</parameter>\n<parameter=note>  hi \n</parameter>\n<parameter=cmd> ls</parameter>\n</function>\n</tool_call>"  # noqa: E501
    split = parse_tool_calls(text, tools)
    assert json.loads(split.tool_calls[0]["function"]["arguments"]) == {"unit": "celsius", "note": " hi ", "cmd": "ls"}


# Every tag of the Qwen 3.5/3.6 format, for arguments that hold them (an agent editing this very parser writes them)
FORMAT_TAGS = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>"]
FORMAT_TAGS += ["</think>", "<parameter=path>", "<function=write>", ">", "\n"]
ARGUMENT = st.lists(st.one_of(st.sampled_from(FORMAT_TAGS), st.text(max_size=4)), max_size=10).map("".join)
WRITE = _tool("write", path={"type": "string"}, content={"type": "string"})


@cache
def _qwen_template():
    from mtpserve.chat import ChatTemplate

    from ..support.vocabs import model_tokenizer

    return ChatTemplate.for_tokenizer(model_tokenizer("tinyqwen35-mtp-F16"))


def _rendered_call(path: str, content: str) -> str:
    """The assistant turn the Qwen template writes for a `write` call, as the model would have generated it."""
    arguments = json.dumps({"path": path, "content": content})
    calls = [{"type": "function", "id": "c", "function": {"name": "write", "arguments": arguments}}]
    answer = {"role": "assistant", "content": "", "tool_calls": calls}
    messages = [{"role": "user", "content": "go"}, answer]
    prompt = _qwen_template().apply(messages, tools=[WRITE], add_generation_prompt=False).prompt
    turn = prompt[prompt.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    turn = turn[: turn.rindex("<|im_end|>")]
    return turn[turn.index("</think>") + len("</think>") :].lstrip() if "</think>" in turn else turn


def test_an_argument_holding_tool_call_tags_keeps_its_content():
    """A `write` whose content mentions `<tool_call>` once came back as {"path": "t.py"} (issue 37)."""
    content = 'OPEN = "<tool_call>"\nCLOSE = "</tool_call>"\nEND = "</parameter>"  # then </function>, <think>'
    text = _rendered_call("t.py", content)
    split = parse_tool_calls(text, [WRITE], make_id=ids())
    assert split.tool_calls == [call("write", {"path": "t.py", "content": content})]
    assert _streamed(text, [WRITE], 1).tool_calls == split.tool_calls


@settings(max_examples=300, deadline=None)
@given(path=ARGUMENT, content=ARGUMENT, chunk=st.integers(1, 7))
def test_any_arguments_round_trip_through_the_template_and_the_parser(path, content, chunk):
    """Arguments holding any of the format's tags come back as they went in, whole and streamed; the template
    writes values unescaped, so the one text no parser can read back is a value holding `</parameter>` followed
    by the next tag the format writes there (left out below), and values keep no leading or trailing newline."""
    assume(not any(re.search(r"</parameter>\s*(<parameter=[^\s<>]+>|</function>)", v) for v in (path, content)))
    assume(all(v == v.strip("\n") for v in (path, content)))
    text = _rendered_call(path, content)
    split = parse_tool_calls(text, [WRITE], make_id=ids())
    assert split.tool_calls == [call("write", {"path": path, "content": content})], text
    assert _streamed(text, [WRITE], chunk).tool_calls == split.tool_calls


def _streamed(text: str, tools: list, chunk: int) -> ToolCallStream:
    stream = ToolCallStream(tools, make_id=ids())
    for i in range(0, len(text), chunk):
        stream.feed(text[i : i + chunk])
    stream.finish()
    return stream
