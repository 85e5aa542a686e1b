"""Tool calls in Qwen3.5/3.6 output: `content` text and OpenAI `tool_calls`, as llama-server returns them.

The model writes calls after optional text (../shared/spec/chat-template.md §2, §4; llama.cpp's handler
common/parsers/qwen3-coder.cpp):

    Text.\\n\\n<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

The input here is the *content* part that `reasoning.py` split off. Content is the text before the first
`<tool_call>` (trailing whitespace dropped); from there on come the calls. A value is the text between
`<parameter=KEY>` and `</parameter>` less one leading and one trailing whitespace character (the template
writes a newline there, the grammar lets any one whitespace character stand for it), typed by the tool's JSON
schema: string params stay raw (an enum's or const's value stripped of surrounding whitespace, typed or not),
others are `json.loads`-ed (the raw string if that fails).

llama-server constrains the calls with a grammar, so its output is always well formed; we may run without
one, so this parser is lenient and these are our decisions for the cases llama.cpp never sees:
* Unknown tool or param: no schema to go by, so a value that parses as JSON is JSON, else the raw string.
  A param typed string-or-X (e.g. `["integer", "string"]`) is JSON only if it parses to one of the X.
* A value ends only at a `</parameter>` that the next `<parameter=NAME>` or `</function>` follows: the
  template writes values unescaped, and an agent's file may hold any of the format's tags (a `write` whose
  content mentioned `<tool_call>` once lost its content). A `</parameter>` that nothing follows, or the last
  one when none is followed so, ends it in a whole text.
* A block is `<tool_call>` up to `</tool_call>`, the next `<tool_call>` or the end of the text, looked for
  after its last value. It is a call when it starts with a complete `<function=NAME>`; its params are those
  complete before `</function>` or before anything that is not a param. So a call cut short (a length stop)
  keeps its complete params.
* Text between or after blocks, and blocks without a name, are dropped once there is a call (the template
  forbids text after calls). If no block has a name, there were no calls: the whole text is content, as if
  `<tool_call>` were prose. With `parallel=False` only the first call is kept.
* Arguments are compact JSON (`{"city":"Paris"}`, as llama-server and OpenAI write them), non-ASCII kept,
  keys in the order written.

`parse_tool_calls` parses a whole text; `ToolCallStream` does it incrementally for streaming. It holds
back content that could still be the start of `<tool_call>` (and whitespace before it), sends a call's
id and name as soon as `<function=NAME>` is complete and its whole arguments string once `</function>`
(or the block's end) arrives; its deltas, joined, equal `parse_tool_calls` for any chunking.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .reasoning import WHITESPACE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAM, END_PARAM = "<parameter=", "</parameter>"
ID_ALPHABET = string.digits + string.ascii_letters

Tools = Sequence[Mapping[str, Any]] | None
Schemas = dict[str, dict[str, Any]]  # tool name -> param name -> JSON schema


def random_call_id() -> str:
    """32 random alphanumerics, the shape of llama-server's call ids."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(32))


@dataclass(frozen=True)
class ToolCallSplit:
    content: str
    tool_calls: list[dict[str, Any]]


