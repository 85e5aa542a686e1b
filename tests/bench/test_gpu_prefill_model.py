"""bench/gpu_prefill_model.py's arithmetic, against sums done by hand from its stated assumptions (616 GB/s at 80%,
53.8 TFLOPS at 70% for the GEMMs and 25% for attention), on the deployment's prompt matrices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_prefill_model as pm  # noqa: E402

BANDWIDTH = 0.616e12 * 0.8  # bytes a second
GEMM_FLOPS = 53.8e12 * 0.7
ATTENTION_FLOPS = 53.8e12 * 0.25


def test_the_prompt_matrices_leave_out_the_embedding_and_the_output_layer():
    weights = pm.PromptWeights.of_deployment()
    # every quantized matrix of the file: 27,318 M weights in 16,789 MB; the embedding and the output layer are
    # 1,271 M weights each, in 715 and 1,043 MB
    assert weights.values == pytest.approx(27.318e9 - 2 * 1.271e9, rel=1e-3)
    assert weights.stored_bytes == pytest.approx(16.789e9 - 0.715e9 - 1.043e9, rel=1e-3)


def test_a_ubatch_through_the_matrices_by_hand():
    weights = pm.PromptWeights(values=10**9, stored_bytes=5 * 10**8)
    now = pm.ubatch_matrices(weights, 512, pm.BYTES_PER_WEIGHT_NOW)
    before = pm.ubatch_matrices(weights, 512, pm.BYTES_PER_WEIGHT_BEFORE)
    assert now[0] == pytest.approx((0.5e9 + 4e9) / BANDWIDTH)  # GGUF bytes read; fp16 written and read
    assert before[0] == pytest.approx((0.5e9 + 12e9) / BANDWIDTH)  # float32 written, read; fp16 written, read
    assert now[1] == before[1] == pytest.approx(2 * 1e9 * 512 / GEMM_FLOPS)


def test_a_ubatchs_attention_by_hand():
    attention, kv = pm.ubatch_attention(1024, 512)
    # 16 layers x 4 (QK^T and PV, a multiply-add each) x 24 heads x 256 x 512 queries x (1024 + 256) keys on average
    assert attention == pytest.approx(16 * 4 * 24 * 256 * 512 * 1280 / ATTENTION_FLOPS)
    # K and V of 4 heads x 256 up to position 1536, in 16 layers: q8_0 read, fp16 written and read
    assert kv == pytest.approx(16 * 2 * 4 * 256 * 1536 * (34 / 32 + 4) / BANDWIDTH)


def test_a_prompt_sums_its_ubatches_and_fp16_moves_less():
    weights = pm.PromptWeights(values=10**9, stored_bytes=5 * 10**8)
    parts = pm.prompt(weights, 1300, pm.BYTES_PER_WEIGHT_NOW, ubatch=512)  # 512 + 512 + 276
    ubatches = [pm.ubatch_matrices(weights, n, pm.BYTES_PER_WEIGHT_NOW) for n in (512, 512, 276)]
    assert parts.dequantization == pytest.approx(3 * (0.5e9 + 4e9) / BANDWIDTH)
    assert parts.gemm == pytest.approx(sum(g for _, g in ubatches))
    rows = {(r["prompt"], r["dequantized_to"]): r for r in pm.predict(weights)}
    for n in pm.PROMPTS:
        assert rows[(n, "fp16")]["tok_s"] > rows[(n, "float32, then .half()")]["tok_s"]
        assert rows[(n, "fp16")]["s"]["gemm"] == rows[(n, "float32, then .half()")]["s"]["gemm"]
