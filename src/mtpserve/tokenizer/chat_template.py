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

Limits. A GGUF's template is untrusted code: besides the sandbox, every render is bounded in time and size
(`ChatTemplateLimitError`, a ChatTemplateError, says which limit stopped it):
* `MAX_RENDER_SECONDS` (2 s) per render, checked at every loop iteration (each `{% for %}` iterates through
  a guard), call, filter, intercepted operator and output chunk; jinja2's `range` stays capped at 100000.
* `MAX_OUTPUT_CHARS` (4 Mi characters, about 1M tokens, well above any context served here): for the
  rendered prompt, for any value an expression prints, for every concatenation (`~`, `+`, joined buffers
  of macros and `{% set %}` blocks) and for what filters and calls take and give; `MAX_PRINTED_CHARS`
  (4 times that) for all the values one render prints, since captured output is buffered before it is
  joined.
* The operations whose cost a template controls with a number are checked *before* they run, so that they
  never allocate: `*` (`'x' * 10**9`), `**` and `*` on integers (at most `MAX_INT_BITS` bits), `%` and
  `format` widths, `ljust`/`center`/`zfill`/`expandtabs` and the `center`/`indent`/`batch`/`slice`/`tojson`
  widths, `replace`, `translate`, `join` and `sum` by the size of their result; a structure holding the same
  list many times over (`[l, l]` nested) is measured without being walked whole. `lipsum` is removed.
Left out: a template that stays under every limit but is slow per step still runs for up to 2 s.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import soft_str

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

MAX_RENDER_SECONDS = 2.0  # wall time of one render
MAX_OUTPUT_CHARS = 4 * 2**20  # the prompt, and any one value or concatenation on the way to it
MAX_PRINTED_CHARS = 4 * MAX_OUTPUT_CHARS  # all values a render prints, in captured blocks and macros too
MAX_INT_BITS = 2**16  # integers a template computes with `*` and `**` (printing stops at 4300 digits anyway)


class ChatTemplateError(ValueError):
    """A chat template or chat request that cannot be rendered; the message says why (an HTTP 400)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render stopped by MAX_RENDER_SECONDS, MAX_OUTPUT_CHARS, MAX_PRINTED_CHARS or MAX_INT_BITS."""


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
            self.template = _ENV.from_string(_LimitGuards().visit(_ENV.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template parsing error: {e.message} (line {e.lineno})") from None
        except Exception as e:  # noqa: BLE001 -- e.g. a 5000-digit literal, nesting beyond the parser's recursion
            raise ChatTemplateError(f"chat template parsing error: {type(e).__name__}: {e}") from None

    def render(self, context: Mapping[str, Any], now: dt.datetime) -> str:
        def strftime_now(fmt: str) -> str:
            return now.strftime(fmt)

        token = _BUDGET.set(_Budget(time.monotonic() + MAX_RENDER_SECONDS))
        try:
            parts, size = [], 0
            for chunk in self.template.generate(**context, strftime_now=strftime_now):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise _too_big("the rendered prompt")
                _check_time()
                parts.append(chunk)
            return "".join(parts)
        except _Raised as e:
            raise ChatTemplateError(str(e)) from None
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any template runtime error is the request's problem, never a crash
            raise ChatTemplateError(f"chat template rendering error: {type(e).__name__}: {e}") from None
        finally:
            _BUDGET.reset(token)

    def _probe(self, messages: list[dict[str, Any]]) -> str | None:
        try:
            context = {"messages": messages, "tools": [], "bos_token": "", "eos_token": ""}
            return self.render(context | {"add_generation_prompt": True}, dt.datetime.now())
        except ChatTemplateLimitError:  # a template that blows a limit on a one-line probe is hostile: say so
            raise
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
    return f"{x:g}"


def _string(value: Any) -> str:
    """The `string` filter; a float reads as llama.cpp writes it (its `string` is `tojson` for numbers)."""
    return _cpp_float(value) if isinstance(value, float) else soft_str(value)


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, jinja2.Undefined) else str(value)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


# -- limits (see the module docstring) -------------------------------------------------------------------


@dataclass
class _Budget:
    """What one render may still spend: checked by every hook below, reset by `_Variant.render`."""

    deadline: float
    printed: int = 0  # characters of all values printed so far, in blocks and macros too


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)
_WIDTH_FILTERS = frozenset({"center", "indent", "batch", "slice", "tojson"})  # an int argument sizes the output
# Filters that neither turn their input into text nor give more than they take (`messages|length` in a loop
# must not measure the messages each time): no size checks for them.
_SIZE_NEUTRAL_FILTERS = frozenset(
    {
        "abs",
        "attr",
        "batch",
        "count",
        "d",
        "default",
        "dictsort",
        "first",
        "float",
        "groupby",
        "int",
        "items",
        "last",
        "length",
        "list",
        "map",
        "max",
        "min",
        "random",
        "reject",
        "rejectattr",
        "reverse",
        "round",
        "select",
        "selectattr",
        "slice",
        "sort",
        "unique",
    }
)
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_NUMBERS = re.compile(r"\d+")
_END = object()


