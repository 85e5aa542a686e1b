"""What a chat request's output must look like, as an xgrammar structural tag: the reasoning block left free, then
a JSON answer (`response_format`) and/or tool calls in the template's own format (`tool_choice`).

The engine compiles the tag (engine.grammar); this module only knows the chat formats. Decisions, where OpenAI
and llama-server leave room:
* The constraint starts after the reasoning: when the generation prompt opened a `<think>` block, the grammar's
  first part is any text (no `<think>`/`</think>` inside) up to `</think>`, then `\\n\\n` (Qwen's templates
  write that), then the constrained answer. With thinking off (or a template without it) the answer starts at
  once.
* Tool calls are constrained only in a format we parse (Qwen 3.5/3.6's XML calls, xgrammar's `qwen_3_5` preset:
  each parameter typed by the tool's JSON schema). `tool_choice` "required" or a named function with another
  template is refused (400): without a grammar the call could not be guaranteed. "auto" is lazy, as in
  llama-server: text is free until the model opens `<tool_call>`, then the call is held to the tools' schemas.
* `response_format` with tools under "auto": the answer is either JSON matching the schema or tool calls.
  `strict` is accepted and ignored: every schema is enforced (xgrammar's preset would leave a `strict: false`
  tool's arguments free, and Codex sends that flag on every tool).
* `json_object` without a schema: any JSON object.
* JSON answers are laid out as `JSON.stringify(value, null, 2)` would (xgrammar's `indent=2`, no other
  whitespace): a sampling model given free whitespace pads with runs of newlines until the tokens run out
  (seen at temperature 1 on SmolLM2); llama.cpp's grammars bound it differently (one newline and up to 20
  spaces per gap). Tool arguments, written as XML with JSON only for non-string values, allow runs of up to
  ARGUMENT_WHITESPACE (more lets an enum's value carry whitespace that then fails the schema). A string
  parameter is free text up to `</parameter>` (its maxLength is not enforced by the preset).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import ChatTemplateError
from .reasoning import ThinkTags

QWEN_XML = "qwen_xml"  # <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</tool_call>
ANY_OBJECT: dict[str, Any] = {"type": "object"}
AFTER_REASONING = "\n\n"
JSON_INDENT = 2  # as engine.grammar: JSON answers are laid out as JSON.stringify(value, null, 2)
# xgrammar 0.2.9's unbounded digit runs in its JSON grammars, and llama.cpp's bounds for them
UNBOUNDED_DIGITS = (("[1-9] [0-9]*", "[1-9] [0-9]{0,15}"), ("basic_number_digits{1, -1}", "basic_number_digits{1, 16}"))
ARGUMENT_WHITESPACE = 1  # whitespace runs in tool arguments: enum values exact, JSON values compact-ish


class StructuredOutputError(ChatTemplateError):
    """A response_format / tool_choice combination this template cannot be held to."""


def tool_call_format(template_source: str) -> str | None:
    """The tool-call format a template writes, when it is one we constrain (None otherwise)."""
    if all(tag in template_source for tag in ("<tool_call>", "<function=", "<parameter=")):
        return QWEN_XML
    return None


def output_grammar(
    *,
    reasoning: ThinkTags | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool,
    response_schema: dict[str, Any] | None,
    tool_format: str | None,
) -> tuple[str, str] | None:
    """(kind, source) of the grammar a chat request's output must match (engine.grammar's kinds: "json_schema"
    for a JSON answer with no reasoning before it, else "structural_tag"), or None when nothing is constrained.
    `reasoning`: the think tags when the generation prompt opened a reasoning block; `response_schema`:
    response_format's schema."""
    from xgrammar import structural_tag as st

    answer = None
    if response_schema is not None:
        answer = st.GrammarFormat(grammar=json_grammar(response_schema))
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    qwen_tools = bool(tools) and tool_choice != "none" and tool_format == QWEN_XML
    if forced and not tools:
        raise StructuredOutputError("tool_choice 'required' or a named function needs 'tools'")
    if forced and not qwen_tools:
        raise StructuredOutputError(
            "tool_choice 'required' or a named function needs a chat template whose tool-call format this "
            "server constrains (Qwen 3.5/3.6's <tool_call><function=...> calls); this template's is not"
        )
    body: Any
    if qwen_tools and (forced or answer is None):
        body = _qwen_calls(tools, tool_choice, parallel_tool_calls)  # type: ignore[arg-type]
    elif qwen_tools:
        body = st.OrFormat(elements=[answer, _qwen_calls(tools, "required", parallel_tool_calls)])  # type: ignore[arg-type]
    elif answer is not None:
        if reasoning is None:
            return "json_schema", json.dumps(response_schema)
        body = answer
    else:
        return None
    if reasoning is not None:
        think = st.TagFormat(
            begin="", content=st.AnyTextFormat(excludes=[reasoning.start, reasoning.end]), end=reasoning.end
        )
        body = st.SequenceFormat(elements=[think, st.ConstStringFormat(value=AFTER_REASONING), body])
    return "structural_tag", st.StructuralTag(format=body).model_dump_json()


