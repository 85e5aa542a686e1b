"""Arguments several subcommands share, with llama.cpp's names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..models.base import CausalLM
from ..models.loader import load
from ..tokenizer import Tokenizer


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded default model)")


def model_path(args: argparse.Namespace) -> Path:
    from ..default_models import default_model_path

    return Path(args.model) if args.model else default_model_path()


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")


def apply_threads(threads: int) -> None:
    torch.set_num_threads(threads if threads > 0 else (os.cpu_count() or 1))


def load_model(args: argparse.Namespace) -> tuple[CausalLM, Tokenizer]:
    """Threads set, then the model of `-m` (or the default) and its tokenizer."""
    apply_threads(args.threads)
    path = model_path(args)
    return load(path), Tokenizer.from_gguf(path)
