"""`mtpserve pull REPO[:QUANT] [FILE ...]`: download a GGUF model (or any files) from the Hugging Face Hub.

The model goes into the Hugging Face cache (or `--local-dir`), resumable, checked against the hub's size
and sha256; a split model comes whole and is reported by its first part. The local paths are printed last,
one a line, for scripts: `mtpserve serve -m "$(mtpserve pull unsloth/Qwen3-8B-GGUF:Q4_K_M)"`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import hub

EPILOG = """\
examples:
  mtpserve pull unsloth/Qwen3-8B-GGUF:Q4_K_M        the file (or split set) named Q4_K_M
  mtpserve pull org/repo model-00001-of-00003.gguf  all three parts
environment: HF_TOKEN (or `hf auth login`), HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE=1,
HF_XET_HIGH_PERFORMANCE=1 (faster Xet transfers), HF_HUB_DISABLE_XET=1 (plain HTTP, resumable across runs)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull",
        help="download a GGUF model from the Hugging Face Hub",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "repo",
        metavar="REPO[:QUANT]",
        help=f"Hub repository, with the quantization to pick (default {hub.DEFAULT_QUANT}, or the only model)",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="files of the repo to fetch instead of a quant")
    p.add_argument("--local-dir", type=Path, help="put the files in this folder instead of the cache")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--token", help="Hugging Face access token (default: HF_TOKEN or the saved login)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hub.quiet_library_logs()
    paths = hub.pull(args.repo, args.files, revision=args.revision, local_dir=args.local_dir, token=args.token)
    for path in paths:
        print(path)
    return 0
