"""sm_75's prompt path, static: what a prompt of Qwen3.6-27B Q4_K_M costs on the two RTX 2080 Ti, without a GPU.

    .venv/bin/python bench/gpu_prefill_model.py [--json OUT]

Below sm_80 Triton emits no tensor-core instructions, so `ops.quant_gemv.quant_linear` dequantizes each matrix for
every ubatch and lets cuBLAS multiply in fp16 with float32 accumulation (tensor cores). A ubatch of U prompt tokens
costs, summed (the kernels run one after another in one stream; the layer split runs the cards in series, so two
cards cost what one streaming every matrix would):

* dequantization: each prompt matrix's bytes as the GGUF stores them read, its values written and read back by
  cuBLAS, over HBM x BANDWIDTH_FRACTION. Straight to fp16 (5a4ff17): 2 + 2 bytes a weight. Before it: float32
  written (4), read and written as fp16 by `.half()` (4 + 2), read by cuBLAS (2): 12.
* GEMM: 2 x weights x U multiply-adds over the fp16 tensor peak with float32 accumulation x GEMM_EFFICIENCY.
* attention: the causal prompt's QK^T and PV, 4 x query heads x head dim x U x (position + U / 2) a layer, over the
  same peak x ATTENTION_EFFICIENCY; and the q8_0 KV cache up to the ubatch dequantized to fp16 for it (read 34/32
  bytes a value, write 2, read 2) at HBM x BANDWIDTH_FRACTION.

Prompt matrices: every quantized matrix of the deployment's file (tuning.synthetic) but the token embedding (a
lookup) and the output layer (a prompt's rows ask no logits), the MTP block included (its cache follows the prompt).
Not modeled, so the estimate is an upper bound on speed: the Gated DeltaNet chunk scan of 48 layers (PyTorch's on
sm_75), norms, RoPE, the convolution and the layer split's hand-over. Every assumption is a named constant; none is
tuned to a goal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Assumptions (module docstring).
HBM_TBPS = 0.616  # RTX 2080 Ti: 616 GB/s GDDR6
BANDWIDTH_FRACTION = 0.80  # issue 38's rule for a streaming kernel until measured on the card
# RTX 2080 Ti, fp16 tensor math with float32 accumulation: 53.8 TFLOPS at the boost clock (NVIDIA Turing
# architecture whitepaper, appendix table; 107.6 with fp16 accumulation, which mtpserve does not use)
TENSOR_FP16_F32ACC_TFLOPS = 53.8
GEMM_EFFICIENCY = 0.70  # cuBLAS on large fp16 GEMMs (M = 512, N and K in the thousands): assumed, not measured
ATTENTION_EFFICIENCY = 0.25  # PyTorch's memory-efficient SDPA at D = 256 on sm_75: assumed, not measured
UBATCH = 512  # -ub, llama-server's and mtpserve's default
PROMPTS = (8192, 32768)
BYTES_PER_WEIGHT_BEFORE = 12  # float32 written, read; fp16 written, read (the GGUF's own bytes counted apart)
BYTES_PER_WEIGHT_NOW = 4  # fp16 written, read

# The deployment's attention (../shared/spec/qwen35-architecture.md)
ATTENTION_LAYERS, QUERY_HEADS, KV_HEADS, HEAD_DIM = 16, 24, 4, 256
Q8_0_BYTES_PER_VALUE = 34 / 32


@dataclass(frozen=True)
class PromptWeights:
    values: int  # weights the prompt's matrices hold
    stored_bytes: int  # their GGUF bytes

    @classmethod
    def of_deployment(cls) -> PromptWeights:
        from mtpserve.tuning.synthetic import Qwen35Shape, tensors

        skipped = {"token_embd.weight", "output.weight"}
        matrices = [t for t in tensors(Qwen35Shape()) if len(t.ne) == 2 and t.type != "F32" and t.name not in skipped]
        return cls(sum(math.prod(t.ne) for t in matrices), sum(t.nbytes for t in matrices))


@dataclass
class PromptParts:
    """Seconds of a whole prompt by part."""

    dequantization: float = 0.0
    gemm: float = 0.0
    attention: float = 0.0
    kv_dequantization: float = 0.0

    def total(self) -> float:
        return sum(asdict(self).values())


def ubatch_matrices(weights: PromptWeights, tokens: int, bytes_per_weight: float) -> tuple[float, float]:
    """(dequantization, GEMM) seconds of one ubatch of `tokens` through every prompt matrix."""
    moved = weights.stored_bytes + bytes_per_weight * weights.values
    dequantization = moved / (HBM_TBPS * 1e12 * BANDWIDTH_FRACTION)
    gemm = 2 * weights.values * tokens / (TENSOR_FP16_F32ACC_TFLOPS * 1e12 * GEMM_EFFICIENCY)
    return dequantization, gemm


def ubatch_attention(start: int, tokens: int) -> tuple[float, float]:
    """(attention, KV dequantization) seconds of one ubatch of `tokens` at prompt positions start.. (causal)."""
    keys = start + tokens / 2  # keys a query sees, on average over the ubatch
    flops = ATTENTION_LAYERS * 4 * QUERY_HEADS * HEAD_DIM * tokens * keys
    attention = flops / (TENSOR_FP16_F32ACC_TFLOPS * 1e12 * ATTENTION_EFFICIENCY)
    values = ATTENTION_LAYERS * 2 * KV_HEADS * HEAD_DIM * (start + tokens)  # K and V up to the ubatch's end
    kv = values * (Q8_0_BYTES_PER_VALUE + 2 + 2) / (HBM_TBPS * 1e12 * BANDWIDTH_FRACTION)
    return attention, kv


def prompt(weights: PromptWeights, n_tokens: int, bytes_per_weight: float, ubatch: int = UBATCH) -> PromptParts:
    parts = PromptParts()
    for start in range(0, n_tokens, ubatch):
        tokens = min(ubatch, n_tokens - start)
        dequantization, gemm = ubatch_matrices(weights, tokens, bytes_per_weight)
        attention, kv = ubatch_attention(start, tokens)
        parts.dequantization += dequantization
        parts.gemm += gemm
        parts.attention += attention
        parts.kv_dequantization += kv
    return parts


def predict(weights: PromptWeights | None = None) -> list[dict]:
    """Per prompt length, before and after 5a4ff17: tok/s and seconds by part."""
    weights = weights or PromptWeights.of_deployment()
    rows = []
    for n_tokens in PROMPTS:
        for label, bytes_per_weight in (
            ("float32, then .half()", BYTES_PER_WEIGHT_BEFORE),
            ("fp16", BYTES_PER_WEIGHT_NOW),
        ):
            parts = prompt(weights, n_tokens, bytes_per_weight)
            rows.append(
                {
                    "device": "2x2080Ti",
                    "prompt": n_tokens,
                    "dequantized_to": label,
                    "tok_s": round(n_tokens / parts.total(), 1),
                    "s": {k: round(v, 3) for k, v in asdict(parts).items()},
                }
            )
    return rows


def assumptions() -> dict:
    names = ("HBM_TBPS", "BANDWIDTH_FRACTION", "TENSOR_FP16_F32ACC_TFLOPS", "GEMM_EFFICIENCY", "ATTENTION_EFFICIENCY")
    return {name: globals()[name] for name in (*names, "UBATCH")}


def table(rows: list[dict]) -> str:
    lines = [
        "| prompt | weights dequantized to | tok/s predicted | dequantization s | GEMM s | attention s "
        "| KV dequantization s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["s"]
        lines.append(
            f"| {r['prompt']:,} | {r['dequantized_to']} | {r['tok_s']} | {s['dequantization']} | {s['gemm']} | "
            f"{s['attention']} | {s['kv_dequantization']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the prediction here")
    args = parser.parse_args(argv)
    rows = predict()
    if args.json:
        Path(args.json).write_text(json.dumps({"assumptions": assumptions(), "predicted": rows}, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
