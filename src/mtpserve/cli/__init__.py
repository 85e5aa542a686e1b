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


def llama_flag_names(argv: list[str]) -> list[str]:
    """llama.cpp's parser reads `--flag_name` as `--flag-name` (its test suite passes `--backend_sampling`);
    the same here for `serve`. Only a word that starts with `--` is a flag name: values are left alone."""
    if not argv or argv[0] != "serve":
        return argv
    out = []
    for word in argv:
        if word.startswith("--") and "_" in word.split("=", 1)[0]:
            name, sep, value = word.partition("=")
            word = name.replace("_", "-") + sep + value
        out.append(word)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(llama_flag_names(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (GGUFError, EngineError, FileNotFoundError, ValueError) as e:
        # User-facing failures (bad file, missing model, bad option): one line, no traceback.
        print(f"mtpserve {args.command}: error: {e}", file=sys.stderr)
        return 1
