"""The errors of rendering a chat: one type a server turns into HTTP 400, and the limits' subtype."""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """A chat template or chat request that cannot be rendered; the message says why (an HTTP 400)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render stopped by a limit of the sandbox (time, output size, printed size, integer size)."""
