"""The `mtpserve` command line: one subcommand per job, llama.cpp's flag names where they exist."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..engine.errors import EngineError
from ..gguf import GGUFError
from . import bench, doctor, fetch_defaults, generate, inspect_model, perplexity, pull, quantize, serve, tokenize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtpserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_model.add_parser(subparsers)
    fetch_defaults.add_parser(subparsers)
    pull.add_parser(subparsers)
    tokenize.add_parser(subparsers)
    generate.add_parser(subparsers)
    perplexity.add_parser(subparsers)
    serve.add_parser(subparsers)
    quantize.add_parser(subparsers)
    bench.add_parser(subparsers)
    doctor.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (GGUFError, EngineError, FileNotFoundError, ValueError) as e:
        # User-facing failures (bad file, missing model, bad option): one line, no traceback.
        print(f"mtpserve {args.command}: error: {e}", file=sys.stderr)
        return 1
