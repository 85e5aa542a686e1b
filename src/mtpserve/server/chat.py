"""`/v1/chat/completions`: OpenAI chat bodies -> a rendered, tokenized prompt; generated text -> the
message (`reasoning_content`, `content`, `tool_calls`) as llama-server builds it
(../shared/spec/server-api.md §2, chat-template.md §3-4).

One path for streaming and not: `ChatOutput` turns text as it is generated into OpenAI deltas (reasoning
first, then content, then tool calls); a non-streamed answer is those deltas assembled, so the two can
never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..chat import ChatTemplate, ChatTemplateError, ReasoningStream, ToolCallStream
from ..chat.structured import StructuredOutputError, output_grammar, response_schema, tool_call_format
from ..engine import GrammarSpec
from ..engine.reasoning_budget import budget_spec, opens_reasoning
from ..engine.request import ReasoningBudgetSpec
from ..tokenizer import Tokenizer
from .errors import invalid
from .params import Body

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's; others are refused
# A request's effort (chat `reasoning_effort`, Responses `reasoning.effort`, Anthropic `output_config.effort`) as a
# thinking budget in tokens when it sets none itself; "none" turns thinking off; -1: the server's --reasoning-budget.
# Chosen for Qwen 3.5/3.6, whose thinking on a coding turn runs to a few thousand tokens: low and minimal cut it
# short, medium leaves room for most turns, high and above leave it to the model.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 8192, "high": -1, "xhigh": -1, "max": -1}
PRESERVED_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # special tokens emitted as text
USER_PROBE = "\ue000mtpserve-user\ue000"  # stands for a user message's content to find where it starts


@dataclass
class ChatSettings:
    """Server-wide chat defaults (--reasoning, --reasoning-format, --chat-template-kwargs, --reasoning-budget*)."""

    reasoning: str = "auto"  # on | off | auto
    reasoning_format: str = "deepseek"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int = -1  # --reasoning-budget: thinking tokens (-1 unlimited, 0 close at once)
    reasoning_budget_message: str = ""  # --reasoning-budget-message: forced before the end tag
    prefill_assistant: bool = True  # a trailing assistant message is continued (--no-prefill-assistant: off)


@dataclass
class ChatPlan:
    """What the prompt and the output parser of one chat request need."""

    prompt: list[int]
    generation_prompt: str
    extract_reasoning: bool
    tools: list[dict[str, Any]] | None
    parallel_tool_calls: bool
    logprobs: bool
    top_logprobs: int
    last_user_start: int | None
    resume_at: tuple[int, ...] = ()  # where a later request may resume: the system prompt's and the messages' ends
    grammar: GrammarSpec | None = None  # response_format / tool_choice as a constraint on the output
    reasoning_budget: ReasoningBudgetSpec | None = None  # a reasoning budget on the output's opened <think>
    prompt_text: str = ""  # the rendered prompt, before tokenization (`__verbose.prompt`, /apply-template)
    prefill: str = ""  # the continued final message: the start of the output, already in the prompt
    stream_prefill: bool = True  # whether the first delta repeats the prefill (llama-server: unless asked for)


def plan_chat(body: Body, template: ChatTemplate, tokenizer: Tokenizer, settings: ChatSettings) -> ChatPlan:
    messages = body.raw("messages")
    if messages is None:
        raise invalid("'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise invalid("Field 'messages': expected a non-empty array of messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise invalid(f"Field 'messages[{i}].role': expected one of {', '.join(ROLES)}, got {role!r}"[:300])
    tools = body.raw("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("Field 'tools': expected an array")
    tool_choice = body.raw("tool_choice", "auto")
    if not (tool_choice in ("auto", "none", "required") or _named_choice(tool_choice)):
        raise invalid(
            "Field 'tool_choice': expected 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"[:300]
        )
    # tool_choice "none": the tools are still in the prompt (as llama-server renders them: a client that turns
    # tool calls off for one turn keeps its conversation's prefix), only no call is parsed or constrained
    parsed_tools = None if tool_choice == "none" else tools or None
    try:
        schema = response_schema(body.dict("response_format"))
    except StructuredOutputError as e:
        raise invalid(f"Field 'response_format': {e}") from None
    reasoning_format = body.str("reasoning_format", settings.reasoning_format)
    if reasoning_format not in REASONING_FORMATS:
        raise invalid(f"Field 'reasoning_format': expected one of {', '.join(REASONING_FORMATS)}")
    kwargs = {**settings.template_kwargs, **body.dict("chat_template_kwargs")}
    enable_thinking = template.supports_thinking and settings.reasoning != "off"
    if body.raw("reasoning_effort") == "none":
        enable_thinking = False
    elif isinstance(body.raw("reasoning_effort"), str):
        kwargs.setdefault("reasoning_effort", body.raw("reasoning_effort"))
    if "enable_thinking" in kwargs and isinstance(kwargs["enable_thinking"], bool):
        enable_thinking = kwargs["enable_thinking"]
    add_generation_prompt = body.bool("add_generation_prompt", True)
    continuation = _continuation(body.raw("continue_final_message"))
    asked = continuation is not None
    if not asked and settings.prefill_assistant and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise invalid("Cannot have 2 or more assistant messages at the end of the list.")
        continuation, add_generation_prompt = "auto", False
    if continuation is not None and add_generation_prompt:
        raise invalid("Cannot set both add_generation_prompt and continue_final_message to true.")
    if continuation is not None and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
        raise invalid("Cannot continue an assistant message that contains tool calls.")
    try:
        rendered = template.apply(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continuation,
            enable_thinking=enable_thinking,
            chat_template_kwargs=kwargs,
        )
    except ChatTemplateError as e:
        raise invalid(str(e)) from None
    prompt = tokenizer.encode(rendered.prompt, add_special=True, parse_special=True)
    generation_prompt = rendered.generation_prompt if add_generation_prompt or continuation else ""
    output_start = generation_prompt + rendered.prefill  # what the model's output continues
    think_tags = template.think_tags
    opened = think_tags is not None and opens_reasoning(output_start, think_tags.start, think_tags.closers)
    try:
        grammar = output_grammar(
            reasoning=think_tags if opened else None,
            tools=tools or None,
            tool_choice=tool_choice,
            parallel_tool_calls=body.bool("parallel_tool_calls", True),
            response_schema=schema,
            tool_format=tool_call_format(template.source),
        )
    except StructuredOutputError as e:
        raise invalid(str(e)) from None
    logprobs = body.bool("logprobs", False)
    top_logprobs = body.int("top_logprobs", 20 if logprobs else 0, lo=0, hi=20)
    if top_logprobs and not logprobs and body.has("top_logprobs"):
        raise invalid("top_logprobs requires logprobs to be set to true")
    reasoning_budget = _reasoning_budget(body, settings, output_start, template, tokenizer)
    return ChatPlan(
        prompt=prompt,
        generation_prompt=generation_prompt,
        extract_reasoning=reasoning_format != "none",
        tools=parsed_tools,
        parallel_tool_calls=body.bool("parallel_tool_calls", True),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        last_user_start=_user_start(-1, messages, prompt, template, tokenizer, tools, enable_thinking, kwargs),
        resume_at=(
            *_positions(_user_start(0, messages, prompt, template, tokenizer, tools, enable_thinking, kwargs)),
            *_positions(_messages_end(prompt, generation_prompt, tokenizer)),
        ),
        grammar=GrammarSpec(*grammar) if grammar else None,
        reasoning_budget=reasoning_budget,
        prompt_text=rendered.prompt,
        prefill=rendered.prefill,
        stream_prefill=not asked,
    )


def _continuation(value: object) -> str | None:
    """`continue_final_message` as llama.cpp reads it: true (the message's kind decides), "content" or
    "reasoning_content"; anything else is off."""
    if value is True:
        return "auto"
    return value if isinstance(value, str) and value in ("content", "reasoning_content") else None


def _reasoning_budget(
    body: Body, settings: ChatSettings, generation_prompt: str, template: ChatTemplate, tokenizer: Tokenizer
) -> ReasoningBudgetSpec | None:
    """The request's reasoning budget (`reasoning_budget_tokens`, alias `thinking_budget_tokens`, -1: the
    server's; `reasoning_budget_message`), if one applies: only an output that starts inside a reasoning
    block (the generation prompt opened it) is limited, as llama-server feeds that prompt to its sampler."""
    key = "reasoning_budget_tokens" if body.has("reasoning_budget_tokens") else "thinking_budget_tokens"
    tokens = body.int(key, -1, lo=-1)
    effort = body.raw("reasoning_effort")
    if not body.has(key) and isinstance(effort, str):
        tokens = EFFORT_BUDGETS.get(effort, -1)
    message = body.str("reasoning_budget_message", settings.reasoning_budget_message)
    tokens = settings.reasoning_budget if tokens == -1 else tokens
    tags = template.think_tags
    if tokens < 0 or tags is None or not opens_reasoning(generation_prompt, tags.start, tags.closers):
        return None
    closer = next((c for c in tags.closers if c in message), None)
    if closer is not None:  # forced text is not drawn through the mask: past its closer, nothing would constrain it
        source = (
            "Field 'reasoning_budget_message'" if body.has("reasoning_budget_message") else "--reasoning-budget-message"
        )
        raise invalid(f"{source} must not contain {closer!r}: the budget's message ends the reasoning itself")
    return budget_spec(tokenizer, tokens, message, tags.end, tags.interrupts)


def _named_choice(tool_choice: object) -> bool:
    """OpenAI's forced-function shape: {"type": "function", "function": {"name": NAME}}."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return False
    function = tool_choice.get("function")
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _user_start(
    which: int,
    messages: list[Any],
    prompt: list[int],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    tools: Any,
    enable_thinking: bool,
    kwargs: dict[str, Any],
) -> int | None:
    """Where the first (`which` 0) or the last (-1) user message starts in the prompt's tokens. The last: llama-server
    ends a prompt batch there (and keeps a recurrent checkpoint), so a follow-up turn reuses everything before it;
    the first: the end of the system prompt (and tools), which an agent's sub-agents and side requests share. Where
    a template refuses the messages before it (Qwen3.5/3.6's wants a user message), the first is found where its
    content starts instead."""
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    last = users[which] if users else 0
    if last == 0:
        return None

    def render(head: list[Any]) -> str:
        return template.apply(
            head, tools=tools, add_generation_prompt=False, enable_thinking=enable_thinking, chat_template_kwargs=kwargs
        ).prompt

    try:
        head = render(messages[:last])
    except ChatTemplateError:
        if which != 0:
            return None
        try:
            probe = render([*messages[:last], {**messages[last], "content": USER_PROBE}])
        except ChatTemplateError:
            return None
        head = probe[: probe.find(USER_PROBE)] if USER_PROBE in probe else ""
    ids = tokenizer.encode(head, add_special=True, parse_special=True)
    return len(ids) if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids else None


def _messages_end(prompt: list[int], generation_prompt: str, tokenizer: Tokenizer) -> int | None:
    """Where the generation prompt starts in the prompt's tokens: the next turn re-renders this turn's reply after
    the messages (Qwen3.5/3.6 without the empty reasoning block a thinking-off prompt ends in), so it resumes there."""
    if not generation_prompt:
        return None
    tail = tokenizer.encode(generation_prompt, add_special=False, parse_special=True)
    return len(prompt) - len(tail) if 0 < len(tail) < len(prompt) and prompt[-len(tail) :] == tail else None


def _positions(position: int | None) -> tuple[int, ...]:
    return () if position is None else (position,)


def keep_special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Control tokens whose text belongs in the output (the reasoning and tool-call tags)."""
    return frozenset(i for tag in PRESERVED_TAGS if (i := tokenizer.token_id(tag)) is not None)


class ChatOutput:
    """Generated text -> OpenAI `delta`s: reasoning split first, then tool calls out of the content.

    A continued message's prefill is parsed first, as the output's beginning (llama-server parses the
    generation prompt, prefill included, with the generated text): the message holds it, and the first delta
    repeats it unless the request asked for the continuation itself (llama-server's `is_continuation`)."""

    def __init__(self, plan: ChatPlan, template: ChatTemplate) -> None:
        self.reasoning = ReasoningStream(plan.generation_prompt, template.think_tags, extract=plan.extract_reasoning)
        self.tool_calls = ToolCallStream(plan.tools, parallel=plan.parallel_tool_calls)
        self.reasoning_content = ""
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self._held: list[dict[str, Any]] = []
        prefill = self.feed(plan.prefill) if plan.prefill else []
        self._held = prefill if plan.stream_prefill else []
        self._n_tokens = self._n_before_content = 0  # generated tokens fed, and those before the first content

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._release() + self._deltas(self.reasoning.feed(text), final=False)

    def feed_token(self, text: str) -> list[dict[str, Any]]:
        """`feed` of one generated token's text, counted for `reasoning_tokens`."""
        deltas = self.feed(text)
        self._n_tokens += 1
        if not self.reasoning.content:
            self._n_before_content = self._n_tokens
        return deltas

    def reasoning_tokens(self, n_generated: int) -> int:
        """The generated tokens that were reasoning (those before the first content; 0 without reasoning)."""
        return min(self._n_before_content, n_generated) if self.reasoning_content else 0

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """The rest; `cut`: the token limit ended the output (a call it cut off keeps the arguments generated)."""
        return self._release() + self._deltas(self.reasoning.finish(), final=True, cut=cut)

    @property
    def cut_call(self) -> bool:
        """The last tool call was cut off by the token limit: its arguments are unfinished JSON."""
        return self.tool_calls.cut_call

    def _release(self) -> list[dict[str, Any]]:
        held, self._held = self._held, []
        return held

    def _deltas(self, split: Any, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if split.reasoning_content:
            self.reasoning_content += split.reasoning_content
            out.append({"reasoning_content": split.reasoning_content})
        parsed = self.tool_calls.feed(split.content) if split.content else None
        pieces = [parsed] if parsed else []
        if final:
            pieces.append(self.tool_calls.finish(cut))
        for piece in pieces:
            if piece.content:
                self.content += piece.content
                out.append({"content": piece.content})
            if piece.tool_calls:
                self._assemble(piece.tool_calls)
                out.append({"tool_calls": piece.tool_calls})
        return out

    def _assemble(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            index = delta["index"]
            if index == len(self.calls):
                self.calls.append({"type": "function", "function": {"name": "", "arguments": ""}, "id": ""})
            call = self.calls[index]
            call["id"] = delta.get("id", call["id"])
            function = delta.get("function", {})
            call["function"]["name"] += function.get("name", "")
            call["function"]["arguments"] += function.get("arguments", "")

    def message(self) -> dict[str, Any]:
        """The whole assistant message (non-streamed answers), llama-server's shape."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.calls:
            message["tool_calls"] = self.calls
        return message