@dataclass(frozen=True)
class ToolCallDelta:
    """New content text and OpenAI streaming `tool_calls` deltas."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Block:
    name: str | None
    params: list[tuple[str, str]]
    closed: bool  # `</function>` seen: params are final however the block goes on
    partial: tuple[str, str] | None = None  # a param whose value has begun but not ended: (name, value so far)


def _schemas(tools: Tools) -> Schemas:
    """Param schemas by tool; accepts OpenAI `{"type": "function", "function": {...}}` or the bare function."""
    out: Schemas = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _types(schema: Any) -> set[str]:
    """JSON types a schema allows (`type`, its `anyOf`/`oneOf` members, an all-string `enum`, a string `const`);
    empty if unknown."""
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= _types(sub)
    enum = schema.get("enum")
    if not types and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        types = {"string"}
    if not types and isinstance(schema.get("const"), str):
        types = {"string"}
    return types


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", dict: "object", list: "array", str: "string"}.get(type(value), "null")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN/Infinity are not JSON; the value stays a string


def _typed(raw: str, schema: Any) -> Any:
    """A param value as its schema types it (module docstring for the unknown and string-or-X cases)."""
    types = _types(schema)
    if types == {"string"}:
        # a value from a fixed set has no whitespace of its own: what surrounds it (the grammar lets one
        # whitespace character stand for the newline after `<parameter=KEY>`) is not part of it
        fixed = isinstance(schema, dict) and ("enum" in schema or "const" in schema)
        return raw.strip(WHITESPACE) if fixed else raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw
    if "string" not in types:
        return value
    kind = _json_type(value)
    ok = kind in types or (kind == "integer" and "number" in types)
    return value if ok and kind != "string" else raw


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _tag_value(text: str, pos: int, tag: str) -> tuple[str, int] | None:
    """`X` and the index after `>` if `tag X>` is at pos, X non-empty without whitespace or `<`."""
    if not text.startswith(tag, pos):
        return None
    gt = text.find(">", pos)
    value = text[pos + len(tag) : gt]
    if gt < 0 or not value or any(c in WHITESPACE or c == "<" for c in value):
        return None
    return value, gt + 1


def _value_end(text: str, pos: int, whole: bool) -> int | None:
    """Where the value starting at `pos` ends: at a `</parameter>` that a complete `<parameter=NAME>` or
    `</function>` follows (whitespace between), so that a value may hold any of the format's tags, its own
    closing tag included (the template writes values unescaped). In a `whole` text, a `</parameter>` that
    nothing more follows ends the value, and so does the last one when none is followed so (malformed output:
    the value is what came before it); in a text still arriving those are undecided (None), as is a value
    with no `</parameter>` yet."""
    end, last = text.find(END_PARAM, pos), None
    while end >= 0:
        after = _skip_ws(text, end + len(END_PARAM))
        rest = text[after:]
        if _tag_value(text, after, PARAM) is not None or rest.startswith(END_FUNCTION):
            return end
        if _may_become(rest, PARAM) or END_FUNCTION.startswith(rest):
            return end if whole else None  # what follows is not in yet
        end, last = text.find(END_PARAM, end + len(END_PARAM)), end
    return last if whole else None


def _may_become(rest: str, tag: str) -> bool:
    """Whether more text could make `rest` a complete `tag NAME>` (it is a prefix of one)."""
    if len(rest) <= len(tag):
        return tag.startswith(rest)
    name = rest[len(tag) :]
    return rest.startswith(tag) and not any(c in WHITESPACE or c in "<>" for c in name)


def _parse_block(body: str, whole: bool) -> _Block:
    """The text after `<tool_call>`, whole or as far as it has arrived: a tag only counts once its `>` is in,
    and a value's end once what follows it says so (_value_end), so what this finds in a prefix stays true
    for the whole block."""
    head = _tag_value(body, _skip_ws(body, 0), FUNCTION)
    if head is None:
        return _Block(None, [], False)
    name, pos = head
    params: list[tuple[str, str]] = []
    while True:
        pos = _skip_ws(body, pos)
        if body.startswith(END_FUNCTION, pos):
            return _Block(name, params, True)
        key = _tag_value(body, pos, PARAM)
        end = _value_end(body, key[1], whole) if key else None
        if key is None or end is None:
            partial = (key[0], _unpad(body[key[1] :], end=False)) if key else None
            return _Block(name, params, False, partial)
        params.append((key[0], _unpad(body[key[1] : end])))
        pos = end + len(END_PARAM)


def _unpad(value: str, end: bool = True) -> str:
    """A value less the one whitespace character on each side that stands for the template's newline (the
    grammar lets a space or tab stand there: a constrained tiny model wrote `<parameter=filePath> /tmp/a`)."""
    if value[:1] in WHITESPACE:
        value = value[1:]
    return value[:-1] if end and value[-1:] in WHITESPACE else value


def _block_end(text: str, start: int, whole: bool) -> tuple[int, int] | None:
    """(end of body, where to look for the next block) for the block whose body starts at `start`: its
    `</tool_call>`, or the next `<tool_call>`, after its last parameter, never inside a value. None while a
    value has not ended, or no end has arrived."""
    pos = start
    head = _tag_value(text, _skip_ws(text, start), FUNCTION)
    if head is not None:
        pos = head[1]
        while (key := _tag_value(text, _skip_ws(text, pos), PARAM)) is not None:
            end = _value_end(text, key[1], whole)
            if end is None:
                return None
            pos = end + len(END_PARAM)
    close, reopen = text.find(CLOSE, pos), text.find(OPEN, pos)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close, close + len(CLOSE)
    return (reopen, reopen) if reopen >= 0 else None


def _arguments(block: _Block, schemas: Schemas) -> str:
    assert block.name is not None
    props = schemas.get(block.name, {})
    return json.dumps({k: _typed(v, props.get(k)) for k, v in block.params}, ensure_ascii=False, separators=(",", ":"))


def _cut_arguments(block: _Block, schemas: Schemas) -> str:
    """The arguments of a call cut off by the token limit, as far as they were generated: a JSON prefix (what
    OpenAI returns with finish_reason "length"), a begun string value left open; never a closed object the
    model did not write."""
    assert block.name is not None
    text = _arguments(block, schemas)[:-1]  # the params that ended, without the closing brace
    if block.partial is None:
        return text
    key, value = block.partial
    types = _types(schemas.get(block.name, {}).get(key))
    raw = json.dumps(value, ensure_ascii=False)[:-1] if not types or "string" in types else value
    return f"{text}{',' if block.params else ''}{json.dumps(key, ensure_ascii=False)}:{raw}"


def parse_tool_calls(
    text: str, tools: Tools, parallel: bool = True, make_id: Callable[[], str] = random_call_id
) -> ToolCallSplit:
    """Split a whole content text into content and OpenAI `tool_calls`; `tools` empty/None: all content."""
    first = text.find(OPEN) if tools else -1
    if first < 0:
        return ToolCallSplit(text, [])
    schemas = _schemas(tools)
    calls: list[dict[str, Any]] = []
    at = first
    while at >= 0 and (parallel or not calls):
        start = at + len(OPEN)
        body_end, after = _block_end(text, start, whole=True) or (len(text), len(text))
        block = _parse_block(text[start:body_end], whole=True)
        if block.name is not None:
            function = {"name": block.name, "arguments": _arguments(block, schemas)}
            calls.append({"type": "function", "function": function, "id": make_id()})
        at = text.find(OPEN, after)
    if not calls:
        return ToolCallSplit(text, [])
    return ToolCallSplit(text[:first].rstrip(WHITESPACE), calls)


class ToolCallStream:
    """Incremental `parse_tool_calls`: `feed(delta)` and finally `finish()` return new content and tool-call
    deltas; `content`/`tool_calls` hold all content so far and the calls completed so far (whole OpenAI
    calls, as `parse_tool_calls` gives them)."""

    def __init__(self, tools: Tools, parallel: bool = True, make_id: Callable[[], str] = random_call_id) -> None:
        self._enabled = bool(tools)
        self._schemas = _schemas(tools)
        self._parallel = parallel
        self._make_id = make_id
        self._buf = ""  # content not yet sent
        self._section: str | None = None  # text from the first <tool_call> on
        self._gap = ""  # whitespace before it: content only if no call comes
        self._block: int | None = None  # start of the current block's <tool_call> in _section
        self._search = 0  # between blocks: where the next <tool_call> is looked for
        self._current: dict[str, Any] | None = None  # call of the current block, once its name is sent
        self._sent = False  # ... and its arguments too
        self._calls = 0
        self._done = False  # parallel=False and the first call is complete
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.cut_call = False  # the last call was cut off by the token limit: its arguments are unfinished

    def feed(self, delta: str) -> ToolCallDelta:
        if not self._enabled:
            self.content += delta
            return ToolCallDelta(delta)
        return self._advance(delta, final=False)

    def finish(self, cut: bool = False) -> ToolCallDelta:
        """End of output: held-back text is released. A call cut short is closed with its complete params when
        the model ended it (an end-of-generation token: the call is taken as meant); with `cut` (the token limit
        ended it) its arguments are what was generated, an unfinished JSON prefix, and `cut_call` says so."""
        return self._advance("", final=True, cut=cut)

    def _advance(self, delta: str, final: bool, cut: bool = False) -> ToolCallDelta:
        content, deltas, scan = "", [], final or ">" in delta
        if self._section is None:
            buf = self._buf + delta
            first = buf.find(OPEN)
            if first >= 0:
                content = buf[:first].rstrip(WHITESPACE)
                self._gap, self._section, self._buf = buf[len(content) : first], buf[first:], ""
            elif final:
                content, self._buf = buf, ""
            else:
                cut = len(buf[: len(buf) - _partial_len(buf, OPEN)].rstrip(WHITESPACE))
                content, self._buf = buf[:cut], buf[cut:]
        elif not self._done:
            self._section += delta
        # Any change in the section (its start, a tag, a block's end) comes with a `>`: no scan without one.
        if scan and self._section is not None and not self._done:
            deltas = self._scan(final, cut)
        if final and self._section is not None and self._calls == 0:
            content += self._gap + self._section  # no call after all: it was prose
        self.content += content
        return ToolCallDelta(content, deltas)

    def _scan(self, final: bool, cut: bool) -> list[dict[str, Any]]:
        section, deltas = self._section or "", []
        while not self._done:
            if self._block is None:
                self._block = section.find(OPEN, self._search)
                if self._block < 0:
                    self._block = None
                    break
            start = self._block + len(OPEN)
            end = _block_end(section, start, whole=final)
            if end is None and not final:
                self._update(_parse_block(section[start:], whole=False), False, deltas)
                break
            body_end, self._search = end or (len(section), len(section))
            block = _parse_block(section[start:body_end], whole=True)
            self._update(block, True, deltas, cut=cut and end is None and not block.closed)
            self._block, self._current = None, None
        return deltas

    def _update(self, block: _Block, complete: bool, deltas: list[dict[str, Any]], cut: bool = False) -> None:
        """Send the block's id and name once its name is known, its arguments once they are final (`cut`: as far
        as they were generated)."""
        if block.name is None:
            return
        if self._current is None:
            self._current = {"type": "function", "function": {"name": block.name, "arguments": ""}}
            self._current["id"] = self._make_id()
            function = {"name": block.name, "arguments": ""}
            deltas.append({"index": self._calls, "id": self._current["id"], "type": "function", "function": function})
            self._calls += 1
            self._sent = False
        if (complete or block.closed) and not self._sent:
            arguments = _cut_arguments(block, self._schemas) if cut else _arguments(block, self._schemas)
            self._current["function"]["arguments"] = arguments
            self.cut_call = cut
            self.tool_calls.append(self._current)
            deltas.append({"index": self._calls - 1, "function": {"arguments": arguments}})
            self._sent, self._done = True, not self._parallel


def _partial_len(text: str, delimiter: str) -> int:
    """Length of the longest tail of text that is a proper prefix of delimiter."""
    for n in range(min(len(delimiter) - 1, len(text)), 0, -1):
        if text.endswith(delimiter[:n]):
            return n
    return 0
