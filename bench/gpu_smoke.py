"""Every Triton kernel once, at the Qwen3.6-27B's shapes, against its PyTorch twin; then one CUDA graph capture and
replay of a small model's decode step against the eager step. The first stage of a GPU check after the environment
(bench/gpu_check.sh): a minute that says which kernels are wrong on this GPU before anything slow runs.

    python3 bench/gpu_smoke.py                                  # on the GPU: the 27B's shapes
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_smoke.py --device cpu --tiny   # the wiring, here, in seconds

One line per case, printed (flushed) as it ends: PASS/FAIL with the largest absolute error and the largest error
relative to the twin's largest magnitude, against a tolerance that follows the kernel's compute type (exact for the
unpacking; float32 for the GEMV, attention and recurrence; bf16 tensor-core inputs from sm_80, f16 below, for the
GEMM and the chunk scan); SKIP with its reason. Every callable that mtpserve.kernels.triton exports is listed: with
a case in SMOKE (the registry below: wrapper name -> a builder of cases at given shapes), or as uncovered. A case's
exception is its FAIL (with the traceback), never the run's end. Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from gpu import TINY, random_blocks, random_weights  # bench/gpu.py, beside this file

from mtpserve.kernels.capability import cuda_capability

# Relative error allowed (largest |kernel - twin| over the twin's largest |value|) by compute type.
TOLERANCE = {"exact": 0.0, "float32": 1e-4, "tf32x3": 5e-4, "float16": 5e-3, "bfloat16": 3e-2}
# Exported helpers that launch nothing (no case needed).
NOT_KERNELS = {"act_block", "auto_splits", "chunk_scan_supported"}


@dataclass(frozen=True)
class Shapes:
    """The model dimensions the cases use."""

    n_embd: int = 5120
    n_ff: int = 17408
    n_head: int = 24
    n_head_kv: int = 4
    head_dim: int = 256
    n_k_heads: int = 16
    n_v_heads: int = 48
    ssm_dim: int = 128
    context: int = 4096  # cached cells the attention reads
    prompt: int = 512  # rows of the GEMM and the chunk scan's tokens
    chunk: int = 64


QWEN36_27B = Shapes()
TINY_SHAPES = Shapes(512, 768, 4, 2, 64, 2, 4, 32, 128, 32, 16)


@dataclass(frozen=True)
class Comparison:
    """The kernel's outputs, the twin's, and the compute type whose tolerance applies."""

    got: tuple[torch.Tensor, ...]
    want: tuple[torch.Tensor, ...]
    dtype: str


@dataclass(frozen=True)
class Case:
    label: str
    run: Callable[[], Comparison | list[Comparison]]


Builder = Callable[[Shapes, torch.device], list[Case]]
SMOKE: dict[str, Builder] = {}


def smoke_case(wrapper: str) -> Callable[[Builder], Builder]:
    """Registers a builder of cases for the kernels' export `wrapper`."""

    def register(builder: Builder) -> Builder:
        SMOKE[wrapper] = builder
        return builder

    return register


def kernels():
    from mtpserve.kernels import triton

    return triton


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=gen.device, generator=gen)


def gemm_dtype(device: torch.device) -> str:
    """The tensor-core input type of the GEMM and the chunk scan: bf16 from sm_80, f16 below (float32 on CPU)."""
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if cuda_capability(device)[0] >= 8 else "float16"


def _gemv_matrices(s: Shapes) -> list[tuple[str, str, int, int]]:
    return [("ffn_up", "Q4_K", s.n_ff, s.n_embd), ("ffn_down", "Q6_K", s.n_embd, s.n_ff)]


