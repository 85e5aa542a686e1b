"""The deployment's size: the 27B-shaped file (bench/make_qwen35_27b.py) served by mtpserve and by llama-server with
the deployment's flags, one server after the other in one run: time to /health, peak RSS, and the prompt and decode
speeds of a chat request from `timings` (with draft counts): the first answer's time from the start, then a second
request's speeds, once the weights are in memory.

    .venv/bin/python bench/scale.py --llama-server PATH [--model FILE] [--configs deployment,no-spec,32k]
                                    [--n-predict 8] [--json PATH] [--variant '--no-mmap' ...]

Configurations (each adds `-np 1 -fa on --alias qwopus --api-key k -t 2`):
* deployment: `-c 262144 -ctk q8_0 -ctv q8_0 --spec-type draft-mtp --spec-draft-n-max 2` (the deployment's line);
* no-spec: the same without speculative decoding;
* 32k: the deployment's line with `-c 32768`.

`--variant FLAGS` measures mtpserve once more with FLAGS added (e.g. `--no-mmap`), after its plain run.

One server at a time (two would share the machine's memory and page cache, each evicting the other's weights), the
page cache dropped of the file between them where the machine allows it (root: /proc/sys/vm/drop_caches), so each
reads the file from disk as a fresh start does. Peak memory is sampled every 0.2 s from /proc: VmRSS (the file's
cached pages the server maps included) and RssAnon (its own memory, which the kernel cannot drop without swap). The
request: a short chat (n_predict tokens, greedy, `ignore_eos`); on a CPU machine that reads a 16 GB model from a 24
GB host, decode measures paging as much as arithmetic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from mtpserve.tuning.runner import managed_server, mtpserve_command
from mtpserve.tuning.synthetic import default_path

COMMON = ["-np", "1", "-fa", "on", "--alias", "qwopus", "--api-key", "k", "-t", "2"]
DEPLOYMENT = ["-c", "262144", "-ctk", "q8_0", "-ctv", "q8_0", "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]
CONFIGS = {
    "deployment": DEPLOYMENT,
    "no-spec": DEPLOYMENT[:6],
    "32k": ["-c", "32768", *DEPLOYMENT[2:]],
}
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


class MemorySampler:
    """The server's peak resident memory, sampled every 0.2 s: all of it (VmRSS, the file's cached pages it maps
    included) and its own (RssAnon: what the kernel cannot drop without swap)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, {"VmRSS": 0, "RssAnon": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                lines = Path(f"/proc/{self.pid}/status").read_text().splitlines()
            except OSError:
                return
            for line in lines:
                key = line.split(":")[0]
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {key: value / 2**30 for key, value in self.peak.items()}


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def measure(name: str, command: list[str], n_predict: int, say) -> dict:
    dropped = drop_page_cache()
    info: dict = {}
    t0 = time.perf_counter()
    with managed_server(command, info=info) as url, httpx.Client(timeout=3600) as client:
        ready = time.perf_counter() - t0
        sampler = MemorySampler(info["pid"])
        say(f"  {name}: /health after {ready:.1f} s")
        body = {
            "model": "qwopus",
            "messages": MESSAGES,
            "max_tokens": n_predict,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        first_answer = 0.0
        for i in range(2):  # the first answer after the start, then the speeds once the weights are in
            response = client.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
            response.raise_for_status()
            timings = response.json().get("timings", {})
            first_answer = first_answer or time.perf_counter() - t0
            body["messages"] = [{"role": "user", "content": f"{MESSAGES[0]['content']} ({i + 1})"}]
        peak = sampler.stop()
    row = {
        "server": name,
        "health_s": ready,
        "first_answer_s": first_answer,
        "peak_rss_gib": peak["VmRSS"],
        "peak_anon_gib": peak["RssAnon"],
        "page_cache_dropped": dropped,
        "timings": timings,
    }
    say(
        f"  {name}: prompt {timings.get('prompt_per_second', 0):.2f} t/s, decode "
        f"{timings.get('predicted_per_second', 0):.2f} t/s, drafts {timings.get('draft_n_accepted', '-')}/"
        f"{timings.get('draft_n', '-')}, peak RSS {peak['VmRSS']:.2f} GiB (own {peak['RssAnon']:.2f} GiB), "
        f"first answer after {first_answer:.1f} s"
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", type=Path, default=default_path(64))
    ap.add_argument("--configs", default="deployment,no-spec,32k")
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--variant", action="append", default=[], help="mtpserve again with these flags (e.g. --no-mmap)")
    args = ap.parse_args()
    if not args.model.exists():
        sys.exit(f"{args.model} is missing: make it with bench/make_qwen35_27b.py")
    rows = []
    for config in args.configs.split(","):
        flags = [*COMMON, *CONFIGS[config]]
        print(f"{config}: {' '.join(flags)}", flush=True)
        variants = [(f"mtpserve {v}", mtpserve_command(str(args.model), [*flags, *v.split()])) for v in args.variant]
        for server, command in (
            ("mtpserve", mtpserve_command(str(args.model), flags)),
            *variants,
            ("llama-server", [args.llama_server, "-m", str(args.model), *flags]),
        ):
            row = measure(server, command, args.n_predict, lambda s: print(s, flush=True))
            rows.append({"config": config, **row})
    print(
        "\n| configuration | server | /health (s) | first answer (s) | peak RSS (GiB) | peak anonymous (GiB) "
        "| prompt t/s | decode t/s | drafts accepted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["timings"]
        drafts = f"{t['draft_n_accepted']}/{t['draft_n']}" if "draft_n" in t else "-"
        print(
            f"| {r['config']} | {r['server']} | {r['health_s']:.1f} | {r['first_answer_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['peak_anon_gib']:.2f} | "
            f"{t.get('prompt_per_second', 0):.2f} | {t.get('predicted_per_second', 0):.2f} | {drafts} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
