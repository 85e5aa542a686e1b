"""gguf.residency: `--no-mmap` reads a file into the process's own memory, `--mlock` pins its pages, and a refused
lock warns and loads unlocked."""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from mtpserve.gguf import open_gguf, residency

from ..conftest import tinyqwen_path


def _locked_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmLck:")))


def test_read_into_memory_keeps_the_files_bytes_whatever_becomes_of_the_file(tmp_path):
    """The same tensors either way; then the file is overwritten with zeros in place: the mapped copy sees them
    (Linux shares a private mapping's untouched pages with the page cache), the one read into memory does not."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(tinyqwen_path("Q4_K_M"), path)
    mapped, in_memory = open_gguf(path), open_gguf(path, use_mmap=False)
    name = "blk.0.ffn_down.weight"
    original = mapped.tensors[name].raw().copy()
    assert set(in_memory.tensors) == set(mapped.tensors) and in_memory.metadata.keys() == mapped.metadata.keys()
    assert all(np.array_equal(t.raw(), mapped.tensors[t.name].raw()) for t in in_memory.tensors.values())
    with open(path, "r+b") as f:
        f.write(bytes(path.stat().st_size))
    assert np.array_equal(in_memory.tensors[name].raw(), original)
    assert not mapped.tensors[name].raw().any()


def test_a_file_ending_while_it_is_read_is_an_error(tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(tinyqwen_path("Q4_K_M"), path)
    with open(path, "rb") as f, pytest.raises(OSError, match="the file ended at"):
        residency.read_into_memory(f, path.stat().st_size + 10, path)


def test_mlock_pins_the_files_pages(caplog):
    """Mapped or read into memory, the file's pages are locked (VmLck grows by its size) and unlocked with the
    mapping; where this process may not lock 5.9 MB (RLIMIT_MEMLOCK without CAP_IPC_LOCK) it says so instead."""
    for use_mmap in (True, False):
        before = _locked_kib()
        with caplog.at_level(logging.WARNING, logger="mtpserve.gguf"):
            gguf = open_gguf(tinyqwen_path("Q4_K_M"), use_mmap=use_mmap, use_mlock=True)
        refused = "failed to mlock" in caplog.text
        assert refused or _locked_kib() - before >= gguf.file_size // 1024, use_mmap
        del gguf
        gc.collect()  # the mapping goes, and its lock with it
        assert _locked_kib() == before


def test_a_refused_lock_warns_in_llama_cpps_words_and_loads(monkeypatch, caplog):
    class Refusing:
        def mlock2(self, *args):
            return -1

        mlock = mlock2

    monkeypatch.setattr(residency.ctypes, "CDLL", lambda *a, **k: Refusing())
    monkeypatch.setattr(residency.ctypes, "get_errno", lambda: 12)  # ENOMEM
    with caplog.at_level(logging.WARNING, logger="mtpserve.gguf"):
        gguf = open_gguf(tinyqwen_path("Q4_K_M"), use_mlock=True)
    assert "failed to mlock" in caplog.text and "Try increasing RLIMIT_MEMLOCK" in caplog.text
    assert gguf.tensors["blk.0.ffn_down.weight"].raw().any()
