"""The `mtpserve` command line: one subcommand per job, llama.cpp's flag names where they exist."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..omp_policy import prefer_passive_waits

prefer_passive_waits()  # before any command imports torch

from .. import __version__  # noqa: E402
from ..engine.errors import EngineError  # noqa: E402
from ..gguf import GGUFError  # noqa: E402

# command -> its module, in `--help` order; a command line imports only its own (PyTorch, the server, Ray where used)
COMMANDS = {
    "inspect": "inspect_model",
    "fetch-defaults": "fetch_defaults",
    "pull": "pull",
    "tokenize": "tokenize",
    "generate": "generate",
    "perplexity": "perplexity",
    "serve": "serve",
    "quantize": "quantize",
    "bench": "bench",
    "doctor": "doctor",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with `command` (one of COMMANDS) of that one alone."""
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtpserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(f".{module}", __name__).add_parser(subparsers)
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
    argv = llama_flag_names(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (GGUFError, EngineError, FileNotFoundError, ValueError) as e:
        # User-facing failures (bad file, missing model, bad option): one line, no traceback.
        print(f"mtpserve {args.command}: error: {e}", file=sys.stderr)
        return 1
