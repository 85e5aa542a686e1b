"""On the GPU path a q8_0 cache is stored planar (mtpserve.quant.planar) while files and the CPU path keep GGUF
blocks: the same values through every door (append, the captured steps' writes, reads, slot files)."""

from __future__ import annotations

import torch

from mtpserve.cache import KVCache
from mtpserve.engine.slot_files import _load_kv
from mtpserve.ops.device import emulate_gpu
from mtpserve.quant.planar import to_planar

H, D = 2, 64


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def test_a_gpu_path_q8_0_cache_is_planar_and_reads_as_the_cpus() -> None:
    cpu = KVCache(64, H, D, D, "q8_0", "q8_0")
    with emulate_gpu():
        gpu = KVCache(64, H, D, D, "q8_0", "q8_0")
        f16 = KVCache(64, H, D, D, "q8_0", "f16")
    assert gpu.k.planar and gpu.v.planar and not cpu.k.planar and f16.k.planar and not f16.v.planar
    k, v = _kv(20)
    for cache in (cpu, gpu):
        cache.append(k[:12], v[:12])
        cache.write_at(torch.arange(12, 20), k[12:], v[12:])  # a captured step's write
        cache.length = 20
    assert torch.equal(gpu.k.data[:20], to_planar(cpu.k.data[:20], H))
    assert torch.equal(gpu.k.portable(gpu.k.data[:20]), cpu.k.data[:20])  # what a file holds
    for got, want in zip(gpu.read(), cpu.read(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(gpu.read(torch.float16)[1], cpu.read(torch.float16)[1])


def test_a_slot_file_moves_between_the_layouts() -> None:
    """The file holds GGUF blocks: a planar cache saves and restores through them, and a CPU cache reads what a GPU
    path cache saved (and back)."""
    k, v = _kv(30, seed=1)
    with emulate_gpu():
        gpu, gpu_restored = KVCache(64, H, D, D, "q8_0", "q8_0"), KVCache(64, H, D, D, "q8_0", "q8_0")
    cpu, cpu_restored = KVCache(64, H, D, D, "q8_0", "q8_0"), KVCache(64, H, D, D, "q8_0", "q8_0")
    gpu.append(k, v)
    cpu.append(k, v)
    saved = {"kv.0.k": gpu.k.portable(gpu.k.data[:30]), "kv.0.v": gpu.v.portable(gpu.v.data[:30])}
    assert torch.equal(saved["kv.0.k"], cpu.k.data[:30])
    _load_kv(cpu_restored, 30, saved, "kv.0")
    _load_kv(gpu_restored, 30, {"kv.0.k": cpu.k.data[:30], "kv.0.v": cpu.v.data[:30]}, "kv.0")
    assert torch.equal(cpu_restored.k.data, cpu.k.data) and torch.equal(cpu_restored.v.data, cpu.v.data)
    assert torch.equal(gpu_restored.k.data, gpu.k.data) and torch.equal(gpu_restored.v.data, gpu.v.data)
