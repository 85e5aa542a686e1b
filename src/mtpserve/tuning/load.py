"""Load and faults against a running server, for a set time: concurrent streaming clients, some of which
misbehave as network clients do. Used by the CI load test (seconds) and by bench/soak.py (hours).

Client kinds, chosen round robin per request:
* `stream`: a streamed chat completion read to the end; every chunk must be whole JSON, the last `[DONE]`;
* `vanish`: reads a few chunks, then drops the connection;
* `slow`: reads its stream with pauses (a slow mobile client);
* `half_close`: a raw HTTP/1.1 request whose sender then shuts its writing side. uvicorn reports the
  end of the client's stream as a disconnect, so the server cancels the request and closes: that is
  the intended outcome (an answer, had one come, would be checked as whole JSON);
* `cancel_prompt`: a long prompt, dropped before the first token (cancelled during prompt processing).

The report: requests by kind and outcome, errors by kind, latency percentiles of completed requests,
the server's resident memory before and after (when its pid is known), and whether every slot is idle
at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

KINDS = ("stream", "stream", "stream", "vanish", "slow", "half_close", "stream", "cancel_prompt")
QUESTIONS = ["Count from one to ten.", "Name three colours.", "What is a list in Python?", "Say hello in French."]


@dataclass
class LoadReport:
    duration_s: float = 0.0
    clients: int = 0
    started: Counter = field(default_factory=Counter)  # by kind
    completed: Counter = field(default_factory=Counter)  # by kind, as the kind intends (read to the end, or left)
    errors: Counter = field(default_factory=Counter)  # "kind: what"
    latencies_ms: list[float] = field(default_factory=list)  # completed full reads
    rss_before_kib: int | None = None
    rss_after_kib: int | None = None
    slots_idle_at_end: bool | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def as_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "clients": self.clients,
            "started": dict(self.started),
            "completed": dict(self.completed),
            "errors": dict(self.errors),
            "p50_ms": self.percentile(0.5),
            "p99_ms": self.percentile(0.99),
            "rss_before_kib": self.rss_before_kib,
            "rss_after_kib": self.rss_after_kib,
            "slots_idle_at_end": self.slots_idle_at_end,
        }

    def text(self) -> str:
        lines = [
            f"load: {self.clients} concurrent clients for {self.duration_s:.0f} s",
            f"  requests started:   {sum(self.started.values())} ({_counts(self.started)})",
            f"  completed as meant: {sum(self.completed.values())} ({_counts(self.completed)})",
            f"  errors:             {self.error_count}" + (f" ({_counts(self.errors)})" if self.errors else ""),
            f"  latency (full streams): p50 {self.percentile(0.5):.0f} ms, p99 {self.percentile(0.99):.0f} ms",
        ]
        if self.rss_before_kib is not None and self.rss_after_kib is not None:
            growth = self.rss_after_kib - self.rss_before_kib
            lines.append(
                f"  server memory (RSS): {self.rss_before_kib / 1024:.0f} MiB before, "
                f"{self.rss_after_kib / 1024:.0f} MiB after ({growth / 1024:+.0f} MiB)"
            )
        if self.slots_idle_at_end is not None:
            lines.append(f"  all slots idle at the end: {'yes' if self.slots_idle_at_end else 'NO'}")
        return "\n".join(lines)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class _Client:
    def __init__(self, url: str, headers: dict[str, str], max_tokens: int, report: LoadReport) -> None:
        self.url, self.headers, self.max_tokens, self.report = url, headers, max_tokens, report

    def body(self, i: int, long_prompt: bool = False) -> dict[str, Any]:
        question = QUESTIONS[i % len(QUESTIONS)]
        if long_prompt:
            question = ("Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 150)[:6000]
        return {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
        }

    async def run(self, client: httpx.AsyncClient, kind: str, i: int) -> None:
        self.report.started[kind] += 1
        t0 = time.perf_counter()
        try:
            if kind == "half_close":
                await self._half_close(i)
            else:
                await self._stream(client, kind, i)
        except Exception as e:  # noqa: BLE001 - every failure is counted by kind, the load goes on
            self.report.errors[f"{kind}: {type(e).__name__}: {str(e)[:80]}"] += 1
            return
        self.report.completed[kind] += 1
        if kind in ("stream", "slow", "half_close"):
            self.report.latencies_ms.append(1000 * (time.perf_counter() - t0))

    async def _stream(self, client: httpx.AsyncClient, kind: str, i: int) -> None:
        body = self.body(i, long_prompt=kind == "cancel_prompt")
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=self.headers) as r:
            if kind == "cancel_prompt":
                return  # the headers came; leave before the first token
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:100]}")
            lines = 0
            done = False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    if line.startswith(":"):
                        continue
                    raise RuntimeError(f"not an SSE line: {line[:60]!r}")
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])  # a malformed chunk raises here
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
                lines += 1
                if kind == "vanish" and lines >= 3:
                    return
                if kind == "slow":
                    await asyncio.sleep(0.05)
            if not done:
                raise RuntimeError("the stream ended without [DONE]")

    async def _half_close(self, i: int) -> None:
        parsed = urlparse(self.url)
        payload = json.dumps({**self.body(i), "stream": False}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parsed.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            + "\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
        try:
            writer.write(head + payload)
            await writer.drain()
            writer.write_eof()  # half-close: nothing more will be sent
            data = await asyncio.wait_for(reader.read(), 300)
        finally:
            writer.close()
        if not data:
            return  # cancelled as a client that left
        status = data.split(b"\r\n", 1)[0]
        if b" 200 " not in status:
            raise RuntimeError(f"half-closed request got {status[:60]!r}")
        json.loads(data.split(b"\r\n\r\n", 1)[1])


async def _run(
    url: str, duration: float, clients: int, api_key: str | None, max_tokens: int, report: LoadReport
) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    worker = _Client(url.rstrip("/"), headers, max_tokens, report)
    deadline = time.monotonic() + duration
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as client:

        async def loop() -> None:
            while time.monotonic() < deadline:
                i = next(counter)
                await worker.run(client, KINDS[i % len(KINDS)], i)

        await asyncio.gather(*(loop() for _ in range(clients)))


def run_load(
    url: str,
    duration: float,
    clients: int = 64,
    api_key: str | None = None,
    max_tokens: int = 32,
    server_pid: int | None = None,
    settle: float = 10.0,
) -> LoadReport:
    """Hold `clients` concurrent clients against `url` for `duration` seconds; report what happened."""
    report = LoadReport(duration_s=duration, clients=clients)
    if server_pid:
        report.rss_before_kib = rss_kib(server_pid)
    asyncio.run(_run(url, duration, clients, api_key, max_tokens, report))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + settle  # cancelled requests free their slots at the engine's next step
    while True:
        try:
            slots = httpx.get(f"{url}/slots", headers=headers, timeout=10).json()
            report.slots_idle_at_end = not any(s["is_processing"] for s in slots)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            report.slots_idle_at_end = None
        if report.slots_idle_at_end is not False or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if server_pid:
        report.rss_after_kib = rss_kib(server_pid)
    return report
