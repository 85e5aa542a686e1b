"""Chat templates: a GGUF's `tokenizer.chat_template` (Jinja) rendered as llama-server renders it.

llama.cpp has its own C++ Jinja engine; here jinja2's `ImmutableSandboxedEnvironment` runs the template
(a template can read but not change what it is given, nor reach Python internals) with the block
trimming llama.cpp and Hugging Face use (`trim_blocks`, `lstrip_blocks`), loop controls, and llama.cpp's
helpers: `raise_exception`, `strftime_now`, and a `tojson` that writes what llama.cpp's does (", " and
": " separators, key order kept, non-ASCII raw, floats as C++ prints them: 6 significant digits).

What a render gets (../shared/spec/chat-template.md §1, llama.cpp common/chat.cpp): `messages`
normalised as llama.cpp does (role `developer` -> `system`; content always a string, "" when absent;
`reasoning_content`, `name`, `tool_call_id` only when non-empty; tool-call `arguments` parsed from JSON
into objects; typed content parts joined with "\\n" when the template reads only string content, and a
leading system message folded into the next one when the template ignores system messages -- both found
by test renders, llama.cpp's capability probes), `tools` only when there are some (normalised to
type/function/name/description/parameters), `bos_token`/`eos_token` text, `enable_thinking`,
`add_generation_prompt` only when true, `datetime`/`date_string`, then every chat_template_kwargs key
(a bool `preserve_reasoning` also sets `preserve_thinking`, `clear_thinking`, `truncate_history_thinking`,
`drop_thinking`; a string `reasoning_effort` also `reasoning_strength`). After rendering, a leading BOS
text is stripped when the tokenizer adds BOS itself (likewise a trailing EOS). The `tool_use` variant is
used when a request has tools and the GGUF has one.

Every failure -- a template that does not compile, a render error, `raise_exception(...)`, messages or
tools of the wrong shape -- is one `ChatTemplateError` (a ValueError) that a server turns into HTTP 400.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import soft_str
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .reasoning import ThinkTags
from .tokenizer import Tokenizer

# llama.cpp's built-in template (common/chat.cpp CHATML_TEMPLATE_SRC): the fallback for a GGUF without one.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}

_PROBE = "MTPSERVE_CAPABILITY_PROBE"  # no whitespace: templates trim content


class ChatTemplateError(ValueError):
    """A chat template or chat request that cannot be rendered; the message says why (an HTTP 400)."""


class _Raised(Exception):
    """`raise_exception(...)` inside a template, carried out of jinja2 untouched."""


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: the prompt to tokenize (with parse_special) and the generation prompt, the suffix
    that `add_generation_prompt` adds, which the output parser puts in front of the generated text."""

    prompt: str
    generation_prompt: str


