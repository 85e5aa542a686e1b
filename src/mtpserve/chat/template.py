"""Chat templates: a GGUF's `tokenizer.chat_template` (Jinja) rendered as llama-server renders it.

llama.cpp has its own C++ Jinja engine; here jinja2 runs the template in a sandbox with llama.cpp's helpers and
bounds (sandbox.py).

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

Every failure -- a template that does not compile, a render error, `raise_exception(...)`, messages or tools of the
wrong shape -- is one `ChatTemplateError` (a ValueError) that a server turns into HTTP 400.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from .errors import ChatTemplateError, ChatTemplateLimitError
from .messages import as_text, normalize_messages, normalize_tools
from .reasoning import ThinkTags
from .sandbox import compile_template, render


class TemplateSource(Protocol):
    """What a chat template needs from a tokenizer: the GGUF's templates and its special tokens."""

    chat_template: str | None
    named_chat_templates: Mapping[str, str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool

    def token_to_piece(self, token_id: int, special: bool = False) -> str: ...


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
    def for_tokenizer(cls, tokenizer: TemplateSource, override: str | None = None) -> ChatTemplate:
        if override:
            source, tool_use = resolve_chat_template(override), None
        else:
            source, tool_use = tokenizer.chat_template or "", tokenizer.named_chat_templates.get("tool_use")
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
        norm_tools = normalize_tools(tools)
        variant = self._tool_use if norm_tools and self._tool_use is not None else self._default
        norm_messages = variant.adapt(normalize_messages(messages, keep_developer="<|channel|>" in variant.source))
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
        self.template = compile_template(source)

    def render(self, context: Mapping[str, Any], now: dt.datetime) -> str:
        return render(self.template, context, now)

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
                m["content"] = as_text(m["content"])
            elif parts and not strings and isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
        if messages and messages[0]["role"] == "system" and self.ignores_system:
            first = messages.pop(0)
            if messages:
                messages[0]["content"] = f"{as_text(first['content'])}\n{as_text(messages[0]['content'])}"
        return messages


def _common_prefix(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return a[:i]
    return a if len(a) <= len(b) else b
