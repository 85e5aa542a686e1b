"""The Gatekeeper in front of the app (llama-server's pre-routing rules): CORS by --cors-origins, pages of other
origins refused where origins are restricted, preflights answered before the key is asked for, 503 while loading,
401 without the key, header names in their canonical case. On a bare ASGI app: no model needed."""

from __future__ import annotations

import httpx
import pytest

from mtpserve.server.middleware import CorsSettings, Gatekeeper, canonical_header, error_bodies, resolve_origins

KEY = "k-123"
REACHED: list[str] = []  # paths the app behind the gatekeeper was called for


async def hello(scope, receive, send):
    REACHED.append(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-process-start-time-unix", b"1")]})
    await send({"type": "http.response.body", "body": b"{}"})


DEFAULT_CORS = CorsSettings()


def client(cors: CorsSettings = DEFAULT_CORS, ready: bool = True, keys: tuple[str, ...] = (KEY,)) -> httpx.AsyncClient:
    app = Gatekeeper(
        hello,
        cors=cors,
        api_keys=list(keys),
        prefix="",
        ready=lambda: ready,
        error_body=error_bodies(lambda message, code: {"type": "error", "error": {"message": message}}),
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}


@pytest.mark.anyio
async def test_a_preflight_is_answered_without_the_key_with_llama_servers_headers():
    async with client() as c:
        response = await c.options("/completions", headers={"Origin": "web.mydomain.fr", **PREFLIGHT})
    assert response.status_code == 200
    raw = dict((k.decode(), v.decode()) for k, v in response.headers.raw)
    assert raw["Access-Control-Allow-Origin"] == "web.mydomain.fr"  # "*" with credentials: the origin echoed
    assert raw["Access-Control-Allow-Credentials"] == "true"
    assert raw["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert raw["Access-Control-Allow-Headers"] == "*"


@pytest.mark.parametrize(
    "origin,allowed",
    [
        ("http://localhost", True),
        ("http://127.0.0.1:3000", True),
        ("http://[::1]:8080", True),
        ("http://localhost.evil.com", False),
        ("http://notlocalhost", False),
        ("http://evil.com", False),
    ],
)
@pytest.mark.anyio
async def test_localhost_origins_only(origin, allowed):
    async with client(CorsSettings(origins="localhost")) as c:
        response = await c.get("/health", headers={"Origin": origin})
        preflight = await c.options("/completions", headers={"Origin": origin, **PREFLIGHT})
    assert response.headers.get("access-control-allow-origin") == (origin if allowed else None)
    assert response.status_code == (200 if allowed else 403)
    assert preflight.status_code == 200  # llama-server's: answered, without the origin for a foreign page
    assert preflight.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_auto_origins_are_any_with_a_key_and_localhost_without():
    assert resolve_origins("auto", has_api_key=True) == "*"
    assert resolve_origins("auto", has_api_key=False) == "localhost"
    assert resolve_origins("https://a.example", has_api_key=False) == "https://a.example"


@pytest.mark.anyio
async def test_a_foreign_page_cannot_drive_a_keyless_server():
    """A page elsewhere sending a request that needs no preflight (a form POST; a slot erase has no body) is refused
    before the app sees it, not only left unreadable (issue 36, finding 9)."""
    REACHED.clear()
    async with client(CorsSettings(origins="localhost"), keys=()) as c:
        erase = await c.post("/slots/0?action=erase", headers={"Origin": "https://evil.example"})
        messages = await c.post("/v1/messages", content=b"{}", headers={"Origin": "https://evil.example"})
        form = await c.post("/completion", data={"prompt": "x"}, headers={"Origin": "null"})  # a file:// page
        own_page = await c.post("/completion", json={}, headers={"Origin": "http://test"})  # Host: test
        no_origin = await c.post("/completion", json={})  # curl, the SDKs, agents
    for refused in (erase, messages, form):
        assert refused.status_code == 403
        assert "--cors-origins" in refused.text
    assert erase.json()["error"]["type"] == "permission_error"
    assert messages.json()["type"] == "error"  # Anthropic's shape under /v1/messages
    assert own_page.status_code == 200 and no_origin.status_code == 200
    assert REACHED == ["/completion", "/completion"]


@pytest.mark.anyio
async def test_a_list_of_origins_echoes_only_its_members():
    cors = CorsSettings(origins="https://a.example, https://b.example")
    async with client(cors) as c:
        ok = await c.get("/health", headers={"Origin": "https://b.example"})
        other = await c.get("/health", headers={"Origin": "https://c.example"})
    assert ok.headers["access-control-allow-origin"] == "https://b.example"
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.anyio
async def test_loading_then_the_key_then_the_handler():
    async with client(ready=False) as c:
        assert (await c.get("/completion")).status_code == 503
        assert (await c.get("/")).status_code == 200  # the page shows "loading" itself
    async with client() as c:
        assert (await c.get("/health")).status_code == 200  # public
        assert (await c.post("/completion")).json()["error"]["type"] == "authentication_error"
        assert (await c.post("/v1/messages")).json()["type"] == "error"  # Anthropic's shape
        ok = await c.post("/completion", headers={"X-Api-Key": KEY})
    assert ok.status_code == 200
    assert dict((k.decode(), v.decode()) for k, v in ok.headers.raw)["X-Process-Start-Time-Unix"] == "1"


def test_header_names_are_written_in_canonical_case():
    assert canonical_header(b"process-start-time-unix") == b"Process-Start-Time-Unix"
    assert canonical_header(b"content-type") == b"Content-Type"