def resolve_chat_template(value: str) -> str:
    """`--chat-template FILE|NAME`: a built-in name (`chatml`), a template file, or inline Jinja source."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read chat template file {path}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ChatTemplateError(
        f"chat template {value!r} is not a built-in name ({', '.join(BUILTIN_TEMPLATES)}), "
        "an existing file, or Jinja source"
    )


class ChatTemplate:
    """A model's chat template(s) bound to its special tokens. `ChatTemplate.for_tokenizer(tok)` takes the
    GGUF's template (or `override`, see `resolve_chat_template`), falling back to ChatML like llama-server."""

    def __init__(
        self,
        source: str,
        *,
        tool_use_source: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> None:
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        self._default = _Variant(source)
        self._tool_use = None
        if tool_use_source:
            try:
                self._tool_use = _Variant(tool_use_source)
            except ChatTemplateError:  # llama.cpp ignores a broken tool_use variant
                self._tool_use = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, override: str | None = None) -> ChatTemplate:
        vocab = tokenizer.vocab
        if override:
            source, tool_use = resolve_chat_template(override), None
        else:
            source, tool_use = vocab.chat_template or "", vocab.named_chat_templates.get("tool_use")
        if not source or source == "chatml":
            source, tool_use = (tool_use, None) if tool_use else (CHATML_TEMPLATE, None)

        def text(token_id: int | None) -> str:
            return tokenizer.token_to_piece(token_id, special=True) if token_id is not None else ""

        return cls(
            source,
            tool_use_source=tool_use,
            bos_token=text(tokenizer.bos_id),
            eos_token=text(tokenizer.eos_id),
            add_bos=tokenizer.add_bos,
            add_eos=tokenizer.add_eos,
        )

    @property
    def supports_thinking(self) -> bool:
        """Whether the template knows `<think>` blocks (llama-server's default for enable_thinking)."""
        return "<think>" in self.source

    @property
    def think_tags(self) -> ThinkTags | None:
        """How to split this template's output into reasoning and content (None: content only)."""
        if not self.supports_thinking:
            return None
        return ThinkTags(interrupts=("<tool_call>",) if "<tool_call>" in self.source else ())

    def apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        now: dt.datetime | None = None,
    ) -> ChatPrompt:
        """Render `messages` (OpenAI chat format) into the prompt, plus the generation prompt.

        enable_thinking defaults to `supports_thinking`; chat_template_kwargs are extra template variables
        (JSON values). Raises ChatTemplateError for anything that cannot be rendered.
        """
        norm_tools = _normalize_tools(tools)
        variant = self._tool_use if norm_tools and self._tool_use is not None else self._default
        norm_messages = variant.adapt(_normalize_messages(messages, keep_developer="<|channel|>" in variant.source))
        now = now or dt.datetime.now()
        context: dict[str, Any] = {
            "messages": norm_messages,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": self.supports_thinking if enable_thinking is None else bool(enable_thinking),
        }
        if norm_tools:
            context["tools"] = norm_tools
        context["datetime"] = now.strftime("%b %d %Y")
        context["date_string"] = now.strftime("%d %b %Y")
        kwargs = dict(chat_template_kwargs or {})
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            kind = type(kwargs["enable_thinking"]).__name__
            raise ChatTemplateError(f'invalid type for "enable_thinking" (expected boolean, got {kind})')
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            keep = kwargs["preserve_reasoning"]
            aliases = {"preserve_thinking": keep, "clear_thinking": not keep}
            aliases |= {"truncate_history_thinking": not keep, "drop_thinking": not keep}
            context |= aliases
        if isinstance(kwargs.get("reasoning_effort"), str) and kwargs["reasoning_effort"]:
            context["reasoning_strength"] = kwargs["reasoning_effort"]
        context |= kwargs

        without = self._strip(variant.render(context, now))
        with_prompt = self._strip(variant.render(context | {"add_generation_prompt": True}, now))
        common = len(without) if with_prompt.startswith(without) else len(_common_prefix(without, with_prompt))
        return ChatPrompt(with_prompt if add_generation_prompt else without, with_prompt[common:])

    def _strip(self, text: str) -> str:
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text


class _Variant:
    """One compiled template with its capabilities, found by test renders as llama.cpp's probes do."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self.template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template parsing error: {e.message} (line {e.lineno})") from None

    def render(self, context: Mapping[str, Any], now: dt.datetime) -> str:
        def strftime_now(fmt: str) -> str:
            return now.strftime(fmt)

        try:
            return self.template.render(**context, strftime_now=strftime_now)
        except _Raised as e:
            raise ChatTemplateError(str(e)) from None
        except ChatTemplateError:
            raise
        except Exception as e:  # any template runtime error is the request's problem, never a crash
            raise ChatTemplateError(f"chat template rendering error: {type(e).__name__}: {e}") from None

    def _probe(self, messages: list[dict[str, Any]]) -> str | None:
        try:
            context = {"messages": messages, "tools": [], "bos_token": "", "eos_token": ""}
            return self.render(context | {"add_generation_prompt": True}, dt.datetime.now())
        except ChatTemplateError:
            return None

    @cached_property
    def content_kinds(self) -> tuple[bool, bool]:
        """(reads string content, reads typed content parts)."""
        as_string = self._probe([{"role": "user", "content": _PROBE}])
        as_parts = self._probe([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
        return as_string is not None and _PROBE in as_string, as_parts is not None and _PROBE in as_parts

    @cached_property
    def ignores_system(self) -> bool:
        out = self._probe([{"role": "system", "content": _PROBE}, {"role": "user", "content": "Hi"}])
        return out is not None and _PROBE not in out

    def adapt(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """llama.cpp's workarounds for what this template cannot read."""
        strings, parts = self.content_kinds
        for m in messages:
            if strings and not parts and isinstance(m["content"], list):
                m["content"] = _as_text(m["content"])
            elif parts and not strings and isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
        if messages and messages[0]["role"] == "system" and self.ignores_system:
            first = messages.pop(0)
            if messages:
                messages[0]["content"] = f"{_as_text(first['content'])}\n{_as_text(messages[0]['content'])}"
        return messages


