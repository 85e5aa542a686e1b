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

A request may continue its last message instead of starting a new one (`continue_final_message`, llama-server's
assistant prefill): the prompt then ends inside that message (`ChatTemplate._continue`).

Every failure -- a template that does not compile, a render error, `raise_exception(...)`, messages or tools of the
wrong shape -- is one `ChatTemplateError` (a ValueError) that a server turns into HTTP 400.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from .builtin_templates import CHATML_TEMPLATE
from .builtin_templates import TEMPLATES as BUILTIN_TEMPLATES
from .errors import ChatTemplateError, ChatTemplateLimitError
from .messages import as_text, normalize_messages, normalize_tools
from .reasoning import WHITESPACE, ThinkTags
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


_PROBE = "MTPSERVE_CAPABILITY_PROBE"  # no whitespace: templates trim content
CONTINUATIONS = ("auto", "content", "reasoning_content")  # how a final message is continued (llama.cpp's names)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: the prompt to tokenize (with parse_special) and the generation prompt, the suffix
    that `add_generation_prompt` adds, which the output parser puts in front of the generated text.

    A continued final message (`continue_final_message`) ends the prompt with `prefill`, the start of the
    assistant's turn already written: the output parser reads it as the beginning of the output, and
    `generation_prompt` is then what comes before it."""

    prompt: str
    generation_prompt: str
    prefill: str = ""


def resolve_chat_template(value: str) -> str:
    """`--chat-template FILE|NAME`: one of llama.cpp's built-in names (builtin_templates.py), a template file, or
    inline Jinja source."""
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
        continue_final_message: str | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        now: dt.datetime | None = None,
    ) -> ChatPrompt:
        """Render `messages` (OpenAI chat format) into the prompt, plus the generation prompt.

        continue_final_message (one of CONTINUATIONS, None: off) leaves the last message open for the model to
        continue, as llama.cpp does (`_continue`); add_generation_prompt is then ignored. enable_thinking
        defaults to `supports_thinking`; chat_template_kwargs are extra template variables (JSON values).
        Raises ChatTemplateError for anything that cannot be rendered.
        """
        if continue_final_message not in (None, *CONTINUATIONS):
            raise ChatTemplateError(f"continue_final_message must be one of {', '.join(CONTINUATIONS)}")
        norm_tools = normalize_tools(tools)
        variant = self._tool_use if norm_tools and self._tool_use is not None else self._default
        norm_messages = normalize_messages(messages, keep_developer="<|channel|>" in variant.source)
        final = norm_messages.pop() if continue_final_message and norm_messages else None
        norm_messages = variant.adapt(norm_messages)
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
        if final is not None and continue_final_message:
            header, prefill = self._continue(variant, with_prompt[common:], final, continue_final_message)
            return ChatPrompt(without + header + prefill, header, prefill)
        return ChatPrompt(with_prompt if add_generation_prompt else without, with_prompt[common:])

    def _continue(
        self, variant: _Variant, generation_prompt: str, final: Mapping[str, Any], mode: str
    ) -> tuple[str, str]:
        """llama.cpp's continuation of the final message (common/chat.cpp, chat-auto-parser-generator.cpp): the
        other messages are rendered with the generation prompt, and the message follows it, open. Its content
        (text parts joined with "\\n\\n") is written as is; a thinking template's prompt is first cut before
        its reasoning block, which is written again around the message's reasoning (left open when only the
        reasoning is continued: mode `reasoning_content`, or `auto` with reasoning and no content).
        Returns (the generation prompt up to the continued text, the continued text)."""
        content = final["content"]
        content = content if isinstance(content, str) else "\n\n".join(part["text"] for part in content)
        reasoning = final.get("reasoning_content", "")
        if mode == "auto":
            mode = "reasoning_content" if reasoning and not content else "content"
        tags = self.think_tags
        if tags is None:
            return generation_prompt, content if mode == "content" else ""
        start, end = variant.think_markers(tags)
        cut = generation_prompt.find(start)
        header = generation_prompt if cut < 0 else generation_prompt[:cut]
        return header, start + reasoning + (end + content if mode == "content" else "")

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

    def _probe(self, messages: list[dict[str, Any]], **extra: Any) -> str | None:
        try:
            context = {
                "messages": messages,
                "tools": [],
                "bos_token": "",
                "eos_token": "",
                "add_generation_prompt": True,
            }
            return self.render(context | extra, dt.datetime.now())
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
    def several_systems(self) -> bool:
        """Whether it reads two system messages in a row at the start (Qwen 3.5/3.6 raise "System message must
        be at the beginning" for the second)."""
        two = [{"role": "system", "content": "A"}, {"role": "system", "content": _PROBE}]
        out = self._probe([*two, {"role": "user", "content": "Hi"}])
        return out is not None and _PROBE in out

    @cached_property
    def late_systems(self) -> bool:
        """Whether it reads a system message after the conversation has begun."""
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        out = self._probe([*turns, {"role": "system", "content": _PROBE}, {"role": "user", "content": "Hi"}])
        return out is not None and _PROBE in out

    @cached_property
    def ignores_system(self) -> bool:
        out = self._probe([{"role": "system", "content": _PROBE}, {"role": "user", "content": "Hi"}])
        return out is not None and _PROBE not in out

    def think_markers(self, tags: ThinkTags) -> tuple[str, str]:
        """The reasoning block's opening and closing markers with the whitespace the template writes around
        the reasoning (Qwen: `<think>\\n`, `\\n</think>\\n\\n`), read off a past answer with reasoning as
        llama.cpp's template analysis reads them; the bare tags when the template shows no such answer."""
        answer = {"role": "assistant", "content": "Hello", "reasoning_content": _PROBE}
        messages = [{"role": "user", "content": "Hi"}, answer]
        out = self._probe(messages, add_generation_prompt=False, enable_thinking=True) or ""
        space = f"[{re.escape(WHITESPACE)}]*"
        found = re.search(f"({re.escape(tags.start)}{space}){_PROBE}({space}{re.escape(tags.end)}{space})", out)
        return (found[1], found[2]) if found else (tags.start, tags.end)

    def adapt(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """llama.cpp's workarounds for what this template cannot read, and system messages placed where it reads
        them (`place_systems`)."""
        messages = place_systems(messages, self.several_systems, self.late_systems)
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


def place_systems(messages: list[dict[str, Any]], several: bool, late: bool) -> list[dict[str, Any]]:
    """System (and developer) messages where a template that reads only one, at the start, can take them: agents
    send more (Codex: base instructions and permissions as two leading developer items; Claude Code: a system
    message after the first user turn). The leading ones are joined into one (blank line between). A later one
    joins the user message just before it, or else the one just after it, or else becomes a user message of its
    own: never the leading system prompt, whose change would make every turn re-read the whole conversation,
    and never an earlier place than it was sent at (so each turn's prompt extends the last one's)."""
    messages = list(messages)  # a copy: a late system message may change the user message after it
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead > 1 and not several:
        joined = {"role": "system", "content": "\n\n".join(as_text(m["content"]) for m in messages[:lead])}
        messages, lead = [joined, *messages[lead:]], 1
    if late:
        return messages
    out = messages[:lead]
    for i in range(lead, len(messages)):
        m = messages[i]
        if m["role"] != "system":
            out.append(m)
        elif out[lead:] and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": f"{as_text(out[-1]['content'])}\n\n{as_text(m['content'])}"}
        elif i + 1 < len(messages) and messages[i + 1]["role"] == "user":
            after = messages[i + 1]
            messages[i + 1] = {**after, "content": f"{as_text(m['content'])}\n\n{as_text(after['content'])}"}
        else:
            out.append({"role": "user", "content": m["content"]})
    return out


def _common_prefix(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return a[:i]
    return a if len(a) <= len(b) else b