def _check_time() -> None:
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise ChatTemplateLimitError(
            f"chat template rendering stopped: it ran for more than {MAX_RENDER_SECONDS:g} s (a loop that never ends?)"
        )


def _too_big(what: str, limit: int = MAX_OUTPUT_CHARS) -> ChatTemplateLimitError:
    return ChatTemplateLimitError(f"chat template rendering stopped: {what} would exceed {limit} characters")


def _is_container(v: Any) -> bool:
    return isinstance(v, (list, tuple, dict, set, frozenset, Namespace)) or (
        not isinstance(v, (str, int, float)) and isinstance(v, Mapping)
    )


def _leaf_size(v: Any) -> int:
    if isinstance(v, str):
        return len(v)
    if isinstance(v, int):
        return v.bit_length() // 3 + 1
    return 24  # floats, None, undefined, loop and macro objects: short reprs


def _flat_size(v: Any) -> int | None:
    """The size of a list/tuple of only strings or only numbers, counted in C; None for anything else."""
    if isinstance(v, (list, tuple)):
        types = set(map(type, v))
        if types <= {str}:
            return 2 + 2 * len(v) + sum(map(len, v))
        if types <= {int, bool}:
            return 2 + 3 * len(v) + sum(map(int.bit_length, v)) // 3
    return None


