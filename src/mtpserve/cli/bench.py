"""`mtpserve bench`: send a workload to an OpenAI-compatible server (running at `--url`, or started here
per configuration from `-m MODEL` and server flags) and report what the deployment guide reads off by
hand: per request prompt and decode tokens/s, draft acceptance, time to first token and tokens per
verification step, then the sums; with `--sweep` a row per configuration; Markdown, JSON and PNG plots
in `--out`.

    mtpserve bench --url http://127.0.0.1:8000 --api-key KEY
    mtpserve bench -m model.gguf --server-args "--spec-type draft-mtp -c 8192" \\
        --sweep spec-draft-n-max=0,1,2,3 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from ..tuning import report
from ..tuning.runner import Target, mtpserve_command, parse_sweep, run_experiment, shown_command
from ..tuning.workload import Workload


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmark a server: speed, acceptance, sweeps over flags, plots")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running OpenAI-compatible server (mtpserve or llama-server)")
    where.add_argument("-m", "--model", help="start `mtpserve serve -m MODEL` for each configuration")
    p.add_argument(
        "--server-args", default="", help='flags for the started server, e.g. "--spec-type draft-mtp -c 8192"'
    )
    p.add_argument("--server-bin", help="start this binary (e.g. llama-server) instead of `mtpserve serve`")
    p.add_argument("--api-key", help="API key for --url (and --peer-url)")
    p.add_argument("--model-name", help="the `model` field to send (default: none)")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="FLAG=V1,V2",
        help="server flag values to try (restarts the server), or enable_thinking=true,false; repeatable",
    )
    p.add_argument("--peer-url", help="a second server given the same requests, interleaved; reported as ratios")
    p.add_argument("-n", "--requests", type=int, default=4, help="requests from the prompt set (default 4, cycled)")
    p.add_argument("--prompts", help="a JSON file with a list of prompts (strings)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None, help="sent with each request (default: the server's)")
    p.add_argument("--top-p", type=float, default=None, help="sent with each request (default: the server's)")
    p.add_argument("--depths", default="", help="extra requests with this much filler context, e.g. 1024,4096")
    p.add_argument("--rounds", type=int, default=1, help="repeat everything, configurations interleaved; medians")
    p.add_argument("--out", default="bench-results", help="folder for bench.md, bench.json and the PNGs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    workload = Workload(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if prompts is not None:
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
            raise ValueError(f"{args.prompts}: expected a JSON list of prompt strings")
        workload.prompts = prompts
    workload.prompts = [workload.prompts[i % len(workload.prompts)] for i in range(args.requests)]
    workload.depths = [int(d) for d in args.depths.split(",") if d.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.server_args)
    command = (
        ([args.server_bin, "-m", args.model, *extra] if args.server_bin else mtpserve_command(args.model, extra))
        if args.model
        else []
    )
    target = Target(url=args.url, command=command, api_key=args.api_key, model=args.model_name, log_dir=out)
    points = parse_sweep(args.sweep)
    experiment = run_experiment(
        target,
        points,
        workload,
        args.rounds,
        args.peer_url,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    title = Path(args.model).name if args.model else args.url
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "target": args.url or shown_command(command),
        "peer": args.peer_url,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "sweep": args.sweep,
    }
    text, files = report.write(experiment, out, meta, title)
    print(text)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