@smoke_case("quant_gemv")
def _quant_gemv(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.quant_gemv import quant_gemv_reference
    from mtpserve.quant.types import GGMLType

    cases = []
    for name, qtype, n, k in _gemv_matrices(s):
        for rows in (1, 3):
            for wide in (True, False):

                def run(qtype=GGMLType[qtype], n=n, k=k, rows=rows, wide=wide) -> Comparison:
                    gen = _gen(device, 1)
                    blocks = random_blocks(qtype, n, k, device, gen)
                    x = _randn(gen, rows, k)
                    got = kernels().quant_gemv(x, blocks, int(qtype), wide_words=wide)
                    return Comparison((got,), (quant_gemv_reference(x, blocks, qtype),), "float32")

                kernel = "words" if wide else "sub-tile"
                cases.append(Case(f"quant_gemv {name} {qtype} {n}x{k} rows={rows} {kernel}", run))
    return cases


@smoke_case("quant_gemv_q8")
def _quant_gemv_q8(s: Shapes, device: torch.device) -> list[Case]:
    """The integer GEMV on Q8_K activation quants, against the float GEMV's twin on the same rounded values (q * d):
    the integer dots are exact, so only float32 summation order may differ."""
    from mtpserve.ops.activation_rounding import ActFormat
    from mtpserve.ops.quant_gemv import quant_gemv_reference
    from mtpserve.ops.rowwise import quantize_rows_reference
    from mtpserve.quant.types import GGMLType

    module = kernels()
    supported = {int(t) for t in getattr(module, "Q8_GEMV_TYPES", ())} or {int(GGMLType.Q4_K)}
    cases = []
    for name, qtype, n, k in _gemv_matrices(s):
        if int(GGMLType[qtype]) not in supported:
            continue
        for rows in (1, 3):

            def run(qtype=GGMLType[qtype], n=n, k=k, rows=rows) -> Comparison:
                gen = _gen(device, 2)
                blocks = random_blocks(qtype, n, k, device, gen)
                q, d = quantize_rows_reference(_randn(gen, rows, k), ActFormat(256))  # Q4_K/Q6_K: Q8_K activations
                got = kernels().quant_gemv_q8(q, d, blocks, int(qtype))
                rounded = q.float() * d.repeat_interleave(256, dim=-1)
                return Comparison((got,), (quant_gemv_reference(rounded, blocks, qtype),), "float32")

            cases.append(Case(f"quant_gemv_q8 {name} {qtype} {n}x{k} rows={rows}", run))
    return cases


def _quants_of(y: torch.Tensor, q: torch.Tensor, d: torch.Tensor, block: int) -> Comparison:
    """The kernel's quants against the twin's quantization of the kernel's own y: bit-identical, as promised."""
    from mtpserve.ops.activation_rounding import ActFormat
    from mtpserve.ops.rowwise import quantize_rows_reference

    want_q, want_d = quantize_rows_reference(y, ActFormat(block))
    return Comparison((q.float(), d), (want_q.float(), want_d), "exact")


@smoke_case("quantize_rows")
def _quantize_rows(s: Shapes, device: torch.device) -> list[Case]:
    def case(rows: int, k: int, block: int) -> Case:
        def run() -> Comparison:
            x = _randn(_gen(device, 9), rows, k)
            q, d = kernels().quantize_rows(x, block)
            return _quants_of(x, q, d, block)

        return Case(f"quantize_rows {rows}x{k} block {block}", run)

    return [case(1, s.n_embd, 256), case(3, s.n_ff, 256), case(1, s.n_embd, 32)]


@smoke_case("rms_norm_quantize")
def _rms_norm_quantize(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.activation_rounding import ActFormat
    from mtpserve.ops.rowwise import rms_norm_quantize_reference

    def case(rows: int) -> Case:
        def run() -> list[Comparison]:
            gen = _gen(device, 10)
            x, add = _randn(gen, rows, s.n_embd), _randn(gen, rows, s.n_embd)
            weight = torch.rand(s.n_embd, device=device, generator=gen) + 0.5
            got_s, got_y, q, d = kernels().rms_norm_quantize(x, weight, 1e-6, add=add, block=256)
            want_s, want_y, _, _ = rms_norm_quantize_reference(x, weight, 1e-6, add=add, fmt=ActFormat(256))
            return [Comparison((got_s, got_y), (want_s, want_y), "float32"), _quants_of(got_y, q, d, 256)]

        return Case(f"rms_norm_quantize (+ residual) {rows}x{s.n_embd} block 256", run)

    return [case(1), case(3)]


@smoke_case("glu_quantize")
def _glu_quantize(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.activation_rounding import ActFormat
    from mtpserve.ops.rowwise import glu_quantize_reference

    def case(rows: int) -> Case:
        def run() -> list[Comparison]:
            gate_up = _randn(_gen(device, 11), rows, 2 * s.n_ff)  # one GEMV output, halved
            gate, up = gate_up[:, : s.n_ff], gate_up[:, s.n_ff :]
            y, q, d = kernels().glu_quantize(gate, up, "silu", block=256)
            want_y, _, _ = glu_quantize_reference(gate, up, "silu", fmt=ActFormat(256))
            return [Comparison((y,), (want_y,), "float32"), _quants_of(y, q, d, 256)]

        return Case(f"glu_quantize silu {rows}x{s.n_ff} block 256", run)

    return [case(1), case(3)]


@smoke_case("draw_row")
def _draw_row(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.sampling_chain import ChainInputs, ChainParams, ChainShape, drawn_row_reference, top_candidates

    def run() -> list[Comparison]:
        shape, inputs = ChainShape(40, 0), ChainInputs(1, device)
        inputs.set(ChainParams(0.95, 0.05, 0.8), [0.5])  # llama-server's default chain
        values, ids = top_candidates(_randn(_gen(device, 17), 248_320) * 3, 40)  # a row of Qwen3.6's vocabulary
        chain = (inputs.top_p, inputs.log_min_p, inputs.temperature, inputs.uniforms)
        row, token = kernels().draw_row(values, ids, values, *chain, min_keep=0, top_k=10)
        want_row, want_token = drawn_row_reference(values, values, ids, shape, inputs, 0, 10)
        # the token, the survivors' count and the candidates' ids; the draft's confidence and the probabilities
        exact, floats = [0, 2, *range(3, 43)], [1, *range(43, 83)]
        return [
            Comparison((token, row[exact]), (want_token, want_row[exact]), "exact"),
            Comparison((row[floats],), (want_row[floats],), "float32"),
        ]

    return [Case("draw_row: the server's default chain over the top 40 of 248,320 logits", run)]


@smoke_case("dequant_blocks")
def _dequant_blocks(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.quant.dequant import dequantize
    from mtpserve.quant.types import GGMLType

    def case(qtype: GGMLType) -> Case:
        def run() -> Comparison:
            blocks = random_blocks(qtype, s.n_embd, s.n_embd, device, _gen(device, 3))
            got = kernels().dequant_blocks(blocks, int(qtype))
            return Comparison((got,), (dequantize(blocks, qtype, (s.n_embd, s.n_embd)),), "exact")

        return Case(f"dequant_blocks {qtype.name} {s.n_embd}x{s.n_embd}", run)

    return [case(GGMLType.Q4_K), case(GGMLType.Q6_K)]


@smoke_case("quant_matmul")
def _quant_matmul(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.quant_gemv import quant_gemv_reference
    from mtpserve.quant.types import GGMLType

    dtype = gemm_dtype(device)

    def run() -> Comparison:
        gen = _gen(device, 4)
        blocks = random_blocks(GGMLType.Q4_K, s.n_ff, s.n_embd, device, gen)
        x = _randn(gen, s.prompt, s.n_embd)
        got = kernels().quant_matmul(x, blocks, int(GGMLType.Q4_K), compute_dtype=getattr(torch, dtype))
        return Comparison((got,), (quant_gemv_reference(x, blocks, GGMLType.Q4_K),), dtype)

    return [Case(f"quant_matmul Q4_K {s.n_ff}x{s.n_embd} rows={s.prompt} ({dtype} inputs)", run)]


@smoke_case("decode_attention")
def _decode_attention(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.kernels.triton.attention import planar_kernel
    from mtpserve.ops.attention import decode_attention_reference
    from mtpserve.quant.planar import to_planar
    from mtpserve.quant.types import GGMLType

    def case(rows: int, planar: bool, kernel: str | None = None) -> Case:
        """GGUF blocks through the float kernel; planar rows (the GPU path's) through the int8 kernel the device
        takes (tl.dot's on sm_80+, mma.sync's on sm_75: the query rounded to q8_0, PV in fp16; the twin rounds the
        query alike), or the one `kernel` names: "mma" runs Turing's fragments on any GPU from sm_75, "mma16"
        attention_mma16's fp16 products on sm_80+ (the query not rounded; below sm_80 the float kernel runs)."""

        def run() -> Comparison:
            gen = _gen(device, 5)
            S, D = s.context, s.head_dim
            k_cache = random_blocks(GGMLType.Q8_0, S, s.n_head_kv * D, device, gen)
            v_cache = random_blocks(GGMLType.Q8_0, S, s.n_head_kv * D, device, gen)
            if planar:
                k_cache, v_cache = (to_planar(c, s.n_head_kv) for c in (k_cache, v_cache))
            q = _randn(gen, rows, s.n_head, D) * 30  # q8_0 cells of ~1e-2: logits of a few units
            q_pos = torch.arange(S - rows, S, device=device)
            k_pos = torch.arange(S, device=device)
            args = (q, k_cache, v_cache, int(GGMLType.Q8_0), int(GGMLType.Q8_0), q_pos, k_pos)
            taken = planar and planar_kernel(  # the pass 1 decode_attention takes: rounds the query unless mma16
                device, GGMLType.Q8_0, GGMLType.Q8_0, D, True, None, kernel, None, rows * s.n_head // s.n_head_kv
            )
            int8 = taken in ("dot", "mma")
            choice = {"int8_kernel": kernel} if kernel else {}
            got = kernels().decode_attention(
                *args, n_kv_heads=s.n_head_kv, head_dim=D, scale=D**-0.5, planar=planar, **choice
            )
            want = decode_attention_reference(*args, n_kv_heads=s.n_head_kv, scale=D**-0.5, planar=planar, round_q=int8)
            fp16 = bool(taken)  # fp16 operands in every planar kernel
            return Comparison((got,), (want,), "float16" if fp16 else "tf32x3" if device.type == "cuda" else "float32")

        layout = ("planar q8_0" if planar else "q8_0") + (f" ({kernel} kernel)" if kernel else "")
        return Case(
            f"decode_attention {layout} cache {s.context} cells H={s.n_head}/{s.n_head_kv} D={s.head_dim} T={rows}",
            run,
        )

    return [
        case(1, False),
        case(3, False),
        case(1, True),
        case(3, True),
        case(1, True, "mma"),
        case(3, True, "mma"),
        case(1, True, "mma16"),
        case(3, True, "mma16"),
    ]


def _delta_inputs(s: Shapes, gen: torch.Generator, tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normalised), v, g (log decay), beta, state of one sequence of `tokens` tokens, batch-first."""
    q = F.normalize(_randn(gen, 1, tokens, s.n_k_heads, s.ssm_dim), dim=-1)
    k = F.normalize(_randn(gen, 1, tokens, s.n_k_heads, s.ssm_dim), dim=-1)
    v = _randn(gen, 1, tokens, s.n_v_heads, s.ssm_dim)
    g = -F.softplus(_randn(gen, 1, tokens, s.n_v_heads))
    beta = torch.sigmoid(_randn(gen, 1, tokens, s.n_v_heads))
    return q, k, v, g, beta, _randn(gen, 1, s.n_v_heads, s.ssm_dim, s.ssm_dim) * 0.1


@smoke_case("gated_delta_rule_recurrent_batched")
def _gated_delta_recurrent(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.gated_delta import gated_delta_rule_recurrent

    def case(tokens: int) -> Case:
        def run() -> Comparison:
            q, k, v, g, beta, state = _delta_inputs(s, _gen(device, 6), tokens)
            want_o, want_states = gated_delta_rule_recurrent(
                q[0], k[0], v[0], g[0], beta[0], state[0], return_states=True
            )
            steps = torch.empty(1, tokens, *state.shape[1:], device=device)
            got_o = kernels().gated_delta_rule_recurrent_batched(q, k, v, g, beta, state, state_steps=steps)
            return Comparison((got_o[0], steps[0], state[0]), (want_o, want_states, want_states[-1]), "float32")

        return Case(
            f"gated_delta_rule_recurrent_batched Hk={s.n_k_heads} Hv={s.n_v_heads} K=V={s.ssm_dim} T={tokens}", run
        )

    return [case(1), case(3)]


@smoke_case("gdn_decode_inputs")
def _gdn_decode_inputs(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.gated_delta import gdn_decode_inputs_reference

    def case(tokens: int) -> Case:
        def run() -> list[Comparison]:
            gen = _gen(device, 8)
            C, W = 2 * s.n_k_heads * s.ssm_dim + s.n_v_heads * s.ssm_dim, 4
            mixed = _randn(gen, 1, tokens, C + 7)[..., 3 : 3 + C]  # a column slice of the projection: strided rows
            conv_weight, conv_state = _randn(gen, C, W) * 0.5, _randn(gen, 1, C, W - 1)
            heads = {"n_k_heads": s.n_k_heads, "head_k": s.ssm_dim, "head_v": s.ssm_dim, "eps": 1e-6}
            want_state = conv_state.clone()
            want = gdn_decode_inputs_reference(mixed, conv_weight, want_state, **heads)
            got = kernels().gdn_decode_inputs(mixed, conv_weight, conv_state, **heads)
            return [Comparison((got,), (want,), "float32"), Comparison((conv_state,), (want_state,), "exact")]

        return Case(f"gdn_decode_inputs C={2 * s.n_k_heads * s.ssm_dim + s.n_v_heads * s.ssm_dim} W=4 T={tokens}", run)

    return [case(1), case(3)]


@smoke_case("gated_delta_decode")
def _gated_delta_decode(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.gated_delta import gated_delta_decode_reference

    def case(tokens: int) -> Case:
        def run() -> list[Comparison]:
            gen = _gen(device, 9)
            q, k, v, _, _, state = _delta_inputs(s, gen, tokens)
            Hv, V = s.n_v_heads, s.ssm_dim
            proj = _randn(gen, 1, tokens, Hv * V + 2 * Hv)  # z | beta | alpha, as the layer's projection lays them
            gates = {
                "alpha": proj[..., Hv * V + Hv :] * 3,
                "beta": proj[..., Hv * V : Hv * V + Hv],
                "z": proj[..., : Hv * V].unflatten(-1, (Hv, V)),
            }
            consts = {"dt_bias": _randn(gen, Hv) * 10, "a": -torch.rand(Hv, device=device, generator=gen) * 2}
            consts |= {"norm_weight": _randn(gen, V), "eps": 1e-6}
            want_state = state.clone()
            want = gated_delta_decode_reference(q=q, k=k, v=v, state=want_state, **gates, **consts)
            got = kernels().gated_delta_decode(q, k, v, gates["alpha"], gates["beta"], gates["z"], state, **consts)
            return [Comparison((got,), (want,), "float32"), Comparison((state,), (want_state,), "float32")]

        return Case(f"gated_delta_decode Hk={s.n_k_heads} Hv={s.n_v_heads} K=V={s.ssm_dim} T={tokens}", run)

    return [case(1), case(3)]


@smoke_case("norm_rope_store")
def _norm_rope_store(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.rope import norm_rope_store_reference, rope_cos_sin
    from mtpserve.quant.types import GGMLType, block_geometry

    def case(tokens: int) -> Case:
        def run() -> list[Comparison]:
            gen = _gen(device, 10)
            H, n_kv, D = s.n_head, s.n_head_kv, s.head_dim
            positions = torch.arange(s.context - tokens, s.context, device=device)
            cos, sin = rope_cos_sin(positions.cpu(), D // 4, 1e7)  # the 27B rotates a quarter of each head
            x = {"q": _randn(gen, tokens, H, 2, D)[:, :, 0] * 3, "k": _randn(gen, tokens, n_kv, D) * 2}
            x |= {"v": _randn(gen, tokens, n_kv, D), "cos": cos.to(device), "sin": sin.to(device)}
            x |= {"cells": positions.clone(), "positions": positions}
            norms = {"q_norm": 1 + _randn(gen, D).abs(), "k_norm": 1 + _randn(gen, D).abs(), "eps": 1e-6}
            block, size = block_geometry(GGMLType.Q8_0)
            outs = []
            for fn in (kernels().norm_rope_store, norm_rope_store_reference):
                k_store = torch.zeros(s.context, n_kv * D // block * size, dtype=torch.uint8, device=device)
                v_store, cell_pos = k_store.clone(), torch.full((s.context,), -1, dtype=torch.long, device=device)
                q8 = int(GGMLType.Q8_0)
                q = fn(*x.values(), k_store, v_store, q8, q8, cell_pos, **norms)
                outs.append((q, k_store, v_store, cell_pos))
            got, want = outs
            return [Comparison(got[:1], want[:1], "float32"), Comparison(got[1:], want[1:], "exact")]

        return Case(f"norm_rope_store H={s.n_head}/{s.n_head_kv} D={s.head_dim} q8_0 cache T={tokens}", run)

    return [case(1), case(3)]


@smoke_case("gated_delta_chunk_scan")
def _gated_delta_chunk_scan(s: Shapes, device: torch.device) -> list[Case]:
    from mtpserve.ops.gated_delta import gated_delta_chunk_scan_reference

    if not kernels().chunk_scan_supported(device, s.chunk, s.ssm_dim):
        return []  # below sm_80 the chunk scan is PyTorch's loop: listed as uncovered

    def run() -> Comparison:
        gen = _gen(device, 7)
        Hv, n, C, K = s.n_v_heads, s.prompt // s.chunk, s.chunk, s.ssm_dim
        u, w = _randn(gen, Hv, n, C, K), _randn(gen, Hv, n, C, K) / K
        q, k = _randn(gen, Hv, n, C, K) / K, _randn(gen, Hv, n, C, K) / K**0.5
        qk = (_randn(gen, Hv, n, C, C) / C).tril()
        g_cum = (-0.05 * torch.rand(Hv, n, C, device=device, generator=gen)).cumsum(-1)
        state = _randn(gen, Hv, K, K)
        want_state = state.clone()
        want = gated_delta_chunk_scan_reference(u, w, q, k, qk, g_cum, want_state)
        got = kernels().gated_delta_chunk_scan(u, w, q, k, qk, g_cum, state)
        return Comparison((got, state), (want, want_state), gemm_dtype(device))

    return [Case(f"gated_delta_chunk_scan Hv={s.n_v_heads} {s.prompt} tokens in chunks of {s.chunk}", run)]


def _tiny_model(device: torch.device):
    """A small random model of bench/gpu.py's tiny Qwen3.6 shapes, 4 layers."""
    from mtpserve.models.base import WeightStore
    from mtpserve.models.loader import build_model

    config = replace(TINY, n_layer=4)
    return build_model(WeightStore(random_weights(config, device), device), config)


def _decode_logits(model, prompt: list[int], steps: int, graphed: bool, fed: list[int] | None = None) -> tuple:
    """([steps, vocab] logits, the tokens fed) of decode steps after `prompt` (a q8_0 cache), from a DecodeGraph
    (captured on the second call, replayed from the third; eager off CUDA) or the model's own step: `fed` given,
    those tokens, else greedy from token 5."""
    from mtpserve.models.graphs import DecodeGraph

    state = model.new_state(64, "q8_0", "q8_0")
    model.prefill(prompt, state)
    step = DecodeGraph(model, state).decode if graphed else (lambda token: model.decode(token, state))
    logits, tokens = [], list(fed or [])
    for i in range(steps):
        if fed is None:
            tokens.append(5 if i == 0 else int(logits[-1].argmax()))
        logits.append(step(tokens[i]).float().clone())
    return torch.stack(logits), tokens


def graph_case(device: torch.device) -> Case:
    """The small model's decode step eager and from a DecodeGraph over the same prompt, four tokens."""

    def run() -> Comparison:
        model = _tiny_model(device)
        prompt = torch.randint(0, model.config.n_vocab, (4,), generator=torch.Generator().manual_seed(8)).tolist()
        want, tokens = _decode_logits(model, prompt, 4, graphed=False)
        got, _ = _decode_logits(model, prompt, 4, graphed=True, fed=tokens)  # the eager step's tokens
        return Comparison((got,), (want,), "float32")

    how = "captured and replayed" if device.type == "cuda" else "static step, eager off CUDA"
    return Case(f"CUDA graph: tiny model's decode step {how} vs eager, 4 tokens", run)


def pdl_graph_case(device: torch.device) -> Case:
    """The small model's decode graph captured with programmatic dependent launch (kernels/triton/pdl.py) against
    one captured without, over the same prompt, eight tokens: the same kernels in the same order, so bit for bit, or
    a kernel reads what the one before it is still writing."""

    def run() -> Comparison:
        from mtpserve.kernels.triton import pdl

        model = _tiny_model(device)
        prompt = torch.randint(0, model.config.n_vocab, (4,), generator=torch.Generator().manual_seed(9)).tolist()
        want, tokens = _decode_logits(model, prompt, 8, graphed=True)
        pdl.ENABLED = True
        try:
            got, _ = _decode_logits(model, prompt, 8, graphed=True, fed=tokens)
        finally:
            pdl.ENABLED = False
        return Comparison((got,), (want,), "exact")

    return Case("CUDA graph: tiny model's decode step with programmatic dependent launch vs without, 8 tokens", run)


def errors(c: Comparison) -> tuple[float, float]:
    """(largest absolute error, largest error over the twin's largest magnitude) over all outputs; inf on a shape
    mismatch or a non-finite value."""
    worst_abs, worst_rel = 0.0, 0.0
    for got, want in zip(c.got, c.want, strict=True):
        if got.shape != want.shape:
            return math.inf, math.inf
        diff = (got.float() - want.float().to(got.device)).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if not math.isfinite(err):
            return math.inf, math.inf
        scale = float(want.float().abs().max()) if want.numel() else 0.0
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / scale if scale > 0 else err)
    return worst_abs, worst_rel


def run_case(case: Case, device: torch.device) -> bool:
    """Runs one case and prints its line (its worst comparison: the largest error for its tolerance); whether it
    passed."""
    t0 = time.perf_counter()
    try:
        result = case.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        checks = [(c, *errors(c)) for c in (result if isinstance(result, list) else [result])]
    except Exception:  # noqa: BLE001 - the case's failure is its FAIL line, the run goes on
        print(f"FAIL {case.label}: raised after {time.perf_counter() - t0:.1f} s", flush=True)
        print("     " + traceback.format_exc().replace("\n", "\n     ").rstrip(), flush=True)
        return False

    def excess(check: tuple[Comparison, float, float]) -> float:
        tol, rel = TOLERANCE[check[0].dtype], check[2]
        return rel / tol if tol > 0 else (math.inf if rel > 0 else 0.0)

    worst = max(checks, key=excess)
    c, abs_err, rel_err = worst
    ok = all(excess(check) <= 1 for check in checks)
    print(
        f"{'PASS' if ok else 'FAIL'} {case.label}: max abs {abs_err:.3g}, max rel {rel_err:.3g} "
        f"(tolerance {TOLERANCE[c.dtype]:g}, {c.dtype}) {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return ok


def plan(shapes: Shapes, device: torch.device) -> tuple[list[Case], list[str]]:
    """The cases for every exported wrapper that has a builder, and SKIP lines for the rest."""
    module = kernels()
    exported = [n for n in getattr(module, "__all__", dir(module)) if callable(getattr(module, n, None))]
    cases, skips = [], []
    for name in exported:
        if name in NOT_KERNELS or name[0].isupper():
            continue
        if name not in SMOKE:
            skips.append(f"SKIP {name}: exported by mtpserve.kernels.triton but no smoke case is registered")
            continue
        built = SMOKE[name](shapes, device)
        cases += built
        if not built:
            skips.append(f"SKIP {name}: not run on this device ({device_name(device)})")
    skips += [f"SKIP {name}: not exported by mtpserve.kernels.triton" for name in SMOKE if name not in exported]
    return cases, skips


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU, Triton interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    branches = cuda_capability(device)
    as_older = "" if branches == (major, minor) else f", its branches as sm_{branches[0]}{branches[1]}'s"
    return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}{as_older}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (the wiring: CPU under TRITON_INTERPRET=1)")
    p.add_argument("--pdl", action="store_true", help="also the decode graph with programmatic dependent launch")
    p.add_argument("--only", default="", help="run only the cases whose label contains one of these texts (a,b,...)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("SKIP all: no CUDA device", flush=True)
        return 0
    emulation = None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "bench/gpu_smoke.py: on CPU, set TRITON_INTERPRET=1 (the kernels under the interpreter)",
                file=sys.stderr,
            )
            return 2
        from mtpserve.ops.device import emulate_gpu

        emulation = emulate_gpu(matmul="torch")  # the graph case's matmuls on their twins: the kernels are cased apart
        emulation.__enter__()
    shapes = TINY_SHAPES if args.tiny else QWEN36_27B
    print(f"gpu_smoke: {device_name(device)}, torch {torch.__version__}, shapes {shapes}", flush=True)
    cases, skips = plan(shapes, device)
    cases.append(graph_case(device))
    if not args.pdl:  # its kernels compile afresh: the smoke stage's time; bench/gpu.py --pdl checks the 27B's
        skips.append("SKIP programmatic dependent launch: --pdl (bench/gpu.py --pdl holds it at the 27B's shapes)")
    elif device.type == "cuda" and cuda_capability(device) >= (9, 0):
        cases.append(pdl_graph_case(device))
    else:
        skips.append(f"SKIP programmatic dependent launch: sm_90+ only ({device_name(device)})")
    for line in skips:
        print(line, flush=True)
    wanted = [c for c in cases if any(text in c.label for text in args.only.split(","))]
    failed = [c.label for c in wanted if not run_case(c, device)]
    if emulation is not None:
        emulation.__exit__(None, None, None)
    print(f"gpu_smoke: {len(failed)} failed of {len(wanted)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
