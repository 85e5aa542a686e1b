"""Shared test fixtures: the read-only references in ../shared and the default models in the cache."""

from __future__ import annotations

import os
from pathlib import Path

# Two test workers (and the servers they start) share two cores: OpenMP threads that spin while they wait take the
# other worker's core. Passive waits ran the CPU model tests 18-25% faster here (docs/setup.md). Before torch loads
# libgomp, which reads it once; the servers the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The Triton kernels' tests run under Triton's interpreter on machines without a GPU. Triton reads this when it
# is first imported, and whichever test module imports it first wins: so it is set here, before any of them.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest

from mtpserve.default_models import DEFAULT_MODELS, model_path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MTPSERVE_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"
TINYQWEN_QUANTS = ("F16", "Q8_0", "Q6_K", "Q4_K_M")
# The fuzzers' depth (their examples are drawn derandomized): all of each one's examples unless MTPSERVE_FUZZ_DEPTH
# asks for a share of them (0.5: half; docs/setup.md).
FUZZ_DEPTH = float(os.environ.get("MTPSERVE_FUZZ_DEPTH", "1"))


def fuzz_examples(n: int) -> int:
    """A fuzzer's example count at this run's depth (n at depth 1)."""
    return max(1, round(n * FUZZ_DEPTH))


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip with the reason when that folder is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: tests against llama.cpp's references need the shared/ folder next to the repo")
    return path


def default_model(key: str) -> Path:
    """A default model from the cache. `make test` fetches them first and sets MTPSERVE_REQUIRE_MODELS=1,
    so there a missing model is a failure; a bare `pytest` run skips instead."""
    path = model_path(DEFAULT_MODELS[key])
    if not path.exists():
        reason = f"{path} is missing: run `make models` (mtpserve fetch-defaults) first"
        if os.environ.get("MTPSERVE_REQUIRE_MODELS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def tinyqwen_path(quant: str) -> Path:
    return shared_path("fixtures", f"tinyqwen35-mtp-{quant}.gguf")


@pytest.fixture(params=TINYQWEN_QUANTS)
def tinyqwen(request) -> Path:
    return tinyqwen_path(request.param)
