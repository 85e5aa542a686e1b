"""What every request passes before its handler, as one plain ASGI layer: CORS, readiness, the API key.

In order, as llama-server's pre-routing handler: the CORS origin header goes on every answer; a preflight
(OPTIONS) is answered here, before the key is checked (browsers send no key with it); until the model is
loaded every path but the web page answers 503 `Loading model`; then the API key, for all but llama-server's
public set. It is plain ASGI rather than Starlette's BaseHTTPMiddleware, which hides a client's disconnect
from handlers whose answer has not started (a non-streamed completion must see it to free its slot).

CORS, llama-server's flags (`--cors-origins`, `--cors-methods`, `--cors-headers`, `--cors-credentials`):
`*` with credentials echoes the request's Origin; `localhost` echoes only a localhost origin (http://localhost,
127.0.0.1 or [::1], any port); a comma-separated list echoes an origin found in it (where llama-server would
send the list itself, which browsers reject). The default, `auto`, is `*` with an API key (llama-server's
default: the key is the guard, and a page cannot send it without knowing it) and `localhost` without one.

Where origins are restricted, a request from a web page of another origin is refused (403), not only left
unreadable: CORS alone stops a page reading an answer, not sending a request (a form POST, or
`POST /slots/0?action=erase` with no body, needs no preflight), so without this any page the user visits could
drive an open server on their machine (issue 36, finding 9). Ollama refuses such origins the same way. Requests
without an Origin (curl, the SDKs, agents) and the server's own page (its Origin is the Host it was asked at)
pass.

Response header names go out in their canonical case (`Access-Control-Allow-Origin`,
`Process-Start-Time-Unix`): HTTP says case does not matter, but clients that read headers into a plain
dict, llama.cpp's own test suite among them, look them up as llama-server writes them.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from .errors import LOADING, UNAUTHORIZED, APIError

log = logging.getLogger("mtpserve.server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = {"/health", "/v1/health", "/v1/models", "/models"}
PAGE_PATHS = {"/", "/index.html"}
LOCALHOSTS = {"localhost", "127.0.0.1", "::1"}
STATIC = "/static/"
STATIC_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".png": "image/png",
}


def _page_assets() -> dict[str, str]:
    """The web page's own files (server/static/, subfolders included, the page itself not): name -> type."""
    found: dict[str, str] = {}
    folders = [("", resources.files("mtpserve.server").joinpath("static"))]
    while folders:
        at, folder = folders.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                folders.append((f"{at}{entry.name}/", entry))
            elif kind := STATIC_TYPES.get("." + entry.name.rsplit(".", 1)[-1]):
                found[at + entry.name] = kind
    return found


# Served at /static/<name> (app.py) and, like the page, without the key (a browser sends none with
# <script src>): exactly these names, so any other path under /static/ is still asked for the key.
PAGE_ASSETS = _page_assets()


