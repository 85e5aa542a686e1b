"""Speculative decoding speed: decode tokens/s with and without draft-mtp (n_max 1..4 and auto) on
tinyqwen35 Q4_K_M, mtpserve and llama.cpp's llama-server side by side in one run, as speed-up ratios.

    .venv/bin/python bench/speculative.py [--llama-server PATH | --peer-url URL [--peer-n-max N]] [--rounds 7]

Both engines are measured the same way: as HTTP servers (`mtpserve serve`, `llama-server`, each with
`-t 2 -c 4096 -np 1`, plus `--spec-type draft-mtp --spec-draft-n-max N`), each sent the fixtures' speed
request: a 256-token greedy /completion (ignore_eos, cache_prompt false) of the first 900 characters of
`class NormalDist:` in Python's statistics.py, decode speed read from the answer's
`timings.predicted_per_second`.

The machine is noisy (a shared 2-core VM drifts by +-30 % over minutes), so a speed-up is measured in
rounds: for each configuration all servers run at the same time (mtpserve and llama-server, each with
and without speculation; idle but for the request at hand), one round sends the request to each in turn
(the order rotated every round), each round gives each engine one ratio of its speeds with and without
speculation, and the table reports the median ratio over the rounds and its range. With `--peer-url` one
running llama-server is measured as it was started (its n_max given by --peer-n-max), against a no-speculation
llama-server this script cannot start, so only its speed is shown; without a peer, the llama-server numbers recorded in
../shared/fixtures (no speculation and n_max 2) stand in.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from mtpserve.tokenizer import Tokenizer
from mtpserve.tuning.runner import managed_server

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
MODEL = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"
N_PREDICT = 256
CONFIGS = [(f"draft-mtp n_max={n}", str(n)) for n in (1, 2, 3, 4)] + [("draft-mtp auto", "auto")]


def speed_prompt(tokenizer: Tokenizer) -> list[int]:
    source = inspect.getsource(statistics)
    start = source.index("class NormalDist:")
    return tokenizer.encode(source[start : start + 900])


def completion(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as response:
        return json.loads(response.read())["timings"]


def mtpserve_cmd(n_max: str | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "mtpserve",
        "serve",
        "-m",
        str(MODEL),
        "-t",
        "2",
        "-c",
        "4096",
        "-np",
        "1",
        "--no-webui",
        "--no-warmup",
        "-lv",
        "1",
    ]
    return cmd + (["--spec-type", "draft-mtp", "--spec-draft-n-max", n_max] if n_max else [])


def llama_cmd(binary: str, n_max: str | None) -> list[str]:
    cmd = [binary, "-m", str(MODEL), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1", "--no-webui"]
    return cmd + (["--spec-type", "draft-mtp", "--spec-draft-n-max", n_max] if n_max else [])


def measure_rounds(urls: dict[str, str], prompt: list[int], rounds: int) -> dict[str, list[dict]]:
    """The same request to every server in turn, `rounds` times, the order rotated each round."""
    for url in urls.values():
        completion(url, prompt)  # warm-up
    names = list(urls)
    out: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            out[name].append(completion(urls[name], prompt))
    return out


def speedup(base: list[dict], spec: list[dict]) -> dict:
    """Per-round ratios of decode speed, with and without speculation; the median is reported."""
    tps = lambda runs: [t["predicted_per_second"] for t in runs]  # noqa: E731
    ratios = [s / b for s, b in zip(tps(spec), tps(base))]
    return {
        "speedup": statistics.median(ratios),
        "base": statistics.median(tps(base)),
        "spec": statistics.median(tps(spec)),
        "draft_n": spec[-1].get("draft_n", 0),
        "accepted": spec[-1].get("draft_n_accepted", 0),
        "spread": (min(ratios), max(ratios)),
    }


def recorded(n_max: str) -> dict | None:
    speed = json.loads((FIXTURES / "refs" / f"{MODEL.stem}.json").read_text())["llama_cpp_speed"]["server_greedy_256"]
    if n_max != "2":
        return None
    tps = lambda key: statistics.mean(r["timings"]["predicted_per_second"] for r in speed[key]["runs"])  # noqa: E731
    timings = speed["draft_mtp_n_max_2"]["runs"][-1]["timings"]
    return {
        "speedup": tps("draft_mtp_n_max_2") / tps("no_spec"),
        "base": tps("no_spec"),
        "spec": tps("draft_mtp_n_max_2"),
        "draft_n": timings["draft_n"],
        "accepted": timings["draft_n_accepted"],
        "spread": None,
    }


def cell(result: dict | None) -> str:
    if result is None:
        return f"{'-':>8} {'':>13} {'':>10}"
    spread = f"{result['spread'][0]:.2f}-{result['spread'][1]:.2f}" if result["spread"] else "recorded"
    speeds = f"{result['spec']:6.0f}/{result['base']:<6.0f}"
    return f"{result['speedup']:7.2f}x {speeds} {result['accepted']:4d}/{result['draft_n']:<5d} {spread:>9}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", help="a llama-server binary, started for every configuration")
    ap.add_argument("--peer-url", help="a running llama-server, measured as it is")
    ap.add_argument("--peer-n-max", default="2", help="the --spec-draft-n-max the --peer-url server runs with")
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds per configuration (median reported)")
    args = ap.parse_args()
    prompt = speed_prompt(Tokenizer.from_gguf(MODEL))
    peer_name = args.llama_server or args.peer_url or "llama-server numbers recorded in ../shared/fixtures"
    print(
        f"{MODEL.name}, {len(prompt)}-token prompt, {N_PREDICT} greedy tokens, 2 threads, {args.rounds} paired rounds; "
        f"peer: {peer_name}\n"
    )
    head = f"{'speed-up':>8} {'spec/base t/s':>13} {'accepted':>10} {'range':>9}"
    print(f"{'configuration':20} | {'mtpserve':^44} | {'llama.cpp':^44} | ours >= peer")
    print(f"{'':20} | {head} | {head} |")
    with ExitStack() as servers:  # managed_server: the process on a free port, up once /health says so
        bases = {"ours_base": servers.enter_context(managed_server(mtpserve_cmd(None)))}
        if args.llama_server:
            bases["peer_base"] = servers.enter_context(managed_server(llama_cmd(args.llama_server, None)))
        for name, n_max in CONFIGS:
            with ExitStack() as config_servers:
                urls = dict(bases)
                urls["ours_spec"] = config_servers.enter_context(managed_server(mtpserve_cmd(n_max)))
                if args.llama_server and n_max != "auto":  # llama.cpp has no automatic length
                    urls["peer_spec"] = config_servers.enter_context(
                        managed_server(llama_cmd(args.llama_server, n_max))
                    )
                else:
                    urls.pop("peer_base", None)
                runs = measure_rounds(urls, prompt, args.rounds)
            ours = speedup(runs["ours_base"], runs["ours_spec"])
            peer = speedup(runs["peer_base"], runs["peer_spec"]) if "peer_spec" in runs else None
            if args.peer_url and n_max == args.peer_n_max:
                completion(args.peer_url, prompt)
                timings = [completion(args.peer_url, prompt) for _ in range(args.rounds)]
                tps = statistics.median(t["predicted_per_second"] for t in timings)
                peer = {
                    "speedup": float("nan"),
                    "base": float("nan"),
                    "spec": tps,
                    "draft_n": timings[-1].get("draft_n", 0),
                    "accepted": timings[-1].get("draft_n_accepted", 0),
                    "spread": None,
                }
            elif not args.llama_server and not args.peer_url:
                peer = recorded(n_max)
            comparable = peer is not None and peer["speedup"] == peer["speedup"]
            verdict = ("yes" if ours["speedup"] >= peer["speedup"] else "no") if comparable else ""
            print(f"{name:20} | {cell(ours)} | {cell(peer)} | {verdict}", flush=True)


if __name__ == "__main__":
    main()
