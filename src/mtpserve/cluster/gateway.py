"""The gateway: the same FastAPI app as `mtpserve serve` (server.app.create_app), served by a Ray Serve ingress
deployment in front of the engine replicas.

Its `GatewayState` loads what the HTTP layer needs locally (the tokenizer and the chat template, read from the GGUF's
metadata, no weights) and starts a `RemoteEngine` instead of an `Engine` once a replica has reported its
`EngineInfo`. A small ASGI middleware sets the request's session key (remote.SESSION) for the session router: the
client's `x-session-id` header, else a hash of its conversation's first user turn.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import ray
from ray import serve

from ..engine import EngineClient, EngineInfo
from ..server.app import create_app
from ..server.state import ServerSettings, ServerState
from ..tokenizer import Tokenizer
from . import stats
from .remote import SESSION, RemoteEngine

SESSION_HEADER = b"x-session-id"
CONVERSATION_PATHS = ("/chat/completions", "/messages", "/responses")  # bodies whose first user turn keys a session


class GatewayState(ServerState):
    """ServerState whose engine is the replicas: requests go through `handle`, reports come from the stats board."""

    def __init__(self, settings: ServerSettings, handle: Any, app_name: str) -> None:
        super().__init__(settings)
        self._handle = handle
        self._board = stats.board(app_name)
        self._reports: dict[str, dict[str, Any]] = {}
        self._closed = threading.Event()

    def start_engine(self, tokenizer: Tokenizer) -> EngineClient:
        """A RemoteEngine, once a replica has reported (its model loaded); reports refreshed from then on."""
        while not (reports := ray.get(self._board.snapshot.remote())):
            if self._closed.wait(0.2):
                raise RuntimeError("the gateway stopped before any engine replica was ready")
        self._reports = reports
        threading.Thread(target=self._refresh, name="mtpserve-reports", daemon=True).start()
        info = EngineInfo(**next(iter(reports.values()))["info"])
        return RemoteEngine(self._handle, info, tokenizer, lambda: self._reports, self.settings.engine.grammar)

    def _refresh(self) -> None:
        while not self._closed.wait(stats.PUBLISH_PERIOD):
            try:
                self._reports = ray.get(self._board.snapshot.remote(), timeout=5)
            except Exception:  # noqa: BLE001, S112 - a slow board: keep the last reports, try again
                continue

    def close(self) -> None:
        self._closed.set()
        super().close()


@serve.ingress()
class Gateway:
    """The ingress deployment's class (app.py wraps it in `serve.deployment`): loads in the background, as
    `mtpserve serve` does (503 `Loading model` until the replicas are up)."""

    def __init__(self, settings: ServerSettings, engine: Any, app_name: str, session_keys: bool = False) -> None:
        self.state = GatewayState(settings, engine, app_name)
        self.session_keys = session_keys  # the session router's keys wanted: read chat bodies for them
        threading.Thread(target=self.state.load, name="mtpserve-load", daemon=True).start()

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.state)
        return SessionKeys(app, self.state.settings.max_body_bytes) if self.session_keys else app

    def __del__(self) -> None:
        self.state.close()


class SessionKeys:
    """ASGI middleware: the request's session key into remote.SESSION, from `x-session-id` or, for a chat body, a
    hash of its first user message (the body is read here, bounded, and replayed to the app)."""

    def __init__(self, app: Any, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = dict(scope.get("headers") or []).get(SESSION_HEADER)
        if key is not None:
            SESSION.set(key.decode("latin-1"))
        elif scope.get("method") == "POST" and scope.get("path", "").endswith(CONVERSATION_PATHS):
            messages, receive = await _buffered(receive, self.max_body)
            SESSION.set(first_user_turn_key(messages))
        await self.app(scope, receive, send)


async def _buffered(receive: Any, limit: int) -> tuple[list[dict], Any]:
    """The body's messages (empty when unreadable or over `limit`), and a `receive` that replays the body."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunks.append(message)
        size += len(message.get("body", b""))
        more = message.get("type") == "http.request" and message.get("more_body", False) and size <= limit
    replay = list(chunks)

    async def replayed() -> dict:
        return replay.pop(0) if replay else await receive()

    messages: list[dict] = []
    if size <= limit:
        try:
            body = json.loads(b"".join(m.get("body", b"") for m in chunks) or b"{}")
            found = body.get("messages") or body.get("input") if isinstance(body, dict) else None
            messages = found if isinstance(found, list) else []
        except (ValueError, AttributeError):
            pass
    return messages, replayed


def first_user_turn_key(messages: list[Any]) -> str | None:
    """A stable key of a conversation: the hash of its first user message (None when it has none)."""
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            content = json.dumps(m.get("content"), sort_keys=True, ensure_ascii=False)
            return hashlib.blake2b(content.encode(), digest_size=8).hexdigest()
    return None
