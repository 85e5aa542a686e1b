"""A large host KV cache takes memory as it is written, not at allocation (cache.kv.zeros)."""

from __future__ import annotations

from pathlib import Path

import torch

from mtpserve.cache.kv import KVCache


def resident_bytes(t: torch.Tensor) -> int:
    """The resident memory of the mapping that starts at the tensor's first byte (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if "-" in line.split(" ", 1)[0] and int(start, 16) == t.data_ptr():
            rss = next(entry for entry in lines[i + 1 :] if entry.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError("the tensor is not the start of a mapping of its own")


def test_a_262144_token_cache_commits_only_what_it_holds():
    """The deployment's q8_0 cache of one attention layer (262144 cells x 4 heads x 256, K and V: 1.06 GiB): nothing
    resident at allocation, the written rows' pages after 4096 positions, zeros everywhere else."""
    kv = KVCache(262144, 4, 256, 256, "q8_0", "q8_0")
    row_bytes = 4 * 256 * 34 // 32
    assert kv.k.data.nbytes == kv.v.data.nbytes == 262144 * row_bytes
    assert resident_bytes(kv.k.data) == resident_bytes(kv.v.data) == 0
    rows = torch.randn(4096, 4, 256)
    kv.k.write(slice(0, 4096), rows)
    # up to one more 2 MiB page where transparent huge pages back anonymous memory
    assert 4096 * row_bytes <= resident_bytes(kv.k.data) <= 4096 * row_bytes + (2 << 20)
    assert resident_bytes(kv.v.data) == 0
    assert kv.k.data[:4096].any() and not kv.k.data[4096:8192].any() and not kv.k.data[-16:].any()