@dataclass(frozen=True)
class CorsSettings:
    """llama-server's CORS flags and their defaults."""

    origins: str = "*"  # resolved: "auto" is decided by resolve_origins before this is made
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allowed_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for a request from `origin` ("" when it sent none)."""
        if self.origins == "*":
            return origin if self.credentials else "*"
        if self.origins == "localhost":
            return origin if origin and is_localhost(origin) else None
        allowed = {o.strip() for o in self.origins.split(",") if o.strip()}
        return origin if origin in allowed else None


def resolve_origins(origins: str, has_api_key: bool) -> str:
    """--cors-origins as given, `auto` decided: `*` with an API key, `localhost` without."""
    if origins != "auto":
        return origins
    return "*" if has_api_key else "localhost"


def same_origin(origin: str, host: str) -> bool:
    """Whether a browser's Origin is the address it asked this server at (the Host header): the server's own page."""
    try:
        return bool(host) and urlsplit(origin).netloc.lower() == host.lower()
    except ValueError:
        return False


def is_localhost(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in LOCALHOSTS


def canonical_header(name: bytes) -> bytes:
    """`access-control-allow-origin` -> `Access-Control-Allow-Origin`."""
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


class Gatekeeper:
    """The ASGI layer in front of the FastAPI app (see the module docstring). `ready()`: whether the model is
    loaded; `api_keys`: empty for an open server; `error_body(path, error)`: an error's body for a path
    (Anthropic's clients read their own error shape)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        cors: CorsSettings,
        api_keys: list[str],
        prefix: str,
        ready: Callable[[], bool],
        error_body: Callable[[str, APIError], dict[str, Any]],
    ) -> None:
        self.app, self.cors, self.api_keys, self.prefix = app, cors, api_keys, prefix.rstrip("/")
        self.ready, self.error_body = ready, error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin", "")
        allow_origin = self.cors.allowed_origin(origin)
        foreign = bool(origin) and allow_origin is None and not same_origin(origin, headers.get("host", ""))
        if foreign:
            log.warning("srv  log_server_r: (CORS) skip origin: %s", origin[:200])
        extra: list[tuple[bytes, bytes]] = []
        if allow_origin is not None:
            extra.append((b"access-control-allow-origin", allow_origin.encode("latin-1")))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                merged = [*message.get("headers", []), *(h for h in extra if h[0] not in names)]
                message = {**message, "headers": [(canonical_header(k.lower()), v) for k, v in merged]}
            await send(message)

        path = scope["path"]
        if self.prefix and path.startswith(self.prefix):
            path = path[len(self.prefix) :]
        if scope["method"] == "OPTIONS":
            extra += [
                (b"access-control-allow-credentials", b"true" if self.cors.credentials else b"false"),
                (b"access-control-allow-methods", self.cors.methods.encode("latin-1")),
                (b"access-control-allow-headers", self.cors.headers.encode("latin-1")),
            ]
            await _answer(send_with_headers, 200, None)
        elif foreign:
            await _answer(send_with_headers, 403, self.error_body(path, _foreign(origin)))
        elif path in PAGE_PATHS or (path.startswith(STATIC) and path[len(STATIC) :] in PAGE_ASSETS):
            await self.app(scope, receive, send_with_headers)
        elif not self.ready():
            await _answer(send_with_headers, 503, LOADING.body())
        elif self.api_keys and path not in PUBLIC_PATHS and not key_ok(headers, self.api_keys):
            log.warning("srv  log_server_r: unauthorized: Invalid API Key")
            await _answer(send_with_headers, 401, self.error_body(path, UNAUTHORIZED))
        else:
            await self.app(scope, receive, send_with_headers)


def key_ok(headers: dict[str, str], keys: list[str]) -> bool:
    """llama-server's rule: `Authorization` (a leading "Bearer " stripped), else `X-Api-Key`; every key
    compared in constant time so the answer's timing tells nothing about the keys."""
    given = headers.get("authorization") or headers.get("x-api-key") or ""
    given = given.removeprefix("Bearer ")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


async def _answer(send: Send, status: int, body: dict[str, Any] | None) -> None:
    """A whole answer from this layer: a JSON body, or an empty one (a preflight)."""
    data = json.dumps(body).encode() if body is not None else b""
    kind = b"application/json" if body is not None else b"text/html"
    headers = [(b"content-type", kind), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def error_bodies(anthropic_error: Callable[[str, int], dict[str, Any]]) -> Callable[[str, APIError], dict[str, Any]]:
    """An error's body by path: Anthropic's shape under /v1/messages, OpenAI's elsewhere."""

    def body(path: str, error: APIError) -> dict[str, Any]:
        if path.startswith("/v1/messages"):
            return anthropic_error(error.message, error.code)
        return error.body()

    return body


def _foreign(origin: str) -> APIError:
    return APIError(
        f"requests from web pages at {origin[:200]} are refused: this server allows its own page and localhost "
        "pages (--cors-origins); allow this origin with --cors-origins, or set --api-key (any origin may then ask, "
        "with the key)",
        "permission_error",
        403,
    )
