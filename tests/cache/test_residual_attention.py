"""The CPU decode's attention block in one C call (`KVCache.residual_attention`) against the same block op by op:
the same numbers bit for bit, the same cache afterwards."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cache import KVCache
from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.models.loader import load

from ..conftest import default_model, tinyqwen_path

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernel library did not build here")


def _op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KVCache, "residual_attention", lambda self, *args, **kw: None)


def _model_path(name: str):
    return tinyqwen_path("Q4_K_M") if name == "tinyqwen35" else default_model(name)


@needs_kernels
@pytest.mark.parametrize(
    ("name", "cache_type"), [("smollm2", "f16"), ("smollm2", "f32"), ("gemma3", "f16"), ("tinyqwen35", "f16")]
)
def test_fused_attention_block_equals_the_ops_one_by_one(
    name: str, cache_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's plain block, Gemma 3's (query scale, norm after the block, sliding-window rings) and Qwen3.5's
    (sigmoid-gated output)."""
    model = load(_model_path(name))
    prompt = torch.randint(0, model.config.n_vocab, (300,), generator=torch.Generator().manual_seed(0))
    # 300 positions: past 256 cells the single-token attention splits the cache in two (llama.cpp's threads)
    steps = [prompt[:290], prompt[290:291], prompt[291:294], prompt[294:295]]  # prompt, decode, verification, decode

    def run() -> tuple[list[torch.Tensor], list]:
        state = model.new_state(512, cache_type, cache_type)
        hidden = [model.forward(tokens, state) for tokens in steps]
        return hidden, [
            (kv.k.data.clone(), kv.v.data.clone(), kv.positions.clone(), kv.length) for kv in state.kv.values()
        ]

    fused_calls = []
    fused = KVCache.residual_attention
    with monkeypatch.context() as m:
        m.setattr(
            KVCache, "residual_attention", lambda s, *a, **kw: fused_calls.append(fused(s, *a, **kw)) or fused_calls[-1]
        )
        fused_hidden, fused_caches = run()
    # every attention layer of the three short steps took the one call; the 290-token prompt went op by op
    assert sum(y is not None for y in fused_calls) == 3 * len(model.new_state(512).kv)
    with monkeypatch.context() as m:
        _op_by_op(m)
        plain_hidden, plain_caches = run()
    for fused, plain in zip(fused_hidden, plain_hidden):
        assert torch.equal(fused, plain)
    for (fk, fv, fp, fn), (pk, pv, pp, pn) in zip(fused_caches, plain_caches):
        assert torch.equal(fk, pk) and torch.equal(fv, pv) and torch.equal(fp, pp) and fn == pn


@needs_kernels
def test_caches_the_fused_block_cannot_read_go_op_by_op() -> None:
    x = torch.randn(1, 64)
    ring = KVCache(64, 2, 32, 32, "f16", "f16", window=16, ring=True)
    for n in (40, 30):  # past its 64 cells: wrapped, cell i no longer holds position i
        ring.append(torch.randn(n, 2, 32), torch.randn(n, 2, 32))
    quantized = KVCache(64, 2, 32, 32, "q8_0", "q8_0")
    for kv in (ring, quantized):
        assert kv.residual_attention(x, None, 1e-5, None, None, 2, None, None, 1.0, neox=False) is None