def _children(v: Any) -> tuple[int, Iterator[Any]]:
    """A container's own characters (brackets, separators) and its elements (keys and values of a mapping)."""
    if isinstance(v, Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    if isinstance(v, Mapping):
        return 2 + 4 * len(v), itertools.chain.from_iterable(v.items())
    return 2 + 2 * len(v), iter(v)


def _text_size(value: Any) -> int:
    """About how many characters `str(value)` has, counted only until it passes MAX_OUTPUT_CHARS. Every step
    adds at least 2, so a walk is at most MAX_OUTPUT_CHARS / 2 steps; a container met again (`[l, l]` nested
    80 deep is 2**80 elements when printed, a few kB in memory) is counted from a memo, not walked again."""
    if isinstance(value, str):
        return len(value)
    if not _is_container(value):
        return _leaf_size(value)
    flat = _flat_size(value)
    if flat is not None:
        return flat
    memo: dict[int, int] = {}
    base, items = _children(value)
    stack, on_stack, steps = [[value, items, base]], {id(value)}, 0  # frames: container, elements, size so far
    while True:
        frame = stack[-1]
        child = next(frame[1], _END)
        if child is _END:
            stack.pop()
            on_stack.discard(id(frame[0]))
            if len(memo) < 65536:
                memo[id(frame[0])] = frame[2]
            if not stack:
                return frame[2]
            stack[-1][2] += frame[2]
        elif not _is_container(child):
            frame[2] += _leaf_size(child)
        elif id(child) in memo:
            frame[2] += memo[id(child)]
        elif id(child) in on_stack:  # a namespace holding itself: repr() prints "{...}"
            frame[2] += 5
        elif (flat := _flat_size(child)) is not None:
            frame[2] += flat
        else:
            base, items = _children(child)
            stack.append([child, items, base])
            on_stack.add(id(child))
        if stack[-1][2] > MAX_OUTPUT_CHARS or (len(stack) > 1 and stack[-2][2] > MAX_OUTPUT_CHARS):
            return MAX_OUTPUT_CHARS + 1
        steps += 1
        if not steps & 4095:
            _check_time()


def _finalize(value: Any) -> Any:
    """Every printed value (`{{ }}`), wherever it goes: at most MAX_OUTPUT_CHARS each, MAX_PRINTED_CHARS in all
    (output captured by `{% set %}` blocks, macros and filter blocks is buffered before anything joins it)."""
    size = _text_size(value)
    if size > MAX_OUTPUT_CHARS:
        raise _too_big("a printed value")
    budget = _BUDGET.get()
    if budget is not None:
        budget.printed += size
        if budget.printed > MAX_PRINTED_CHARS:
            raise _too_big("the values printed in all", MAX_PRINTED_CHARS)
    return value


def _check_size(value: Any, what: str = "a value") -> Any:
    if _text_size(value) > MAX_OUTPUT_CHARS:
        raise _too_big(what)
    return value


def _check_widths(values: Iterable[Any], what: str) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big(f"{what} with width {v}")


def _check_format(fmt: str, args: Any) -> None:
    """`fmt % args`, `fmt.format(...)`: widths written in the format, `*` or nested widths from the args."""
    if any(len(n) > 7 and int(n) > MAX_OUTPUT_CHARS for n in _NUMBERS.findall(fmt)):
        raise _too_big("a formatted string")
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        values = args.values() if isinstance(args, Mapping) else args if isinstance(args, (list, tuple)) else [args]
        _check_widths(values, "a formatted string")
    if _text_size(fmt) + _text_size(args) > MAX_OUTPUT_CHARS:
        raise _too_big("a formatted string")


def _check_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    if len(s) + hits * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
        raise _too_big("a replace()")


def _joined(items: Any, sep: Any) -> list[Any]:
    """`sep.join(items)` / `items|join(sep)`: the items as a list, after checking the size of the result."""
    items = list(items) if not isinstance(items, (list, tuple)) else items
    if _text_size(items) + len(soft_str(sep)) * len(items) > MAX_OUTPUT_CHARS:
        raise _too_big("a join()")
    return list(items)


def _guard_filter(name: str, fn: Any) -> Any:
    """A filter with the limits: its input and output sized, width arguments and result sizes checked first."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment comes first
    neutral = name in _SIZE_NEUTRAL_FILTERS

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        if len(args) <= skip:
            return fn(*args, **kwargs)
        value, rest = args[skip], args[skip + 1 :]
        if not neutral:
            _check_size(value, f"the input of the '{name}' filter")
        if name in _WIDTH_FILTERS:
            _check_widths([*rest, *kwargs.values()], f"the '{name}' filter")
        elif name == "format" and isinstance(value, str):
            _check_format(value, kwargs or rest)
        elif name == "replace":
            _check_replace(value, *rest[:3], **kwargs)
        elif name == "join":
            args = (*args[:skip], _joined(value, rest[0] if rest else kwargs.get("d", "")), *rest)
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), (list, tuple)):
            return _sum_sequences(args[0], value, *rest, **kwargs)  # Python's sum() of lists is quadratic
        result = fn(*args, **kwargs)
        return result if neutral else _check_size(result, f"the output of the '{name}' filter")

    return guarded


def _sum_sequences(environment: Any, items: Any, attribute: Any = None, start: Any = ()) -> Any:
    if attribute is not None:
        items = map(make_attrgetter(environment, attribute), items)
    parts = [start, *items]
    _check_size(parts, "the output of the 'sum' filter")
    return type(start)(itertools.chain.from_iterable(parts))


class _LimitGuards(NodeTransformer):
    """Rewrites a parsed template: each `{% for %}` iterates through `environment.guarded_iter` (a deadline
    check per item: nested loops over lists are not range()s), each `~` goes through `checked_str_join`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("guarded_iter"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(
            nodes.EnvironmentAttribute("checked_str_join"), [nodes.Tuple(node.nodes, "load")], [], None, None
        )


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the render limits hooked into its operators, calls, filters, loops and output."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    @staticmethod
    def concat(parts: Iterable[str]) -> str:
        """Joins every buffer: macro and caller() results, `{% set %}...{% endset %}`, filter blocks."""
        parts = parts if isinstance(parts, list) else list(parts)
        if sum(map(len, parts)) > MAX_OUTPUT_CHARS:
            raise _too_big("a block of output")
        return "".join(parts)

    @staticmethod
    def guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _check_time()
            yield item

    @staticmethod
    def checked_str_join(values: tuple[Any, ...]) -> str:
        _check_time()
        if sum(map(_text_size, values)) > MAX_OUTPUT_CHARS:
            raise _too_big("a ~ concatenation")
        return "".join(map(str, values))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
            raise ChatTemplateLimitError(
                f"chat template rendering stopped: {left} ** {right} has more than {MAX_INT_BITS} bits"
            )
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateLimitError(
                    f"chat template rendering stopped: a product of more than {MAX_INT_BITS} bits"
                )
            seq, n = (right, left) if isinstance(left, int) else (left, right)
            if (
                isinstance(n, int)
                and isinstance(seq, (str, list, tuple))
                and n > 0
                and _text_size(seq) * n > MAX_OUTPUT_CHARS
            ):
                raise _too_big("a repetition (*)")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if _text_size(left) + _text_size(right) > MAX_OUTPUT_CHARS:
                raise _too_big("a + concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_time()
        owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(owner, str):  # a str method
            name = getattr(obj, "__name__", "")
            if name in _WIDTH_METHODS:
                _check_widths([*args, *kwargs.values()], f"str.{name}()")
            elif name == "replace":
                _check_replace(owner, *args[:3])
            elif name == "join" and args:
                args = (_joined(args[0], owner), *args[1:])
            elif name in ("format", "format_map"):  # the format string itself was checked by wrap_str_format
                _check_format(owner, kwargs or (args[0] if name == "format_map" and args else args))
            elif name == "translate" and args and isinstance(args[0], Mapping):
                longest = max((_text_size(v) for v in args[0].values()), default=0)
                if len(owner) * longest > MAX_OUTPUT_CHARS:
                    raise _too_big("a translate()")
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(result, str) or _is_container(result):
            _check_size(result, "a call's result")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__, ())
        return wrapper


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
        finalize=_finalize,
    )
    env.filters["tojson"] = to_json
    env.filters["string"] = _string
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # lipsum(n=10**6) writes n paragraphs in one call
    return env


_ENV = _environment()
