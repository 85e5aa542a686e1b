"""Replicas on Ray Serve: throughput against the replica count, and each router's prompt-cache hit rate on a
multi-turn workload, in one run on a local Ray (this machine's CPUs).

    .venv/bin/python bench/cluster.py [--replicas 1,2] [--routers prefix,pow2,session] [--threads 1]
                                      [--requests 16] [--sessions 8] [--turns 4] [--json out.json]

* **Throughput**: `--requests` greedy completions of 128 tokens always in flight (that many clients, each sending
  its next request when answered, for 8 s) on N replicas of tinyqwen35 with 4 slots and `--threads` threads each;
  generated tokens/s, and the ratio to one replica.
* **Hit rate**: 2 replicas x 4 slots; `--sessions` conversations run at once, each `--turns` turns one after another:
  a shared opening line, then the session's own ~300-token document and a question; each later turn is the previous
  prompt, its completion and a new question (`/v1/completions`, so the next prompt extends the last one exactly,
  and each session sends `x-session-id`), after a pause of 0.1-0.6 s (the client reading and writing). The hit rate
  is the sum of `cache_n` over the sum of `cache_n + prompt_n` for the turns after the first; a session "stays" when
  each of its later turns found all of its previous prompt cached (the replica that served it before served it
  again).

Each configuration is a fresh application on the same Ray; requests go through Serve's HTTP proxy, as a client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from mtpserve.cluster.app import ClusterOptions, application  # noqa: E402
from mtpserve.engine import EngineConfig  # noqa: E402
from mtpserve.server.state import ServerSettings  # noqa: E402
from mtpserve.tuning.runner import free_port  # noqa: E402

MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
SLOTS = 4
N_TOKENS = 128  # per throughput request
APP = "bench"
OPENING = "Answer questions about the document below.\n"  # shared by every session; short (see docs/cluster.md)
WORDS = "river stone lantern copper meadow signal harbor ledger violet engine quartz willow canyon orbit".split()


def deploy(url: str, replicas: int, router: str, threads: int) -> None:
    settings = ServerSettings(
        model=MODEL, engine=EngineConfig(n_parallel=SLOTS, ctx_size=SLOTS * 4096), warm_page_cache=False, max_queue=0
    )
    options = ClusterOptions(replicas=replicas, replica_cpus=1, router=router, threads=threads, app_name=APP)
    serve.run(application(settings, options), name=APP, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            slots = httpx.get(url + "/slots", timeout=5)
            if slots.status_code == 200 and len(slots.json()) == replicas * SLOTS:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{replicas} replicas did not come up")


def throughput(url: str, n_requests: int, seconds: float = 8.0) -> float:
    """Generated tokens per second with n_requests requests always in flight: that many clients, each sending its
    next greedy completion as soon as the last one is answered, for `seconds` (steady state: no tail of a last
    wave). One asyncio client: its own CPU comes out of the same cores as the replicas'."""

    async def run() -> float:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n_requests)) as client:
            t0 = time.perf_counter()

            async def worker(i: int) -> int:
                tokens, k = 0, 0
                while time.perf_counter() - t0 < seconds:
                    body = {"prompt": f"Story {i}.{k}: once upon a time", "max_tokens": N_TOKENS, "temperature": 0}
                    reply = await client.post(url + "/v1/completions", json={**body, "ignore_eos": True})
                    tokens, k = tokens + reply.json()["usage"]["completion_tokens"], k + 1
                return tokens

            done = await asyncio.gather(*(worker(i) for i in range(n_requests)))
            return sum(done) / (time.perf_counter() - t0)

    return asyncio.run(run())


def document(session: int, n_words: int = 220) -> str:
    rng = random.Random(session)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n_words))


def conversations(url: str, n_sessions: int, n_turns: int) -> dict:
    """Run the sessions at once; per session the (cache_n, prompt_n) of each turn."""
    turns: dict[int, list[tuple[int, int]]] = {}

    def session(s: int) -> None:
        prompt, record, pause = OPENING + document(s) + "\n", [], random.Random(1000 + s)
        for turn in range(n_turns):
            time.sleep(pause.uniform(0.1, 0.6))  # the client reads the answer and writes the next question
            prompt += f"Question {turn + 1}: what does the document say about item {turn}?\nAnswer:"
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            reply = httpx.post(url + "/v1/completions", json=body, headers={"x-session-id": f"s{s}"}, timeout=300)
            out = reply.json()
            prompt += out["choices"][0]["text"] + "\n"
            record.append((out["timings"]["cache_n"], out["timings"]["prompt_n"]))
        turns[s] = record

    threads = [threading.Thread(target=session, args=(s,)) for s in range(n_sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    later = [t for record in turns.values() for t in record[1:]]
    stayed = sum(all(cache >= sum(record[i]) for i, (cache, _) in enumerate(record[1:])) for record in turns.values())
    return {
        "hit_rate": sum(c for c, _ in later) / max(1, sum(c + p for c, p in later)),
        "sessions_stayed": stayed,
        "sessions": n_sessions,
        "turns": {s: turns[s] for s in sorted(turns)},  # (cache_n, prompt_n) per turn
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2", help="replica counts for the throughput test")
    ap.add_argument("--routers", default="prefix,pow2,session")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="repetitions of each throughput measurement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    ray.init(num_cpus=max(*counts, 2), include_dashboard=False, log_to_driver=False)  # the hit-rate test: 2
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results: dict = {"throughput": {}, "routers": {}}
    try:
        each = f"{N_TOKENS} tokens each, {args.threads} thread(s) a replica"
        print(f"throughput: {args.requests} requests in flight, {each}")
        rounds: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.rounds):  # the counts alternate round by round: the machine's drift falls on all alike
            for n in counts:
                deploy(url, n, "prefix", args.threads)
                throughput(url, 4, seconds=2)  # warm-up
                rounds[n].append(throughput(url, args.requests))
                serve.delete(APP)
        base = statistics.mean(rounds[counts[0]])
        for n in counts:
            rate, spread = statistics.mean(rounds[n]), f"{min(rounds[n]):.0f}-{max(rounds[n]):.0f}"
            results["throughput"][n], results.setdefault("throughput_rounds", {})[n] = rate, rounds[n]
            print(f"  {n} replica(s): {rate:7.1f} tok/s ({spread}), {rate / base:.2f}x")
        print(f"hit rate: {args.sessions} sessions x {args.turns} turns at once, 2 replicas x {SLOTS} slots")
        for router in [r for r in args.routers.split(",") if r]:
            deploy(url, 2, router, args.threads)
            r = results["routers"][router] = conversations(url, args.sessions, args.turns)
            stayed = f"{r['sessions_stayed']}/{r['sessions']}"
            print(f"  {router:8} hit rate {r['hit_rate']:.2f}, sessions on one replica {stayed}")
            serve.delete(APP)
        if "prefix" in results["routers"] and "pow2" in results["routers"]:
            ratio = results["routers"]["prefix"]["hit_rate"] / max(1e-9, results["routers"]["pow2"]["hit_rate"])
            print(f"  prefix / pow2 hit rate: {ratio:.2f}x")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
