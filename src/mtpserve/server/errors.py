"""Errors a client can cause, in the shape OpenAI and llama-server return them:
`{"error": {"code": C, "message": "...", "type": T}}` with HTTP status C (../shared/spec/server-api.md §1.2).

Every client mistake is one of these (4xx, a message that says what to fix); only a bug in the server
gives a 500. Where llama-server answers a client mistake with 500 (malformed JSON), we answer 400.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses or could not serve; carries its HTTP status and error type."""

    def __init__(
        self,
        message: str,
        type: str = "invalid_request_error",
        code: int = 400,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.message, self.type, self.code, self.extra = message, type, code, extra
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "type": self.type, **self.extra}}


def invalid(message: str) -> APIError:
    return APIError(message, "invalid_request_error", 400)


def unsupported(message: str) -> APIError:
    """A parameter this server knows but does not implement: refused, never silently ignored."""
    return APIError(message, "invalid_request_error", 400, param_unsupported=True)


UNAUTHORIZED = APIError("Invalid API Key", "authentication_error", 401)
LOADING = APIError("Loading model", "unavailable_error", 503)
NOT_FOUND = APIError("File Not Found", "not_found_error", 404)
