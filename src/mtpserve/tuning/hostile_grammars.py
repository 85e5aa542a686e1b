"""A storm of hostile grammars against a running server (issue 36): heavy compiles at once through every API that
takes a grammar, half of their clients leaving early, while a normal chat is sent every half second. Used by
bench/hostile_grammars.py (which also times the exit on SIGTERM) and by a slow test.

The report: the normal chats' statuses and latencies, the hostile requests' statuses (each a 400 naming the limit
it ran past, or the client left), and the peak resident memory of the server with its grammar workers.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HOSTILE_PER_STORM = 10
CHAT_EVERY_S = 0.5


def hostile_requests() -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of grammars that take xgrammar minutes or gigabytes, each under the default 1 MiB source
    limit as sent, through the APIs that take one: a chat's and a response's JSON format, a GBNF grammar and a
    JSON schema on /completion. (Tools would work too, but a tool set this size is first a prompt over any
    context, refused before it compiles.)"""
    enum = {"type": "string", "enum": [f"value-{i:06d}" for i in range(40_000)]}
    optional = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6_000)}}
    alternatives = "root ::= " + " | ".join(f'"w{i}"' for i in range(60_000))
    chat = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 8}

    def formatted(schema: dict[str, Any]) -> dict[str, Any]:
        return chat | {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}

    return [
        ("/v1/chat/completions", formatted(enum)),
        ("/v1/responses", {"input": "go", "max_output_tokens": 16,
                           "text": {"format": {"type": "json_schema", "name": "o", "schema": optional}}}),
        ("/completion", {"prompt": "go", "n_predict": 8, "grammar": alternatives}),
        ("/completion", {"prompt": "go", "n_predict": 8, "json_schema": enum}),
        ("/v1/chat/completions", formatted(optional)),
    ]  # fmt: skip


@dataclass
class StormReport:
    hostile: Counter = field(default_factory=Counter)  # "400 <limit>" / "left" / other statuses
    chat_status: Counter = field(default_factory=Counter)
    chat_latency_s: list[float] = field(default_factory=list)
    rss_mib_before: float = 0.0
    rss_mib_peak: float = 0.0

    @property
    def chat_p50_s(self) -> float:
        return statistics.median(self.chat_latency_s) if self.chat_latency_s else float("nan")

    @property
    def chat_max_s(self) -> float:
        return max(self.chat_latency_s, default=float("nan"))

    def text(self) -> str:
        return (
            f"hostile grammars: {dict(self.hostile)}\n"
            f"normal chats: {dict(self.chat_status)}, "
            f"latency p50 {self.chat_p50_s:.2f} s, max {self.chat_max_s:.2f} s\n"
            f"server + grammar workers RSS: {self.rss_mib_before:.0f} MiB before, {self.rss_mib_peak:.0f} MiB peak"
        )


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (Linux /proc), MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * 4096
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total / (1 << 20)


def run_storm(
    url: str, pid: int, api_key: str | None, leave_after_s: float = 2.0, chats_for_s: float = 40.0
) -> StormReport:
    """HOSTILE_PER_STORM heavy compiles at once (every other client leaving after `leave_after_s`), a normal chat
    every CHAT_EVERY_S for `chats_for_s` seconds meanwhile; memory sampled throughout."""
    report = StormReport(rss_mib_before=tree_rss_mib(pid))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            report.rss_mib_peak = max(report.rss_mib_peak, tree_rss_mib(pid))

    def hostile(i: int, path: str, body: dict[str, Any]) -> None:
        leaves = i % 2 == 1
        try:
            r = httpx.post(url + path, json=body, headers=headers, timeout=leave_after_s if leaves else 300)
            reason = _limit_named(r.text) if r.status_code == 400 else ""
            report.hostile[f"{r.status_code} {reason}".strip()] += 1
        except httpx.TimeoutException:
            report.hostile["left"] += 1

    requests = hostile_requests()
    threads = [threading.Thread(target=sample, daemon=True)]
    threads += [
        threading.Thread(target=hostile, args=(i, *requests[i % len(requests)])) for i in range(HOSTILE_PER_STORM)
    ]
    for t in threads:
        t.start()
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    end = time.monotonic() + chats_for_s
    with httpx.Client(headers=headers, timeout=120) as client:
        while time.monotonic() < end:
            started = time.monotonic()
            r = client.post(url + "/v1/chat/completions", json=chat)
            report.chat_status[r.status_code] += 1
            report.chat_latency_s.append(time.monotonic() - started)
            time.sleep(max(0.0, CHAT_EVERY_S - (time.monotonic() - started)))
    for t in threads[1:]:
        t.join()
    done.set()
    return report


def _limit_named(text: str) -> str:
    """Which limit a 400 names (or its message's start)."""
    try:
        body = json.loads(text)
        message = (body.get("error") or {}).get("message", "")
    except (ValueError, AttributeError):
        return text[:60]
    for flag in ("--grammar-timeout", "--grammar-max-memory", "--grammar-max-size"):
        if flag in message:
            return flag
    return message[:60]