def library_message(error: Exception) -> str:
    """What an xgrammar error says, without the C++ log prefix (time, file, line) its messages carry."""
    text = str(error).strip()
    message = text.splitlines()[-1] if text else type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar (xgrammar's EBNF) of JSON values matching `schema`, laid out with JSON_INDENT, numbers without
    bounds limited to 16 integer and 16 fraction digits as llama.cpp's schema grammars are (xgrammar bounds
    only the numbers that have a minimum and maximum; a sampling model otherwise writes digits until the
    tokens run out)."""
    from xgrammar import Grammar

    try:
        text = str(
            Grammar.from_json_schema(
                json.dumps(tuples_as_prefix_items(schema)), any_whitespace=False, indent=JSON_INDENT
            )
        )
    except Exception as e:  # noqa: BLE001 - the library's errors say what is wrong with the schema
        raise StructuredOutputError(f"invalid json schema: {library_message(e)}"[:500]) from None
    for unbounded, bounded in UNBOUNDED_DIGITS:
        text = text.replace(unbounded, bounded)
    return text


def tuples_as_prefix_items(schema: Any) -> Any:
    """Draft-04 tuples (`items` as an array) in today's words (`prefixItems`), which xgrammar reads. Without
    `additionalItems` the array is the tuple alone, as llama.cpp's schema grammars read it."""
    if isinstance(schema, list):
        return [tuples_as_prefix_items(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: tuples_as_prefix_items(v) for k, v in schema.items()}
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        out["items"] = out.pop("additionalItems", False)
    return out


def _qwen_calls(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool) -> Any:
    """Qwen 3.5 XML calls from xgrammar's qwen_3_5 preset (built without its reasoning block: ours comes first).
    "auto" is the preset's (free text, calls once `<tool_call>` opens); a forced call (required, named) is calls
    alone, one a line, with no text around them (Qwen's template writes none after calls; the preset's own
    forced formats let text run on after the calls until the tokens run out)."""
    from xgrammar import get_model_structural_tag
    from xgrammar import structural_tag as st

    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
        if not isinstance(name, str) or name not in names:
            raise StructuredOutputError(f"tool_choice names the function {name!r}, which is not among the tools")
    enforced = [_without_strict(t) for t in tools]
    try:
        tag = get_model_structural_tag(
            "qwen_3_5",
            tools=enforced,
            tool_choice=tool_choice,
            reasoning="disabled",
            parallel_tool_calls=parallel,
            max_whitespace_cnt=ARGUMENT_WHITESPACE,
        )
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"tools: {e}") from None
    calls = tag.format
    if tool_choice == "auto":
        return calls
    tags = [calls] if isinstance(calls, st.TagFormat) else list(calls.tags)
    return st.TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel)


def _without_strict(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or "strict" not in function:
        return tool
    return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}


def response_schema(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (None for text); malformed ones raise StructuredOutputError."""
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema", ANY_OBJECT)  # llama-server's extension: an optional schema
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputError("response_format 'json_schema' needs a 'json_schema' object")
        schema = spec.get("schema", ANY_OBJECT)
    else:
        raise StructuredOutputError(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError("response_format's schema must be a JSON object")
    json.dumps(schema)  # plain JSON (it came from a request body)
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
