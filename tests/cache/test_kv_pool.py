"""--kv-unified's storage: a sequence's cache over a shared pool, its positions in blocks handed out in any order,
attends exactly as a cache of its own, on the CPU and on the GPU path's static steps."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cache import CellTable, KVCache, KVPool
from mtpserve.ops.device import emulate_gpu

H, D, BLOCK = 2, 32, 16


def _pair(cache_type: str, capacity: int = 128) -> tuple[KVCache, KVCache, CellTable]:
    """A cache of its own and one over a pool of 8 blocks, holding blocks 5, 2, 7 (out of order, as after other
    sequences came and went)."""
    own = KVCache(capacity, H, D, D, cache_type, cache_type)
    pool = KVPool(8 * BLOCK, H, D, D, cache_type, cache_type)
    table = CellTable(capacity, BLOCK)
    for block in (5, 2, 7):
        table.add_block(block)
    return own, KVCache(capacity, H, D, D, pool=pool, table=table), table


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_a_cache_over_a_pool_attends_as_its_own(cache_type: str) -> None:
    gen = torch.Generator().manual_seed(0)
    own, pooled, _ = _pair(cache_type)
    for n in (20, 1, 9):  # a prompt chunk, a decode step, a verification
        k, v, q = (torch.randn(n, H if i < 2 else 2 * H, D, generator=gen) for i in range(3))
        positions = torch.arange(own.length, own.length + n)
        own.append(k, v)
        pooled.append(k, v)
        assert torch.equal(pooled.attend(q, positions, 0.125), own.attend(q, positions, 0.125))
    keys, values, key_pos = pooled.read()
    assert torch.equal(key_pos, torch.arange(30)) and torch.equal(keys, own.read()[0]) and pooled.length == 30
    pooled.truncate(12)
    own.truncate(12)
    q = torch.randn(1, 2 * H, D, generator=gen)
    assert torch.equal(pooled.attend(q, torch.tensor([12]), 0.125), own.attend(q, torch.tensor([12]), 0.125))


def test_a_pool_keeps_each_sequences_keys_apart_and_refuses_cells_not_held() -> None:
    pool = KVPool(4 * BLOCK, H, D, D, "f16", "f16")
    tables = [CellTable(64, BLOCK) for _ in range(2)]
    tables[0].add_block(1)
    tables[1].add_block(0)
    a, b = (KVCache(64, H, D, D, pool=pool, table=t) for t in tables)
    a.append(torch.ones(BLOCK, H, D), torch.ones(BLOCK, H, D))
    b.append(-torch.ones(3, H, D), -torch.ones(3, H, D))
    assert torch.equal(a.read()[1], torch.ones(BLOCK, H, D).half()) and torch.equal(
        b.read()[1], -torch.ones(3, H, D).half()
    )
    assert int((a.positions >= 0).sum()) == BLOCK and int((b.positions >= 0).sum()) == 3  # each masks the other's
    with pytest.raises(ValueError, match="no KV cells reserved"):
        a.append(torch.ones(1, H, D), torch.ones(1, H, D))  # block 1 is full and a holds no other
    assert tables[0].trim(0) == [1] and tables[0].n_cells == 0
    assert a.nbytes == 0 and b.nbytes == pool.nbytes // 4


def test_static_writes_and_reads_over_a_pool_equal_a_cache_of_its_own() -> None:
    """The GPU path's captured steps: `write_at` indexes the pool through the table's device map, and
    `attend_static` reads the whole pool masked to this sequence's cells."""
    gen = torch.Generator().manual_seed(1)
    with emulate_gpu():
        own, pooled, table = _pair("q8_0")
        prompt_k, prompt_v = torch.randn(24, H, D, generator=gen), torch.randn(24, H, D, generator=gen)
        own.append(prompt_k, prompt_v)
        pooled.append(prompt_k, prompt_v)
        for step in range(3):
            positions = torch.tensor([24 + 2 * step, 25 + 2 * step])
            k, v, q = torch.randn(2, H, D, generator=gen), torch.randn(2, H, D, generator=gen), torch.randn(2, 2 * H, D)
            for cache in (own, pooled):
                cache.write_at(positions, k, v)
                cache.length += 2
            # q8_0 on the GPU path: the int8 kernel rounds the softmax weights to fp16 against the running max,
            # which follows the order the cells are walked in
            torch.testing.assert_close(
                pooled.attend_static(q, positions, 0.125), own.attend_static(q, positions, 0.125), atol=1e-3, rtol=1e-3
            )
        table.add_block(0)  # a block added after the map was made: the map follows in place
        assert int(table.rows_on(torch.device("cpu"))[48]) == 0
