"""Hostile grammars against `mtpserve serve` (issue 36's acceptance): 10 heavy compiles at once, half of their
clients leaving, while a normal chat is sent every half second; then 10 more, and SIGTERM while they compile.

    .venv/bin/python bench/hostile_grammars.py [-m MODEL] [--rounds 2]

Prints, per round: the hostile requests' outcomes, the normal chats' statuses and latency (p50, max), the peak
resident memory of the server and its grammar workers against the stated bound (the server before the storm, plus
--grammar-workers x (--grammar-max-memory + a worker's start-up size)), and the seconds from SIGTERM to exit.
Exits 1 when a normal chat failed or took over 5 s, the memory went past the bound, or the exit took over 10 s.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from mtpserve.engine.config import GrammarLimits
from mtpserve.tuning.hostile_grammars import HOSTILE_PER_STORM, hostile_requests, run_storm
from mtpserve.tuning.runner import free_port

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
WORKER_START_MIB = 400  # a worker before it compiles: python, torch, xgrammar and the vocabulary (~330 MiB here)
CHAT_BOUND_S, EXIT_BOUND_S = 5.0, 10.0


def start(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mtpserve", "serve", "-m", str(model), "-np", "2", "-t", "2", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not start (log: {log})")


def exit_time(proc: subprocess.Popen, url: str) -> float:
    """Start HOSTILE_PER_STORM heavy compiles, SIGTERM the server while they run, and time its exit."""
    requests = hostile_requests()
    for i in range(HOSTILE_PER_STORM):
        path, body = requests[i % len(requests)]
        threading.Thread(target=_post_quietly, args=(url + path, body), daemon=True).start()
    time.sleep(3.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return float("inf")
    return time.monotonic() - started


def _post_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(url, json=body, timeout=120)
    except httpx.HTTPError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=FIXTURE)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    limits, failed = GrammarLimits(), False
    for n in range(1, args.rounds + 1):
        log = Path(tempfile.mkdtemp()) / "server.log"
        proc, url = start(args.model, log)
        report = run_storm(url, proc.pid, None)
        bound = report.rss_mib_before + limits.workers * ((limits.max_memory >> 20) + WORKER_START_MIB)
        seconds = exit_time(proc, url)
        print(f"round {n}\n{report.text()}\nmemory bound {bound:.0f} MiB\nSIGTERM to exit: {seconds:.1f} s")
        print(f"(server log: {log})\n", flush=True)
        failed |= set(report.chat_status) != {200} or report.chat_max_s > CHAT_BOUND_S
        failed |= report.rss_mib_peak > bound or seconds > EXIT_BOUND_S or proc.returncode != 0
    print("hostile grammars: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
