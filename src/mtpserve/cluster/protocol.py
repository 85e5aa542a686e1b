"""What crosses between the gateway and an engine replica besides the request itself: a request's events in batches
(one batch per engine step: what was ready when the replica looked), and engine errors as plain data, so that an
error reaches the client with its own type, code and message whatever Ray's pickling makes of exception objects."""

from __future__ import annotations

from typing import Any

from ..engine import EngineError
from ..engine.client import Event

ERROR_KEY = "engine_error"
ACCEPTED: list[Any] = []  # the first batch of every request: a replica took it (it left Serve's queue)


def encode(event: Event) -> Any:
    """An event as it travels: the dataclass events as they are, an EngineError as data."""
    if isinstance(event, EngineError):
        return {ERROR_KEY: event.to_dict()}
    return event


def decode(item: Any) -> Event:
    if isinstance(item, dict) and ERROR_KEY in item:
        return RemoteEngineError.from_data(item[ERROR_KEY])
    return item


class RemoteEngineError(EngineError):
    """An engine error raised on a replica: llama-server's `type`, `code`, message and extra fields, as sent."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(str(data.get("message", "")))
        self.data = dict(data)
        self.type = str(data.get("type", "server_error"))
        self.code = int(data.get("code", 500))

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> RemoteEngineError:
        return cls(data)

    def to_dict(self) -> dict[str, object]:
        return dict(self.data)