def _common_prefix(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return a[:i]
    return a if len(a) <= len(b) else b


def _as_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def _normalize_messages(messages: Any, keep_developer: bool) -> list[dict[str, Any]]:
    """OpenAI-style messages -> what llama.cpp hands the template (common_chat_msgs_parse_oaicompat)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("'messages' must be an array of message objects")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"Expected 'message' to be an object, got {_dump(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"Missing 'role' in message: {_dump(message)}")
        if role == "developer" and not keep_developer:
            role = "system"
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if "content" not in message and "tool_calls" not in message:
            raise ChatTemplateError("Expected 'content' or 'tool_calls' in message")
        norm: dict[str, Any] = {"role": role, "content": _normalize_content(content)}
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise ChatTemplateError(f"'{key}' must be a string in message: {_dump(message)}")
            if value:
                norm[key] = value
        if tool_calls:
            norm["tool_calls"] = [_normalize_tool_call(call) for call in tool_calls]
        out.append(norm)
    return out


def _normalize_content(content: Any) -> str | list[dict[str, str]]:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or "type" not in part:
                raise ChatTemplateError(f"Missing content part type: {_dump(part)}")
            if part["type"] != "text":
                raise ChatTemplateError(f"Unsupported content part type: {_dump(part['type'])}")
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"Content part without text: {_dump(part)}")
            parts.append({"type": "text", "text": part["text"]})
        return parts if parts else ""
    raise ChatTemplateError(f"Invalid 'content' type: expected string or array, got {_dump(content)}")


def _normalize_tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type") != "function" or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError(f"Unsupported tool call: {_dump(call)}")
    function = call["function"]
    if not isinstance(function.get("name"), str):
        raise ChatTemplateError(f"Missing tool call name: {_dump(call)}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"Failed to parse tool call arguments as JSON: {e}") from None
    norm = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id"):
        norm["id"] = call["id"]
    return norm


def _normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatTemplateError(f"Failed to parse tools: expected an array, got {_dump(tools)}")
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ChatTemplateError(f"Failed to parse tools: unsupported tool {_dump(tool)}")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"Failed to parse tools: missing function name in {_dump(tool)}")
        function_out = {
            "name": function["name"],
            "description": function.get("description") or "",
            "parameters": function.get("parameters") if function.get("parameters") is not None else {},
        }
        out.append({"type": "function", "function": function_out})
    return out


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:200]


# -- the Jinja environment -------------------------------------------------------------------------------


def to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    """llama.cpp's `tojson` (common/jinja/value.cpp `value_to_json`): ", " / ": " separators (",\\n" with
    an indent), keys in insertion order, non-ASCII written raw, floats as C++ `<<` prints them. Positional
    arguments in llama.cpp's (and Hugging Face's) order: ensure_ascii, indent, separators, sort_keys."""
    if sort_keys:
        value = json.loads(json.dumps(value, sort_keys=True, default=_jsonable))
    item_sep = separators[0] if separators else ("," if indent is not None and indent >= 0 else ", ")
    key_sep = separators[1] if separators and len(separators) > 1 else ": "
    out: list[str] = []
    _write_json(out, value, 0, indent, item_sep, key_sep)
    text = "".join(out)
    return "".join(c if c.isascii() else json.dumps(c)[1:-1] for c in text) if ensure_ascii else text


def _write_json(out: list[str], value: Any, level: int, indent: int | None, item_sep: str, key_sep: str) -> None:
    newline = "\n" if indent is not None and indent >= 0 else ""
    pad = " " * (level * indent) if indent and indent > 0 else ""
    step = " " * indent if indent and indent > 0 else ""
    if value is None or isinstance(value, jinja2.Undefined):
        out.append("null")
    elif isinstance(value, bool):
        out.append("true" if value else "false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(_cpp_float(value))
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, Mapping):
        if not value:
            out.append("{}")
            return
        out.append("{" + newline)
        for i, (k, v) in enumerate(value.items()):
            out.append(pad + step + json.dumps(str(k), ensure_ascii=False) + key_sep)
            _write_json(out, v, level + 1, indent, item_sep, key_sep)
            out.append((item_sep if i < len(value) - 1 else "") + newline)
        out.append(pad + "}")
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return
        out.append("[" + newline)
        for i, v in enumerate(value):
            out.append(pad + step)
            _write_json(out, v, level + 1, indent, item_sep, key_sep)
            out.append((item_sep if i < len(value) - 1 else "") + newline)
        out.append(pad + "]")
    else:
        out.append("null")


def _cpp_float(x: float) -> str:
    """A double as `std::ostream << double` writes it (%g, 6 significant digits)."""
    if math.isnan(x):
        return "nan" if math.copysign(1.0, x) > 0 else "-nan"
    return "%g" % x


def _string(value: Any) -> str:
    """The `string` filter; a float reads as llama.cpp writes it (its `string` is `tojson` for numbers)."""
    return _cpp_float(value) if isinstance(value, float) else soft_str(value)


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, jinja2.Undefined) else str(value)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = to_json
    env.filters["string"] = _string
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return env


_ENV = _environment()
