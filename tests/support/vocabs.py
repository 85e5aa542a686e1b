"""Tokenizers and llama.cpp reference files for the tokenizer, chat-template and reasoning tests, each
vocabulary loaded once per test session (Gemma's 262k tokens take a couple of seconds)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from mtpserve.tokenizer import Tokenizer

from ..conftest import TINYQWEN_QUANTS, default_model, shared_path, tinyqwen_path

VOCAB_VECTORS = ("qwen35", "qwen2", "llama-spm")
# Reference JSON name -> how to find its model file.
REF_MODELS = {
    **{f"tinyqwen35-mtp-{q}": ("tinyqwen", q) for q in TINYQWEN_QUANTS},
    "SmolLM2-135M-Instruct.Q4_1": ("default", "smollm2"),
    "gemma-3-270m-q4_k_m": ("default", "gemma3"),
}


@functools.cache
def _load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def vocab_path(name: str) -> Path:
    return shared_path("fixtures", "vocab", f"ggml-vocab-{name}.gguf")


def vocab_tokenizer(name: str) -> Tokenizer:
    return _load(vocab_path(name))


def model_path(ref: str) -> Path:
    kind, key = REF_MODELS[ref]
    return tinyqwen_path(key) if kind == "tinyqwen" else default_model(key)


def model_tokenizer(ref: str) -> Tokenizer:
    return _load(model_path(ref))


def reference(ref: str) -> dict[str, Any]:
    return json.loads(shared_path("fixtures", "refs", f"{ref}.json").read_text(encoding="utf-8"))


def vector_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 vectors: texts split on the separator, one id line per text."""
    path = vocab_path(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    assert len(lines) == len(texts), f"{path}: {len(texts)} texts but {len(lines)} id lines"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]
