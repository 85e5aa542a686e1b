"""Chats as llama-server reads and writes them: the GGUF's Jinja chat template rendered in a bounded sandbox
(`template.py`, `sandbox.py`), the messages and tools normalised as llama.cpp hands them over (`messages.py`), and
the generated text split into reasoning, content and tool calls (`reasoning.py`, `tool_calls.py`).

A leaf beside `mtpserve.tokenizer` (it imports nothing of the project): a template reads what it needs from a
tokenizer through `TemplateSource`.
"""

from .errors import ChatTemplateError, ChatTemplateLimitError
from .reasoning import ReasoningSplit, ReasoningStream, ThinkTags, split_reasoning
from .template import CHATML_TEMPLATE, ChatPrompt, ChatTemplate, TemplateSource, resolve_chat_template
from .tool_calls import ToolCallStream, parse_tool_calls

__all__ = [
    "CHATML_TEMPLATE",
    "ChatPrompt",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "ReasoningSplit",
    "ReasoningStream",
    "TemplateSource",
    "ThinkTags",
    "ToolCallStream",
    "parse_tool_calls",
    "resolve_chat_template",
    "split_reasoning",
]
