"""The tuning experiment: configurations (points of a `--sweep` over server flags), each served by a
server started for it (or one running server at `--url`), the workload sent to each, optionally the same
workload to a peer server (`--peer-url`) request by request in the same run.

Machines are noisy, so with `--rounds R` every configuration runs R times, the configurations
interleaved (round 1: A B C, round 2: B C A, ...), and the report takes medians; ratios are taken
against the first configuration, and against the peer within the same round.

Sweep keys are server flags (`spec-draft-n-max=0,1,2` -> `--spec-draft-n-max 0`), except the request-side
keys in REQUEST_KEYS (`enable_thinking=true,false` goes into `chat_template_kwargs`, no restart).
"""

from __future__ import annotations

import itertools
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from .workload import RequestResult, Workload, run_request

REQUEST_KEYS = {"enable_thinking"}
START_TIMEOUT = 900.0  # seconds: a 27B model reads 17 GB before /health says ok


@dataclass(frozen=True)
class Point:
    """One configuration: server flags and request-side settings."""

    flags: tuple[tuple[str, str], ...] = ()
    request: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        parts = [f"{k}={v}" for k, v in self.flags] + [f"{k}={json.dumps(v)}" for k, v in self.request]
        return " ".join(parts) or "as started"

    def server_args(self) -> list[str]:
        return [a for k, v in self.flags for a in (f"--{k}", v)]


def parse_sweep(specs: list[str]) -> list[Point]:
    """`key=v1,v2` specs -> their Cartesian product (the first value of each first)."""
    axes: list[list[tuple[str, str]]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key or not values:
            raise ValueError(f"--sweep takes KEY=V1,V2,... (a server flag without its dashes), not '{spec}'")
        axes.append([(key, v.strip()) for v in values.split(",")])
    points = []
    for combo in itertools.product(*axes) if axes else [()]:
        flags = tuple((k, v) for k, v in combo if k not in REQUEST_KEYS)
        request = tuple((k, _json_value(v)) for k, v in combo if k in REQUEST_KEYS)
        points.append(Point(flags, request))
    return points


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def managed_server(
    command: list[str], log_path: Path | None = None, info: dict[str, Any] | None = None
) -> Iterator[str]:
    """Start `command --host 127.0.0.1 --port P`, wait for /health, yield its URL, stop it. `info`, if
    given, receives the process id as info["pid"]."""
    port = free_port()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    if info is not None:
        info["pid"] = proc.pid
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {proc.returncode}: {' '.join(command)}"
                    + (f" (log: {log_path})" if log_path else "")
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not become ready in {START_TIMEOUT:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]


@dataclass
class Run:
    """Everything measured: per configuration, per round, every request (and the peer's, if any)."""

    points: list[Point]
    rounds: list[dict[str, list[RequestResult]]] = field(default_factory=list)  # point name -> results
    peer_rounds: list[dict[str, list[RequestResult]]] = field(default_factory=list)


@dataclass
class Target:
    """Where the workload goes: a running server, or a command to start one per configuration."""

    url: str | None = None
    command: list[str] = field(default_factory=list)  # e.g. [python, -m, mtpserve, serve, -m, MODEL, ...]
    api_key: str | None = None
    model: str | None = None
    log_dir: Path | None = None


def mtpserve_command(model: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mtpserve", "serve", "-m", model, "--no-webui", "--metrics", *extra]


def shown_command(command: list[str]) -> str:
    """A server command as a reader types it, for reports kept in the repository: `mtpserve ...` for our own, the
    binary's name for a peer's, no path of the machine that ran it."""
    if command[:3] == [sys.executable, "-m", "mtpserve"]:
        command = ["mtpserve", *command[3:]]
    elif command:
        command = [Path(command[0]).name, *command[1:]]
    return shlex.join(command)


def run_experiment(
    target: Target,
    points: list[Point],
    workload: Workload,
    rounds: int = 1,
    peer_url: str | None = None,
    progress: Callable[[str], None] = print,
) -> Run:
    if target.url and any(p.flags for p in points):
        raise ValueError("--sweep over server flags needs a server to restart: give -m MODEL instead of --url")
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    run = Run(points)
    requests = workload.requests()
    total = rounds * len(points) * len(requests)
    done = 0
    with httpx.Client(headers=headers, timeout=httpx.Timeout(3600, connect=10)) as client:
        for r in range(rounds):
            order = points[r % len(points) :] + points[: r % len(points)]  # interleaved across rounds
            ours: dict[str, list[RequestResult]] = {}
            theirs: dict[str, list[RequestResult]] = {}
            for point in order:
                point_workload = replace(
                    workload, chat_template_kwargs={**workload.chat_template_kwargs, **dict(point.request)}
                )
                with _serving(target, point, r) as url:
                    ours[point.name], theirs[point.name] = [], []
                    for i, (label, depth, messages) in enumerate(requests):
                        pair = [(url, ours[point.name], target.model)]
                        if peer_url:
                            pair.append((peer_url, theirs[point.name], None))
                            if i % 2:
                                pair.reverse()  # alternate who goes first
                        for server_url, out, model in pair:
                            out.append(run_request(client, server_url, messages, point_workload, label, depth, model))
                        done += 1
                        last = ours[point.name][-1]
                        status = f"{last.predicted_per_second:7.1f} t/s" if last.ok else f"failed: {last.error[:80]}"
                        progress(f"[{done}/{total}] round {r + 1} | {point.name} | {label}: {status}")
            run.rounds.append(ours)
            if peer_url:
                run.peer_rounds.append(theirs)
    return run


@contextmanager
def _serving(target: Target, point: Point, round_index: int) -> Iterator[str]:
    if target.url:
        yield target.url.rstrip("/")
        return
    log = None
    if target.log_dir:
        safe = "".join(c if c.isalnum() else "_" for c in point.name)[:80]
        log = target.log_dir / f"server-{safe}-round{round_index + 1}.log"
    with managed_server([*target.command, *point.server_args()], log) as url:
        yield url
