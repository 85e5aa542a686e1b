"""Arguments several subcommands share, with llama.cpp's names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..engine.config import AUTO_N_MAX, DRAFT_HEADS, DRAFT_SAMPLINGS, SPEC_TYPES, SpecConfig
from ..models.base import CausalLM
from ..models.loader import load
from ..tokenizer import Tokenizer


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded default model)")


def model_path(args: argparse.Namespace) -> Path:
    from ..default_models import default_model_path

    return Path(args.model) if args.model else default_model_path()


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """llama-server's CPU flags: -t, --poll, --cpu-strict (docs/performance.md, "The thread pool")."""
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: the physical cores)")
    p.add_argument(
        "--poll", type=int, default=50, help="0-100: how long idle threads spin before sleeping (default 50: 0.5 ms)"
    )
    p.add_argument("--cpu-strict", type=int, choices=[0, 1], default=0, help="1: pin each thread to its own CPU")
    p.add_argument(
        "--repack", dest="repack", action="store_true", default=True,
        help="keep the weights' GEMM tiles once packed, up to 1 GiB (default: on)",
    )  # fmt: skip
    p.add_argument("-nr", "--no-repack", dest="repack", action="store_false", help="pack tiles on every call")


def apply_threads(args: argparse.Namespace) -> None:
    """Torch's and the kernels' thread counts from -t (default: physical cores, as llama.cpp), the pool's
    spinning and pinning from --poll and --cpu-strict, and the kept tiles' limit from --repack / --no-repack."""
    from ..kernels.cpu import KEPT_TILES_LIMIT, configure_pool, physical_cores, tile_limit

    threads = getattr(args, "threads", 0)
    torch.set_num_threads(threads if threads > 0 else physical_cores())
    configure_pool(getattr(args, "poll", 50), bool(getattr(args, "cpu_strict", 0)))
    tile_limit(KEPT_TILES_LIMIT if getattr(args, "repack", True) else 0)


def load_model(args: argparse.Namespace) -> tuple[CausalLM, Tokenizer]:
    """Threads set, then the model of `-m` (or the default) and its tokenizer."""
    apply_threads(args)
    path = model_path(args)
    return load(path), Tokenizer.from_gguf(path)


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """llama-server's recurrent-state checkpoint flags."""
    p.add_argument(
        "-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", type=int, default=32,
        help="recurrent-state checkpoints per slot (default 32)",
    )  # fmt: skip
    p.add_argument(
        "-cms", "--checkpoint-min-step", type=non_negative, default=0,
        help="tokens at least between checkpoints inside a prompt (default 0: spread over the prompt)",
    )  # fmt: skip


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, not {n}")
    return n


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields of the flags serve, generate and doctor share: context, KV cache types, recurrent
    checkpoints and speculative decoding."""
    return {
        "ctx_size": args.ctx_size,
        "cache_type_k": args.cache_type_k,
        "cache_type_v": args.cache_type_v,
        "ctx_checkpoints": args.ctx_checkpoints,
        "checkpoint_min_step": args.checkpoint_min_step,
        "spec": spec_config(args),
    }


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """llama-server's speculative-decoding flags."""
    p.add_argument("--spec-type", default="none", choices=SPEC_TYPES, help="drafter (default none)")
    p.add_argument("--spec-draft-n-max", default="3", help="draft tokens per step, or 'auto' (default 3)")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="drop drafts shorter than this")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop a draft below this top-10 probability")
    p.add_argument("-md", "--model-draft", help="draft-simple: a small GGUF with the same vocabulary")
    p.add_argument("--spec-draft-vocab", type=int, default=0, help="draft-mtp: draft only among the first N token ids")
    p.add_argument(
        "--spec-draft-sampling",
        default="probabilistic",
        choices=DRAFT_SAMPLINGS,
        help="draft-mtp/draft-simple at a temperature: a draw from the draft's chain kept by the ratio rule (default), "
        "or the draft's argmax kept where the target samples it (llama.cpp's rule)",
    )
    p.add_argument(
        "--spec-draft-head",
        default="auto",
        choices=DRAFT_HEADS,
        help="draft-mtp: score drafts with the output layer (full), or with a q4_0 copy's top 64 ranked by the "
        "output layer (q4_0; a draft drawn at a temperature draws over those 64 on a GPU); auto: q4_0 on a GPU where "
        "it reads a quarter fewer bytes",
    )


def spec_config(args: argparse.Namespace) -> SpecConfig:
    auto = args.spec_draft_n_max == "auto"
    try:
        n_max = AUTO_N_MAX if auto else int(args.spec_draft_n_max)
    except ValueError:
        raise ValueError(f"--spec-draft-n-max takes a number or 'auto', not '{args.spec_draft_n_max}'") from None
    return SpecConfig(
        args.spec_type,
        n_max=n_max,
        n_min=args.spec_draft_n_min,
        p_min=args.spec_draft_p_min,
        auto=auto,
        draft_model=args.model_draft,
        draft_vocab=args.spec_draft_vocab,
        draft_sampling=args.spec_draft_sampling,
        draft_head=args.spec_draft_head,
    )


def tensor_split(args: argparse.Namespace) -> tuple[float, ...] | None:
    """--tensor-split: the devices' shares ("1,1" or llama.cpp's "1/1"), None when not given."""
    return tuple(float(x) for x in args.tensor_split.replace("/", ",").split(",")) if args.tensor_split else None
