"""The errors a request (or a configuration) can end with; `type` and `code` are llama-server's error fields,
which the HTTP layer sends as they are."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot run."""

    type = "invalid_request_error"
    code = 400

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": str(self), "type": self.type}


class InvalidRequest(EngineError):
    pass


class ContextSizeExceeded(EngineError):
    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
        )
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx}


class Cancelled(EngineError):
    type = "cancelled"
    code = 499

    def __init__(self) -> None:
        super().__init__("the request was cancelled")


class ServerError(EngineError):
    type = "server_error"
    code = 500


class ShuttingDown(ServerError):
    """Work that had not started when the server was told to stop (SIGTERM), a grammar's compile included."""

    type = "unavailable_error"
    code = 503

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class ContextPoolFull(ServerError):
    """--kv-unified: the shared pool has no cell left for a generating slot's next token. llama-server ends the
    requests with this message (a 500); here only the slot that found no cell, the others go on."""

    def __init__(self, n_cells: int) -> None:
        super().__init__(
            f"Context size has been exceeded: the shared KV pool (--kv-unified, {n_cells} cells) is full; "
            "retry, or raise --ctx-size"
        )


class InsufficientMemory(EngineError):
    """A configuration that does not fit the memory it would run in (the message says what to lower)."""

    type = "insufficient_memory"
    code = 500
