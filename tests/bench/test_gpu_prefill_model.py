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
    """Counted by hand from the 27B's shapes (../shared/spec/qwen35-architecture.md): n_embd 5120, FFN 17408, a
    DeltaNet layer's qkv 10240 / gate and output 6144 / beta and alpha 48 rows, an attention layer's q (with its gate)
    12288 / k and v 1024 / output 6144 rows, the MTP block an attention layer with its FFN and eh_proj [5120, 10240]."""
    ffn = 3 * 5120 * 17408
    deltanet = 5120 * (10240 + 6144 + 48 + 48) + 6144 * 5120 + ffn
    attention = 5120 * (12288 + 1024 + 1024) + 6144 * 5120 + ffn
    mtp = attention + 10240 * 5120
    weights = pm.PromptWeights.of_deployment()
    assert weights.values == 48 * deltanet + 16 * attention + mtp
    # the file's quantized matrices less the Q4_K embedding and the Q6_K output layer, 248,320 x 5120 each
    from mtpserve.tuning.synthetic import Qwen35Shape, tensors

    stored = sum(t.nbytes for t in tensors(Qwen35Shape()) if len(t.ne) == 2 and t.type != "F32")
    embedding, output = 248320 * 5120 // 256 * 144, 248320 * 5120 // 256 * 210
    assert weights.stored_bytes == stored - embedding - output


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
