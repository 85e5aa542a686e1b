"""Soak: the CI load test (tests/server/test_load.py) for as long as you like, against a server this script
starts (`-m MODEL`, default the default model) or one already running (`--url`).

    .venv/bin/python bench/soak.py --duration 3600 [--every 300] [--clients 64] [--parallel 4] \\
        [-m MODEL | --url URL --api-key K]

Runs the load in periods of `--every` seconds and prints the load report after each (requests started
and completed by client kind, errors by kind, p50/p99 latency, the server's memory before and after,
whether every slot is idle at the end); exits 1 if anything failed, a slot stayed busy, or the server's
memory grew more than --rss-bound-mib over the whole soak.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtpserve.tuning.load import rss_kib, run_load
from mtpserve.tuning.runner import managed_server, mtpserve_command


def soak(url: str, pid: int | None, args: argparse.Namespace) -> int:
    start = rss_kib(pid) if pid else None
    reports, failed, left = [], False, args.duration
    while left > 0:
        period = min(args.every, left)
        report = run_load(url, period, args.clients, args.api_key, args.max_tokens, server_pid=pid)
        left -= period
        reports.append(report.as_dict())
        print(report.text(), flush=True)
        failed |= report.error_count > 0 or report.slots_idle_at_end is False
    end = rss_kib(pid) if pid else None
    if start is not None and end is not None:
        growth = (end - start) / 1024
        print(
            f"soak: server memory {start / 1024:.0f} -> {end / 1024:.0f} MiB "
            f"({growth:+.0f} MiB, bound {args.rss_bound_mib:.0f})"
        )
        failed |= growth > args.rss_bound_mib
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    print("soak: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load in all (default 600)")
    ap.add_argument("--every", type=float, default=300, help="seconds per report period (default 300)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=4, help="slots of the started server")
    ap.add_argument("-m", "--model", help="GGUF for the started server (default: the default model)")
    ap.add_argument("--url", help="a running server instead (its memory is then not measured)")
    ap.add_argument("--api-key")
    ap.add_argument("--rss-bound-mib", type=float, default=512, help="allowed growth of the server's memory")
    ap.add_argument("--json", help="also write the reports here")
    args = ap.parse_args()
    if args.url:
        return soak(args.url, None, args)
    from mtpserve.default_models import default_model_path

    model = args.model or str(default_model_path())
    command = mtpserve_command(model, ["-np", str(args.parallel), "-c", str(2048 * args.parallel)])
    if args.api_key:
        command += ["--api-key", args.api_key]
    info: dict = {}
    with managed_server(command, info=info) as url:
        return soak(url, info["pid"], args)


if __name__ == "__main__":
    sys.exit(main())
