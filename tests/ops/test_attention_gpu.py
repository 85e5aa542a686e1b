"""Prompt attention on the GPU path (`attention_gpu`) runs on PyTorch's fused kernels, never the math kernel (which
builds the [T, S] scores: 26 GB for a 2048-token chunk over 262144 keys). The CPU's flash attention refuses what
CUDA's kernels refuse (3-D inputs), so restricting SDPA to the fused backends on the CPU catches a call that would
fall back to the math kernel on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtpserve.ops import attention
from mtpserve.ops.attention import attention_gpu, attention_reference

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _inputs(T: int, S: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 4, 32, generator=g), torch.randn(S, 2, 32, generator=g), torch.randn(S, 2, 32, generator=g)


def test_a_3d_call_needs_the_math_kernel() -> None:
    """What the check below rests on: restricted to the fused backends, SDPA of 3-D tensors fails on the CPU."""
    q, k, v = (torch.randn(2, 5, 32) for _ in range(3))
    with sdpa_kernel(FUSED), pytest.raises(RuntimeError, match="No available kernel"):
        F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("grouped", [True, False], ids=["gqa-in-kernel", "per-kv-head"])
@pytest.mark.parametrize(("in_order", "window"), [(True, None), (True, 50), (False, None), (False, 50)])
def test_prompt_attention_runs_on_fused_kernels(
    monkeypatch: pytest.MonkeyPatch, grouped: bool, in_order: bool, window: int | None
) -> None:
    """Lower-right causal, windows and explicit masks, with the grouped heads in the kernel (flash attention) or one
    KV head at a time (CUDA's other fused kernels): all on fused kernels, all the reference's result."""
    monkeypatch.setattr(attention, "_takes_grouped_heads", lambda *args: grouped)
    T, S = 40, 300
    q, k, v = _inputs(T, S)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    with sdpa_kernel(FUSED):
        ours = attention_gpu(q, k, v, q_pos, k_pos, 0.2, window=window, in_order=in_order)
    want = attention_reference(q, k, v, q_pos, k_pos, 0.2, window=window)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("in_order", [True, False])
def test_explicit_masks_are_built_a_few_queries_at_a_time(monkeypatch: pytest.MonkeyPatch, in_order: bool) -> None:
    """A mask budget of 1000 elements over 300 keys: 3 queries a chunk (in order with a window: over only the
    window's keys), each with its own rows of the mask; empty cells (position -1) are never seen."""
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 1000)
    built: list[tuple[int, ...]] = []
    real = attention._fused_attention

    def spy(q, k, v, mask, scale):
        built.append(tuple(mask.shape))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(attention, "_fused_attention", spy)
    T, S = 10, 300
    q, k, v = _inputs(T, S, seed=1)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    if not in_order:
        k_pos[100:120] = -1  # holes
    ours = attention_gpu(q, k, v, q_pos, k_pos, 0.2, window=64, in_order=in_order)
    assert all(rows * keys <= 1000 for rows, keys in built)
    assert [rows for rows, _ in built] == [3, 3, 3, 1]
    if in_order:
        assert [keys for _, keys in built] == [66, 66, 66, 64]
    live = k_pos >= 0
    want = attention_reference(q, k[live], v[live], q_pos, k_pos[live], 0.2, window=64)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_the_decode_kernels_choice_reaches_it_and_keeps_the_reference_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """`DECODE_ATTENTION_CHOICE` (what bench/gpu.py --attention-choices sets for a captured step) reaches the Triton
    decode kernel as its keywords, and a choice changes the tiling, not the result."""
    from mtpserve.cache.kv import KVCache

    kernels = attention.triton_kernels()
    g = torch.Generator().manual_seed(3)
    kv = KVCache(96, 2, 64, 64, "q8_0", "q8_0")
    kv.append(torch.randn(90, 2, 64, generator=g), torch.randn(90, 2, 64, generator=g))
    q, q_pos = torch.randn(3, 6, 64, generator=g), torch.tensor([87, 88, 89])
    if kernels is None or not attention.triton_available(q):
        pytest.skip("no Triton kernels here")
    seen: list[dict] = []
    real = kernels.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "decode_attention", spy)
    call = (q, kv.k.data, kv.v.data, kv.k.type, kv.v.type, q_pos, kv.positions)
    expected = attention.decode_attention_reference(*call, n_kv_heads=2, scale=0.125)
    default = attention.decode_attention_gpu(*call, n_kv_heads=2, scale=0.125, ordered=True)
    choice = {"block_s": 16, "num_warps": 2, "min_keys": 16, "loads_first": True, "block_m": 32}
    monkeypatch.setattr(attention, "DECODE_ATTENTION_CHOICE", choice)
    chosen = attention.decode_attention_gpu(*call, n_kv_heads=2, scale=0.125, ordered=True)
    assert [{k: kw.get(k) for k in choice} for kw in seen] == [dict.fromkeys(choice), choice]
    torch.testing.assert_close(default, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chosen, expected, atol=1e-4, rtol=1e-4)
