"""Compile the Triton kernels for real NVIDIA GPUs without one: `python tests/support/gpu_compile.py [--arch 90,80,75]`.

The kernels' tests run under TRITON_INTERPRET=1, which is lenient: a kernel can pass there and still fail to
compile for a GPU (tl.dot operand types or shapes, unsupported casts) or spill registers. This script runs
Triton's whole ahead-of-time pipeline (ttir -> ttgir -> llir -> PTX -> cubin by the ptxas bundled with triton)
for each requested compute capability, with no GPU and no CUDA driver, and prints one line per compile:
kernel, configuration, arch, ok/FAILED, registers a thread, spill bytes (stores + loads, from `ptxas -v`) and
shared memory. It exits 1 if any compile fails, or if a kernel would be refused at load time on that arch (more
shared memory than a block may have, or more registers than a block of num_warps can hold).

Which configurations: the ones the wrappers (quant_gemv, dequant_blocks, quant_matmul, decode_attention,
gated_delta_rule_recurrent_batched, gated_delta_chunk_scan) launch at the deployment's shapes (Qwen3.6-27B:
n_embd 5120, attention H=24 Hkv=4 D=256, Gated DeltaNet Hk=16 Hv=48 K=V=128, prompt chunks of 512 tokens;
SmolLM2-135M for D=64: H=9 Hkv=3). Nothing is copied from the
wrappers: each wrapper is called on CPU tensors of those shapes (allocated, never read) with its kernels' `run`
swapped for a recorder, and each recorded launch goes through the same specialization as a real one (Triton's
binder: constexprs, dtypes, ints equal to 1, 16-divisibility of pointers and ints). Two choices the wrappers make
from the CUDA device are redone here for the target, as they would be on it: quant_matmul's num_warps (8 below
sm_80) and the chunk scan's bf16 operands.

`--pdl` compiles the decode kernels for sm_90 with programmatic dependent launch on (kernels/triton/pdl.py) and
checks the contract in each PTX: one `griddepcontrol.wait` and one `launch_dependents`, and no global store, and
no global load but the weights' (the prefetching Q4_K/Q5_K GEMV's first step), before the wait.

`--loads` also lists each kernel's global loads by width, read off its PTX (a memory-bound kernel should read in
16-byte vectors, "v4.b32", rather than byte by byte, "b8").

TRITON_INTERPRET must not be set when compiling (triton.jit makes interpreter functions then): the script
re-executes itself without it. `--quick` compiles one configuration per kernel for sm_90 (the test suite's
check, about 5 s); `--only TEXT` keeps the configurations whose kernel or label contain TEXT. The full run
(about 510 compiles) takes about 190 s on 2 cores. `--arch 86,89` checks the RTX 30xx/40xx parts, whose blocks
have 99 KB of shared memory against the A100's 163 KB. Uses triton internals (the JIT binder, ASTSource,
triton.compile with a GPUTarget) as of triton 3.9, and runs on 3.6 too (the lent H200's version).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "TRITON_INTERPRET" in os.environ:  # before anything imports triton
    os.environ.pop("TRITON_INTERPRET")
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

import argparse
import contextlib
import io
import itertools
import multiprocessing
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from unittest import mock

ARCHS = (90, 80, 75)
# cudaDevAttrMaxSharedMemoryPerBlockOptin, what Triton compares a kernel's shared memory with before loading it.
MAX_SHARED = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
REGISTERS_PER_SM_BLOCK = 65536  # 32-bit registers a block may use, sm_75..sm_90

# Deployment shapes (../shared/spec/qwen35-architecture.md: Qwen3.6-27B).
N_EMBD = 5120
QKV_ROWS = 10240  # the GDN attn_qkv projection: [10240, 5120]
PROMPT_ROWS = 512  # a prompt chunk through the GEMM
CACHE_CELLS = 4096
GDN_HK, GDN_HV, GDN_DIM = 16, 48, 128
ATTN_SHAPES = {256: (24, 4), 64: (9, 3)}  # head dim -> (H, Hkv): Qwen3.6-27B, SmolLM2-135M


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function and the arguments the wrapper passed it."""

    kernel: str
    config: str
    fn: object
    args: tuple
    kwargs: dict
    min_arch: int = 0  # bf16 needs sm_80
    quick: bool = False
    note: str = ""
    fixups: list[Callable[[dict, int], None]] = field(default_factory=list)
    rows: int | None = None  # activation rows (decode 1, verification n_max + 1) where that is a kernel's shape
    # Weight (or KV) bytes one program reads per iteration of its hot loop: with the SASS instructions of that loop,
    # the kernel's instruction-issue bound (bench/gpu_static.py). None where no loop streams memory.
    bytes_per_iteration: int | None = None
    decode: bool = False  # launched by a decode or verification step (bench/gpu_static.py reports these)
    pdl: bool = False  # recorded with programmatic dependent launch on: its PTX must keep the contract

    @property
    def loop_without_shared(self) -> bool:
        """Whether its K loop must not touch shared memory: the K-quant and Q6_K GEMVs, laid out alike under each
        Triton (intwords' lane vectors, Q6_K's flat tiles), where their [rows, lanes, ...] tensors converted a
        layout through shared memory each step under the lent image's Triton 3.6."""
        return getattr(self.fn, "__name__", "") in ("_kquant_kernel", "_q6k_kernel")

    @property
    def loop_without_byte_loads(self) -> bool:
        """Whether its key loop must not load global memory a byte at a time: the int8 decode attention, whose K and
        V loads were 8-bit at D = 64 and 128 while Triton took their 68- and 136-byte head rows as unaligned."""
        return getattr(self.fn, "__name__", "") == "_split_int8_kernel"

    @property
    def loop_store_limit(self) -> int | None:
        """The most shared-memory stores its key loop may hold, or None: the int8 decode attention at D >= 128 stores
        its fp16 V tile (and P) for the PV dot in 16-byte stores: 11-14 a tile under Triton 3.9, 15-22 under 3.6
        (sm_90, sm_80), where 3.6 stored 71-78 while V's scales were loaded as [keys, blocks] pointers."""
        if getattr(self.fn, "__name__", "") == "_split_int8_kernel" and self.kwargs.get("D", 0) >= 128:
            return 32
        return None


def _recorded(fn, call: Callable[[], object]) -> list[tuple[object, tuple, dict]]:
    """The launches `call` makes, by any of the kernels in fn (a list), without running them."""
    seen: list[tuple[object, tuple, dict]] = []
    saved = {id(f): f.__dict__.get("run") for f in fn}
    try:
        for f in fn:

            def run(*args, grid, warmup, _f=f, **kwargs):
                seen.append((_f, args, kwargs))

            f.run = run  # JITFunction.__getitem__ calls self.run: the instance attribute shadows the method
        call()
    finally:
        for f in fn:
            if saved[id(f)] is None:
                del f.run
            else:
                f.run = saved[id(f)]
    return seen


def _gemm_num_warps(kwargs: dict, arch: int) -> None:
    """quant_matmul's num_warps on a CUDA device of this arch (its `_num_warps` asks the device)."""
    import torch

    from mtpserve.kernels.triton import gemm

    with mock.patch.object(torch.cuda, "get_device_capability", return_value=(arch // 10, arch % 10)):
        kwargs["num_warps"] = gemm._num_warps(torch.device("cuda", 0))


def _chunk_scan_dot(kwargs: dict, arch: int) -> None:
    """gated_delta_chunk_scan's tl.dot operand type on CUDA (kernels.triton.gated_delta.default_dot_dtype)."""
    import triton.language as tl

    kwargs["DOT"] = tl.bfloat16


def pdl_problems(ptx: str, weight_loads: int = 0) -> list[str]:
    """What breaks the PDL contract in a kernel's PTX: the wait and the trigger each once, and before the wait no
    global store and at most `weight_loads` global loads (kernels.triton.pdl)."""
    waits = [m.start() for m in re.finditer(r"\bgriddepcontrol\.wait\b", ptx)]
    triggers = re.findall(r"\bgriddepcontrol\.launch_dependents\b", ptx)
    if len(waits) != 1 or len(triggers) != 1:
        return [f"{len(waits)} griddepcontrol.wait and {len(triggers)} launch_dependents (want one each)"]
    before = ptx[: waits[0]]
    problems = []
    stores = len(re.findall(r"\b(?:st|red|atom)\.global\b", before))
    loads = len(re.findall(r"\bld\.global\b", before))
    if stores:
        problems.append(f"{stores} global stores before griddepcontrol.wait")
    if loads > weight_loads:
        problems.append(f"{loads} global loads before griddepcontrol.wait (the weights' allow {weight_loads})")
    return problems


def launches() -> list[Launch]:
    """Every configuration to compile, recorded from the wrappers at the deployment's shapes."""
    import torch
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q

    from mtpserve.kernels.triton import (
        attention,
        attention_int8,
        attention_mma,
        attention_mma16,
        gated_delta,
        gemm,
        gemv,
    )

    out: list[Launch] = []

    def weight(t: Q, rows: int = QKV_ROWS, cols: int = N_EMBD) -> torch.Tensor:
        qk, size = GGML_QUANT_SIZES[t]
        return torch.empty(rows, cols // qk * size, dtype=torch.uint8)

    # The float GEMV, 8 rows a launch: decode and verification of the types without an integer GEMV (ops.linear_gpu
    # INTEGER_GEMV_TYPES, the "gemv_q8" launches below); the others' GEMM-sized tails.
    from mtpserve.ops.linear_gpu import INTEGER_GEMV_TYPES

    kernels = [gemv._gemv_kernel, gemv._q4k_gemv_kernel, gemv._q6k_gemv_kernel]
    for t in gemv.GEMV_TYPES:
        w = weight(t)
        for m in (1, 4):
            x = torch.empty(m, N_EMBD)
            for wide in (True, False) if t in (Q.Q4_K, Q.Q6_K) else (True,):
                ((f, a, k),) = _recorded(
                    kernels, lambda x=x, w=w, t=t, wide=wide: gemv.quant_gemv(x, w, t, wide_words=wide)
                )
                words = f" words BLOCK_B={k['BLOCK_B']}" if "BLOCK_B" in k else ""
                cfg = f"{t.name}{words} M={m} M_PAD={k['M_PAD']} BLOCK_N={k['BLOCK_N']}"
                # one step of the loop over K: BLOCK_B super-blocks of BLOCK_N rows (word kernels), else one block
                per_step = k["BLOCK_N"] * k.get("BLOCK_B", 1) * GGML_QUANT_SIZES[t][1]
                quick = t == Q.Q4_K and m == 1 and wide
                decode = int(t) not in {int(i) for i in INTEGER_GEMV_TYPES}
                out.append(
                    Launch("gemv", cfg, f, a, k, quick=quick, rows=m, bytes_per_iteration=per_step, decode=decode)
                )
    # dequant_blocks: the prefill path below sm_80 (dequantize straight to fp16, then cuBLAS).
    for t in (Q.Q4_K, Q.Q6_K):
        w = weight(t)
        ((f, a, k),) = _recorded(
            [gemv._dequant_kernel], lambda w=w, t=t: gemv.dequant_blocks(w, t, dtype=torch.float16)
        )
        out.append(Launch("dequant", f"{t.name} BLOCK_N={k['BLOCK_N']}", f, a, k, quick=t == Q.Q6_K))
    # Prefill: quant_matmul, float32 activations; bf16 compute from sm_80 (ops.gemm_compute_dtype), fp16 on all.
    for t in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS):
        w = weight(t)
        x = torch.empty(PROMPT_ROWS, N_EMBD)
        for dtype, min_arch in ((torch.bfloat16, 80), (torch.float16, 0)):
            ((f, a, k),) = _recorded(
                [gemm._gemm_kernel], lambda x=x, w=w, t=t, d=dtype: gemm.quant_matmul(x, w, t, compute_dtype=d)
            )
            cfg = f"{t.name} {str(dtype)[6:]} M={PROMPT_ROWS} {k['BLOCK_M']}x{k['BLOCK_N']}"
            note = "ops.quant_linear uses dequant + cuBLAS below sm_80" if dtype == torch.float16 else ""
            out.append(
                Launch(
                    "gemm",
                    cfg,
                    f,
                    a,
                    k,
                    min_arch,
                    quick=t == Q.Q4_K and dtype == torch.bfloat16,
                    note=note,
                    fixups=[_gemm_num_warps],
                )
            )
    # Decode / verification attention over the KV cache as stored; pass 2 (combine) comes with each call.
    combines: dict[str, tuple] = {}
    # q8_0 as the GPU path stores it (planar): the int8 tensor-core kernel from sm_80, its mma.sync twin from sm_75
    # (the Turing cards' default), the float kernel.
    paths = (
        ("planar int8", None, "dot", 80),
        ("planar mma", None, "mma", 75),
        ("planar mma16", None, "mma16", 80),
        ("planar", False, None, 0),
    )
    for kv in ((Q.Q8_0, Q.Q8_0), (Q.F16, Q.F16), (Q.Q4_0, Q.Q4_0)):
        for d, (h, hkv) in ATTN_SHAPES.items():
            caches = []
            for t in kv:
                if t == Q.F16:
                    caches.append(torch.empty(CACHE_CELLS, hkv, d, dtype=torch.float16))
                else:
                    qk, size = GGML_QUANT_SIZES[t]
                    caches.append(torch.empty(CACHE_CELLS, hkv * d // qk * size, dtype=torch.uint8))
            k_pos = torch.arange(CACHE_CELLS)
            for (path, int8_qk, kernel, min_arch), n_tok, window in itertools.product(
                paths if kv[0] == Q.Q8_0 else (("", False, None, 0),), (1, 3), (None, 1024)
            ):
                q = torch.empty(n_tok, h, d)
                q_pos = torch.arange(n_tok) + CACHE_CELLS - n_tok
                choice = {"int8_qk": int8_qk, "int8_kernel": kernel}
                rec = _recorded(
                    [
                        attention._split_kernel,
                        attention_int8._split_int8_kernel,
                        attention_mma._split_mma_kernel,
                        attention_mma16._split_mma16_kernel,
                        attention._combine_kernel,
                    ],
                    lambda q=q, c=caches, kv=kv, q_pos=q_pos, k_pos=k_pos, hkv=hkv, d=d, window=window, choice=choice: (
                        attention.decode_attention(
                            q,
                            *c,
                            *kv,
                            q_pos,
                            k_pos,
                            n_kv_heads=hkv,
                            head_dim=d,
                            scale=d**-0.5,
                            window=window,
                            ordered=window is None,
                            planar=kv[0] == Q.Q8_0,
                            **choice,
                        )
                    ),
                )
                *splits, (cf, ca, ck) = rec  # pass 1 a launch per row block size, then pass 2
                quick = kv[0] == Q.Q8_0 and d == 256 and n_tok == 1 and window is None
                # a K tile and a V tile of BLOCK_S keys of one KV head a step
                head_bytes = [c.shape[1] // hkv if c.dtype == torch.uint8 else d * c.element_size() for c in caches]
                for f, a, k in splits:
                    groups = k.get("WARPS", k.get("GROUPS"))  # 8-row groups: attention_mma's warps, mma16's groups
                    keys = 8 * k["NT"] if "NT" in k else 16 * k["KB"] if "KB" in k else k["BLOCK_S"]
                    rows = 8 * groups if groups else k["BLOCK_M"]
                    cfg = (
                        f"K={kv[0].name} V={kv[1].name}{' ' + path if path else ''} D={d} H={h} Hkv={hkv} "
                        f"T={n_tok} window={window} BLOCK_M={rows} BLOCK_S={keys} warps={k['num_warps']}"
                    )
                    tiles = keys * sum(head_bytes)
                    out.append(
                        Launch(
                            "attn_split",
                            cfg,
                            f,
                            a,
                            k,
                            min_arch,
                            quick=quick,
                            rows=n_tok,
                            bytes_per_iteration=tiles,
                            decode=True,
                        )
                    )
                combines.setdefault(f"D={d} T={n_tok} H={h}", (cf, ca, ck, quick, n_tok))
    # A verification's 18 rows in one 32-row block (bench/attention_gpu.py's "m32" choices; not the default): the
    # tensor-core operands, from sm_80 (float32 FMAs spill there; below sm_80 fp16 dots are FMAs too).
    h, hkv = ATTN_SHAPES[256]
    qk, size = GGML_QUANT_SIZES[Q.Q8_0]
    cache = torch.empty(CACHE_CELLS, hkv * 256 // qk * size, dtype=torch.uint8)
    q, q_pos, k_pos = torch.empty(3, h, 256), torch.arange(3) + CACHE_CELLS - 3, torch.arange(CACHE_CELLS)
    for precision in ("tf32", "fp16", "bf16"):
        (f, a, k), _ = _recorded(
            [attention._split_kernel, attention._combine_kernel],
            lambda p=precision: attention.decode_attention(
                q, cache, cache, Q.Q8_0, Q.Q8_0, q_pos, k_pos, n_kv_heads=hkv, head_dim=256, scale=256**-0.5,
                ordered=True, precision=p, min_keys=64, block_m=32,
            ),
        )  # fmt: skip
        cfg = f"K=Q8_0 V=Q8_0 D=256 H={h} Hkv={hkv} T=3 BLOCK_M=32 {precision} warps={k['num_warps']}"
        out.append(Launch("attn_split", cfg, f, a, k, 80, rows=3, note="block_m=32: a bench choice, not the default"))
    for cfg, (cf, ca, ck, quick, n_tok) in combines.items():
        out.append(
            Launch("attn_combine", f"{cfg} CHUNK={ck['CHUNK']}", cf, ca, ck, quick=quick, rows=n_tok, decode=True)
        )
    # Gated DeltaNet recurrence: q, k L2-normalised (contiguous), v a slice of the conv output, g/beta [B, T, Hv].
    for n_seq, n_tok, steps in ((1, 1, False), (1, 3, False), (1, 3, True), (4, 3, True)):
        key_dim = GDN_HK * GDN_DIM
        u = torch.empty(n_seq, n_tok, 2 * key_dim + GDN_HV * GDN_DIM)
        q = torch.empty(n_seq, n_tok, GDN_HK, GDN_DIM)
        k = torch.empty(n_seq, n_tok, GDN_HK, GDN_DIM)
        v = u[..., 2 * key_dim :].reshape(n_seq, n_tok, GDN_HV, GDN_DIM)
        g = torch.empty(n_seq, n_tok, GDN_HV)
        beta = torch.empty(n_seq, n_tok, GDN_HV)
        state = torch.empty(n_seq, GDN_HV, GDN_DIM, GDN_DIM)
        st = torch.empty(n_seq, n_tok, GDN_HV, GDN_DIM, GDN_DIM) if steps else None
        ((f, a, kw),) = _recorded(
            [gated_delta._gated_delta_kernel],
            lambda q=q, k=k, v=v, g=g, beta=beta, state=state, st=st: gated_delta.gated_delta_rule_recurrent_batched(
                q, k, v, g, beta, state, state_steps=st
            ),
        )
        cfg = f"K=V={GDN_DIM} B={n_seq} T={n_tok} STORE_STEPS={steps} BLOCK_V={kw['BLOCK_V']}"
        # The state is read before the loop over tokens and written after it; only the kept per-token states stream.
        stored = GDN_DIM * kw["BLOCK_V"] * 4 if steps else None
        quick = steps and n_seq == 1
        rows = n_seq * n_tok
        out.append(
            Launch("gated_delta", cfg, f, a, kw, quick=quick, rows=rows, bytes_per_iteration=stored, decode=True)
        )
    # The chunked rule's scan over a prompt chunk of PROMPT_ROWS tokens (ops.gated_delta: chunks of 64).
    n_chunks, chunk = PROMPT_ROWS // 64, 64
    for store in (False, True):
        kq = [torch.empty(GDN_HV, n_chunks, chunk, GDN_DIM) for _ in range(4)]  # u, w, q, k (K = V)
        qk = torch.empty(GDN_HV, n_chunks, chunk, chunk)
        g_cum = torch.empty(GDN_HV, n_chunks, chunk)
        state = torch.empty(GDN_HV, GDN_DIM, GDN_DIM)
        states = torch.empty(n_chunks, GDN_HV, GDN_DIM, GDN_DIM) if store else None
        ((f, a, kw),) = _recorded(
            [gated_delta._chunk_scan_kernel],
            lambda kq=kq, qk=qk, g_cum=g_cum, state=state, states=states: gated_delta.gated_delta_chunk_scan(
                *kq, qk, g_cum, state, chunk_states=states
            ),
        )
        cfg = f"K=V={GDN_DIM} N={n_chunks} C={chunk} STORE_STATES={store} BLOCK_V={kw['BLOCK_V']}"
        note = "below sm_80 ops.gated_delta keeps PyTorch's chunk loop"
        out.append(Launch("gdn_chunk_scan", cfg, f, a, kw, 80, quick=not store, note=note, fixups=[_chunk_scan_dot]))
    # Decode matmul inputs in one launch (kernels.triton.rowwise): add + RMSNorm + Q8_K, Q8_K / Q8_0 alone, and the
    # gated activations over the gate/up halves of one [M, 2 * n_ff] GEMV output, or over strided gate heads.
    from mtpserve.kernels.triton import rowwise

    n_ff = 17408  # Qwen3.6-27B's feed-forward width
    for m in (1, 3):
        x, res, nw = torch.empty(m, N_EMBD), torch.empty(m, N_EMBD), torch.empty(N_EMBD)
        ((f, a, k),) = _recorded(
            [rowwise._norm_kernel], lambda x=x, r=res, w=nw: rowwise.rms_norm_quantize(x, w, 1e-6, add=r, block=256)
        )
        cfg = f"add Q8_K M={m} K={N_EMBD} CHUNK={k['CHUNK']} warps={k['num_warps']}"
        out.append(Launch("rowwise_norm", cfg, f, a, k, quick=m == 1, rows=m, decode=True))
        for block, q8_1 in ((256, False), (32, False), (32, True)):  # Q8_K, Q8_0, Q8_1 (Q4_1/Q5_1's)
            ((f, a, k),) = _recorded(
                [rowwise._quant_kernel], lambda x=x, b=block, q8_1=q8_1: rowwise.quantize_rows(x, b, q8_1=q8_1)
            )
            cfg = f"block={block}{' q8_1' if q8_1 else ''} M={m} K={N_EMBD} CHUNK={k['CHUNK']}"
            out.append(Launch("rowwise_quant", cfg, f, a, k, rows=m, decode=True))
        gate_up = torch.empty(m, 2 * n_ff)
        for act, block in (("silu", 256), ("gelu_f16", 256)):
            ((f, a, k),) = _recorded(
                [rowwise._glu_kernel],
                lambda g=gate_up[:, :n_ff], u=gate_up[:, n_ff:], act=act, b=block: rowwise.glu_quantize(
                    g, u, act, block=b
                ),
            )
            cfg = f"{act} block={block} M={m} F={n_ff} CHUNK={k['CHUNK']}"
            out.append(Launch("rowwise_glu", cfg, f, a, k, rows=m, decode=True))
        # the attention's output gate: 24 gate heads of 256 read in place between the query heads of one GEMV output
        qg, o = torch.empty(m, 24, 2, 256), torch.empty(m, 24, 256)
        ((f, a, k),) = _recorded(
            [rowwise._glu_kernel], lambda g=qg[:, :, 1], u=o: rowwise.glu_quantize(g, u, "sigmoid", block=256)
        )
        cfg = f"sigmoid heads 24x256 block=256 M={m} CHUNK={k['CHUNK']}"
        out.append(Launch("rowwise_glu", cfg, f, a, k, rows=m, decode=True))
    # A drawn draft step's sampler chain and its packed row (kernels.triton.chain): one program, the server's default
    # top-k 40 and the draft's confidence over its top 10 (engine.drafters.DRAFT_TOP_K).
    from mtpserve.kernels.triton import chain

    n_top, conf_k = 40, 10
    cand, ids, f32, f64 = (
        torch.empty(n_top),
        torch.zeros(n_top, dtype=torch.long),
        torch.empty(()),
        torch.empty(1).double(),
    )
    ((f, a, k),) = _recorded(
        [chain._draw_row_kernel],
        lambda: chain.draw_row(cand, ids, cand, f32, f64[0], f32, f64, min_keep=0, top_k=conf_k),
    )
    out.append(Launch("draw_row", f"N_TOP={n_top} TOP_K={conf_k} BLOCK={k['BLOCK']}", f, a, k, quick=True, decode=True))
    # The attention input of a full-attention layer (q/k norms, RoPE, K/V into the cache): one launch a cache.
    rope_kv = sys.modules["mtpserve.kernels.triton.rope_kv"]  # the package's `norm_rope_store` shadows nothing
    d, (h, hkv) = 256, ATTN_SHAPES[256]
    for kv_type in (Q.Q8_0, Q.F16, Q.Q4_0):
        if kv_type == Q.F16:
            kv_caches = [torch.empty(CACHE_CELLS, hkv, d, dtype=torch.float16) for _ in range(2)]
        else:
            qk, size = GGML_QUANT_SIZES[kv_type]
            kv_caches = [torch.empty(CACHE_CELLS, hkv * d // qk * size, dtype=torch.uint8) for _ in range(2)]
        for n_tok in (1, 3):
            qg, k, v = torch.empty(n_tok, h, 2, d), torch.empty(n_tok, hkv, d), torch.empty(n_tok, hkv, d)
            cos, pos, norm = torch.empty(n_tok, 32), torch.zeros(n_tok, dtype=torch.long), torch.empty(d)
            ((f, a, kw),) = _recorded(
                [rope_kv._rope_kv_kernel],
                lambda qg=qg, k=k, v=v, cos=cos, pos=pos, norm=norm, c=kv_caches, t=kv_type: rope_kv.norm_rope_store(
                    qg[:, :, 0], k, v, cos, cos, pos, pos, *c, t, t, torch.empty(CACHE_CELLS, dtype=torch.long),
                    q_norm=norm, k_norm=norm, eps=1e-6,
                ),
            )  # fmt: skip
            cfg = f"K=V={kv_type.name} D={d} H={h} Hkv={hkv} n_rot=64 T={n_tok} NB={kw['NB']} warps={kw['num_warps']}"
            quick = kv_type == Q.Q8_0 and n_tok == 1
            out.append(Launch("rope_kv", cfg, f, a, kw, quick=quick, rows=n_tok, decode=True))
    # The fused Gated DeltaNet decode (ops.gated_delta.gated_delta_net_decode_gpu): the glue launch (conv, SiLU,
    # L2-norms) over the projections' column slices of one GEMV output, then the recurrence with the gates and the
    # gated RMSNorm fused. Decode (T=1) without per-token states, verification (T=3) with them.
    widths = (QKV_ROWS, GDN_HV * GDN_DIM, GDN_HV, GDN_HV)  # mixed | z | beta | alpha
    heads, head = torch.empty(GDN_HV), torch.empty(GDN_DIM)  # dt_bias and a; the norm weight
    for n_tok in (1, 3):
        steps = n_tok > 1
        mixed, z, beta, alpha = torch.empty(1, n_tok, sum(widths)).split(widths, dim=2)
        conv_w, conv_state = torch.empty(QKV_ROWS, 4), torch.empty(1, QKV_ROWS, 3)
        conv_steps = torch.empty(1, n_tok, QKV_ROWS, 3) if steps else None
        ((f, a, kw),) = _recorded(
            [gated_delta._gdn_glue_kernel],
            lambda x=mixed, w=conv_w, s=conv_state, st=conv_steps: gated_delta.gdn_decode_inputs(
                x, w, s, n_k_heads=GDN_HK, head_k=GDN_DIM, head_v=GDN_DIM, eps=1e-6, conv_steps=st
            ),
        )
        cfg = f"C={QKV_ROWS} W=4 T={n_tok} STORE_STEPS={steps} BLOCK={kw['BLOCK']} warps={kw['num_warps']}"
        out.append(Launch("gdn_glue", cfg, f, a, kw, quick=not steps, rows=n_tok, decode=True))
        key_dim = GDN_HK * GDN_DIM
        qkv = torch.empty(1, n_tok, QKV_ROWS)
        q, k = (qkv[..., i * key_dim : (i + 1) * key_dim].unflatten(-1, (GDN_HK, GDN_DIM)) for i in (0, 1))
        v = qkv[..., 2 * key_dim :].unflatten(-1, (GDN_HV, GDN_DIM))
        z = z.unflatten(-1, (GDN_HV, GDN_DIM))
        state = torch.empty(1, GDN_HV, GDN_DIM, GDN_DIM)
        st = torch.empty(1, n_tok, GDN_HV, GDN_DIM, GDN_DIM) if steps else None
        ((f, a, kw),) = _recorded(
            [gated_delta._gated_delta_kernel],
            lambda q=q, k=k, v=v, al=alpha, be=beta, z=z, s=state, st=st: gated_delta.gated_delta_decode(
                q, k, v, al, be, z, s, dt_bias=heads, a=heads, norm_weight=head, eps=1e-6, state_steps=st
            ),
        )
        cfg = f"gdn fused gates+norm K=V={GDN_DIM} B=1 T={n_tok} STORE_STEPS={steps} BLOCK_V={kw['BLOCK_V']}"
        cfg += f" warps={kw['num_warps']}"
        out.append(Launch("gated_delta", cfg, f, a, kw, quick=not steps, rows=n_tok, decode=True))
    # Decode / verification over quantized activations (quant_gemv_q8): ffn_down [5120, 17408], attn_qkv [10240, 5120].
    from mtpserve.kernels.triton import gemv_q8

    q8_kernels = [gemv_q8._kquant_kernel, gemv_q8._q6k_kernel, gemv_q8._q8_0_kernel, gemv_q8._iq4xs_kernel]
    q8_kernels.append(gemv_q8._legacy_kernel)  # Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1
    for t in gemv_q8.Q8_GEMV_TYPES:
        for n_rows, n_cols in ((N_EMBD, 17408), (QKV_ROWS, N_EMBD)):
            w = weight(t, n_rows, n_cols)
            for m in (1, 3):
                xq = torch.empty(m, n_cols, dtype=torch.int8)
                xd = torch.empty(m, n_cols // gemv_q8.act_block(t))
                ((f, a, k),) = _recorded(q8_kernels, lambda xq=xq, xd=xd, w=w, t=t: gemv_q8.quant_gemv_q8(xq, xd, w, t))
                cfg = f"{t.name} {n_rows}x{n_cols} M={m} BLOCK_N={k['BLOCK_N']}"
                quick = t == Q.Q4_K and m == 1 and n_rows == N_EMBD
                per_iteration = gemv_q8.bytes_per_iteration(t, k)
                out.append(
                    Launch("gemv_q8", cfg, f, a, k, quick=quick, rows=m, bytes_per_iteration=per_iteration, decode=True)
                )
    # The K-split GEMV (off by default until a lent GPU measures it; the check's bench stage runs it) and the launch
    # that adds its splits, at ffn_down's shape.
    for t in (Q.Q4_K, Q.Q6_K):
        w = weight(t, N_EMBD, 17408)
        for m in (1, 3):
            xq, xd = torch.empty(m, 17408, dtype=torch.int8), torch.empty(m, 17408 // 256)
            rec = _recorded(
                [*q8_kernels, gemv_q8._sum_splits_kernel],
                lambda xq=xq, xd=xd, w=w, t=t: gemv_q8.quant_gemv_q8(xq, xd, w, t, k_splits=4),
            )
            (f, a, k), (sf, sa, sk) = rec
            note = "k_splits=4: off by default"
            cfg = f"{t.name} {N_EMBD}x17408 M={m} BLOCK_N={k['BLOCK_N']} k_splits=4"
            out.append(Launch("gemv_q8", cfg, f, a, k, rows=m, note=note))
            out.append(Launch("gemv_q8_sum", f"M={m} BLOCK={sk['BLOCK']}", sf, sa, sk, rows=m, note=note))
    # The GEMVs that prefetch their weights into L2 two K steps ahead (off by default until a lent GPU measures it).
    for t in gemv_q8.L2_AHEAD_TYPES:
        w = weight(t, N_EMBD, 17408)
        for m in (1, 3):
            xq, xd = torch.empty(m, 17408, dtype=torch.int8), torch.empty(m, 17408 // 256)
            ((f, a, k),) = _recorded(
                q8_kernels, lambda xq=xq, xd=xd, w=w, t=t: gemv_q8.quant_gemv_q8(xq, xd, w, t, l2_ahead=2)
            )
            cfg = f"{t.name} {N_EMBD}x17408 M={m} BLOCK_N={k['BLOCK_N']} l2_ahead=2"
            out.append(Launch("gemv_q8", cfg, f, a, k, rows=m, note="l2_ahead=2: off by default"))
    # The prefetching K-quant GEMV (a bench choice), whose first step's weight words come before a PDL wait.
    for t in (Q.Q4_K, Q.Q5_K):
        xq, xd, w = torch.empty(1, 17408, dtype=torch.int8), torch.empty(1, 17408 // 256), weight(t, N_EMBD, 17408)
        ((f, a, k),) = _recorded(
            q8_kernels, lambda xq=xq, xd=xd, w=w, t=t: gemv_q8.quant_gemv_q8(xq, xd, w, t, prefetch=True)
        )
        cfg = f"{t.name} {N_EMBD}x17408 M=1 BLOCK_N={k['BLOCK_N']} prefetch"
        out.append(Launch("gemv_q8", cfg, f, a, k, rows=1, note="prefetch: a bench choice, not the default"))
    return out


_LAUNCHES: list[Launch] = []  # filled in the parent before the worker processes fork


def pdl_launches() -> list[Launch]:
    """The decode kernels' launches as their wrappers make them with programmatic dependent launch on (an sm_90+
    device stood in for), for sm_90 and later: each is expected to carry PDL and keep its contract."""
    from mtpserve.kernels.triton import pdl

    with mock.patch.object(pdl, "ENABLED", True), mock.patch.object(pdl, "has_pdl", return_value=True):
        recorded = launches()
    wanted = [x for x in recorded if x.decode or x.kernel == "gemv_q8_sum" or "k_splits" in x.config]
    wanted += [x for x in recorded if "prefetch" in x.config or "l2_ahead" in x.config]
    return [replace(x, pdl=True, min_arch=max(x.min_arch, 90)) for x in wanted]


def _prefetched_loads(launch: Launch) -> int:
    """Global loads a kernel may issue before its PDL wait: the prefetching K-quant GEMV's first step of weight
    words, a 16-byte vector each (three a row, Q5_K five) for each weight row a thread holds; none elsewhere."""
    k = launch.kwargs
    if not k.get("PREFETCH"):
        return 0
    rows_a_thread = k["BLOCK_N"] * 4 * k["SB"] // 32  # a warp spans 4 lanes a super-block, SB super-blocks
    return (5 if k.get("FIVE") else 3) * rows_a_thread


def l2_prefetch_problems(ptx: str, kwargs: dict) -> list[str]:
    """A GEMV launched with L2_AHEAD must prefetch each of its thread's blocks' sectors for the loop's step and the
    L2_AHEAD steps its prologue covers (two `prefetch.global.L2` a block a lane: kernels/triton/prefetch.py), the
    prologue's before a PDL wait; any other kernel none."""
    prefetch = re.compile(r"\bprefetch\.global\.L2\b")
    ahead = kwargs.get("L2_AHEAD", 0)
    blocks_a_thread = kwargs["BLOCK_N"] * 4 * kwargs["SB"] // 32 if ahead else 0  # 4 lanes a super-block
    found, want = len(prefetch.findall(ptx)), 2 * blocks_a_thread * (ahead + 1)
    problems = [] if found == want else [f"{found} prefetch.global.L2 in its PTX, want {want}"]
    wait = ptx.find("griddepcontrol.wait")
    if ahead and kwargs.get("PDL") and wait >= 0:  # the prologue's steps go out while the previous kernel runs
        before = len(prefetch.findall(ptx[:wait]))
        if before != 2 * blocks_a_thread * ahead:
            problems.append(f"{before} prefetch.global.L2 before griddepcontrol.wait, want the first {ahead} steps'")
    return problems


SHARED_OPS = ("STS", "LDS", "BAR")  # shared-memory loads, stores and barriers
BYTE_LOADS = ("LDG.E.U8", "LDG.E.S8")


def streaming_loop(cubin: bytes):
    """The innermost loop that loads global memory (sass.streaming_loop), or None."""
    try:
        from tests.support import sass
    except ImportError:  # run as a script: this directory is on the path
        import sass
    return sass.streaming_loop(sass.disassemble(cubin))


def loop_count(loop, opcodes: tuple[str, ...]) -> int:
    """Instructions of `loop` (a streaming_loop, or None) with these opcode prefixes."""
    return 0 if loop is None else sum(loop.count(op) for op in opcodes)


def loop_problems(launch: Launch, cubin: bytes) -> list[str]:
    """What its streaming loop breaks of the launch's rules (Launch.loop_*), its SASS disassembled once."""
    limit = launch.loop_store_limit
    if not (launch.loop_without_shared or launch.loop_without_byte_loads or limit is not None):
        return []
    loop, problems = streaming_loop(cubin), []
    if launch.loop_without_shared and (shared := loop_count(loop, SHARED_OPS)):
        problems.append(f"{shared} shared-memory instructions in its K loop (a layout converted each step)")
    if launch.loop_without_byte_loads and (narrow := loop_count(loop, BYTE_LOADS)):
        problems.append(f"{narrow} byte loads of global memory in its key loop (strides taken as unaligned)")
    if limit is not None and (stores := loop_count(loop, ("STS",))) > limit:
        problems.append(f"{stores} shared-memory stores in its key loop, over {limit} (a tile stored narrow)")
    return problems


def compile_launch(launch: Launch, arch: int) -> tuple[object, str, int]:
    """Compile a recorded launch for compute capability `arch` without a GPU: (triton's CompiledKernel, the ptxas -v
    report, num_warps). Raises what the compiler raises."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(launch.kwargs)
    for fix in launch.fixups:
        fix(kwargs, arch)
    warps = kwargs.get("num_warps", 4)
    # What JITFunction.run does before compiling, with the backend of the target rather than of a device.
    kwargs["debug"] = kwargs.get("debug", launch.fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton 3.9; 3.6 (the H200 image's) lacks it
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound, spec, options)
    src = ASTSource(launch.fn, signature, constexprs, attrs)
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed: captured below
    knobs.compilation.always_compile = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = compile(src, target=target, options=options.__dict__)
    return kernel, log.getvalue(), warps


def ptxas_usage(report: str) -> tuple[int | None, int | None, int | None]:
    """(registers a thread, stack frame bytes, spill bytes: stores + loads) from ptxas -v's report."""
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stack = int(spill.group(1)) if spill else None
    spills = int(spill.group(2)) + int(spill.group(3)) if spill else None
    return (int(regs.group(1)) if regs else None), stack, spills


def _compile(job: tuple[int, int]) -> dict:
    """Compile launch i for compute capability `arch`: a dict of the outcome."""
    i, arch = job
    launch = _LAUNCHES[i]
    res = {
        "kernel": launch.kernel,
        "config": launch.config,
        "arch": arch,
        "ok": False,
        "regs": None,
        "spills": None,
        "stack": None,
        "shared": None,
        "error": "",
        "note": launch.note,
    }
    start = time.perf_counter()
    try:
        kernel, text, res["warps"] = compile_launch(launch, arch)
        res["regs"], res["stack"], res["spills"] = ptxas_usage(text)
        res["shared"] = kernel.metadata.shared
        res["loads"] = global_loads(kernel.asm["ptx"])
        problems = [f"lane layout: {p}" for p in lane_layout_problems(kernel.asm["ttgir"], res["warps"])]
        problems += [f"l2 prefetch: {p}" for p in l2_prefetch_problems(kernel.asm["ptx"], launch.kwargs)]
        problems += loop_problems(launch, kernel.asm["cubin"])
        if launch.pdl and not launch.kwargs.get("PDL"):
            problems.append("pdl: its wrapper launched it without kernels.triton.pdl.launch_options")
        elif launch.pdl:
            problems += [f"pdl: {p}" for p in pdl_problems(kernel.asm["ptx"], _prefetched_loads(launch))]
        limit = MAX_SHARED.get(arch)
        if limit is not None and kernel.metadata.shared > limit:
            problems.append(f"out of resources: {kernel.metadata.shared} bytes of shared memory, sm_{arch} has {limit}")
        if res["regs"] is not None:
            per_warp = -(-res["regs"] * 32 // 256) * 256  # registers are allocated per warp in units of 256
            if per_warp * res["warps"] > REGISTERS_PER_SM_BLOCK:
                problems.append(f"out of resources: {res['regs']} registers x {res['warps']} warps")
        res["ok"] = not problems
        res["error"] = "; ".join(problems)
    except Exception as e:  # noqa: BLE001 - every failure is a result to report
        res["error"] = f"{type(e).__name__}: {e}"
    res["seconds"] = time.perf_counter() - start
    return res


_BLOCKED = re.compile(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", re.M)
_TENSOR = re.compile(r"tensor<((?:\d+x)+)\w+, (#\w+|#ttg\.slice<.*?>)>(?=[,)\s]|$)")
_SLICE = re.compile(r"#ttg\.slice<\{dim = (\d+), parent = (.*)\}>$")


def lane_layout_problems(ttgir: str, num_warps: int) -> list[str]:
    """Warp-collective inline PTX (`.sync`: mma.sync, shfl.sync; kernels/triton/warp.py) assumes element i of its
    operands' last dim sits on thread i, the other dims in that thread's registers. Triton chooses layouts itself,
    so this reads the TTGIR: for each such op, every operand and result layout must put 32 lanes x num_warps warps
    on the last dim, one element a thread, and nothing else on threads or warps. Returns what breaks that."""
    blocked = {}
    for name, body in _BLOCKED.findall(ttgir):
        fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", body))
        blocked[name] = {k: [int(x) for x in v.split(",") if x.strip()] for k, v in fields.items()}
    problems = []
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" not in line or ".sync" not in line:
            continue
        asm = re.search(r'"([^"]*)"', line).group(1)[:40]
        for dims, enc in _TENSOR.findall(line):
            shape = [int(x) for x in dims.rstrip("x").split("x")]
            sliced = []
            while (m := _SLICE.match(enc)) is not None:
                sliced.append(int(m.group(1)))
                enc = m.group(2)
            lay = blocked.get(enc)
            if lay is None:
                problems.append(f"{asm}: layout {enc} is not a blocked layout")
                continue
            kept = list(range(len(lay["threadsPerWarp"])))
            for d in reversed(
                sliced
            ):  # the innermost slice removes a dim of the blocked layout, each outer one of what is left
                kept.pop(d)
            lane = kept[-1]
            ok = (
                shape[-1] == 32 * num_warps
                and lay["threadsPerWarp"][lane] == 32
                and lay["sizePerThread"][lane] == 1
                and lay["warpsPerCTA"][lane] == num_warps
                and all(
                    lay["threadsPerWarp"][d] == 1 and lay["warpsPerCTA"][d] == 1
                    for d in range(len(kept) + len(sliced))
                    if d != lane
                )
            )
            if not ok:
                problems.append(f"{asm}: tensor<{dims}> in {enc} {lay} (sliced {sliced})")
    return sorted(set(problems))


def global_loads(ptx: str) -> str:
    """The kinds of global-memory load in the PTX with their counts, widest first ("v4.b32 x12  u8 x40"): a
    memory-bound kernel should read its weights in 16-byte vectors, not byte by byte."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"\bld\.global(?:\.[a-z]+)*?((?:\.v[248])?\.[busf]\d+)\b", ptx):
        kind = m.group(1).lstrip(".")
        counts[kind] = counts.get(kind, 0) + 1

    def width(kind: str) -> int:
        lanes = int(kind[1]) if kind.startswith("v") else 1
        return lanes * int(re.sub(r"\D", "", kind.split(".")[-1]))

    return "  ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -width(kv[0])))


def _row(r: dict, loads: bool = False) -> str:
    status = "ok" if r["ok"] else "FAILED"

    def num(v: int | None) -> str:
        return "-" if v is None else str(v)

    line = (
        f"{r['kernel']:<13} sm_{r['arch']:<3} {status:<6} regs {num(r['regs']):>3}  spills {num(r['spills']):>4}  "
        f"shared {num(r['shared']):>6}  {r['seconds']:5.1f}s  {r['config']}"
    )
    if r["note"]:
        line += f"  ({r['note']})"
    if loads and r.get("loads") is not None:
        line += f"\n    global loads: {r['loads'] or 'none'}"
    if not r["ok"]:
        line += "\n    " + "\n    ".join(r["error"].strip().splitlines()[:40])
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities (default 90,80,75)")
    parser.add_argument("--quick", action="store_true", help="sm_90 only, one configuration per kernel")
    parser.add_argument("--only", default="", help="only configurations whose kernel or label contain this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    parser.add_argument("--loads", action="store_true", help="also list each kernel's global loads by width (PTX)")
    parser.add_argument(
        "--pdl", action="store_true", help="the decode kernels with programmatic dependent launch (sm_90+)"
    )
    args = parser.parse_args(argv)
    archs = (90,) if args.quick else tuple(int(a) for a in args.arch.split(",") if a.strip())

    start = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="mtpserve-gpu-compile-")
    os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: every configuration really compiles, none is kept
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas

        # Fusion stays on by default in 3.9, as at run time; its notice (once per worker) is noise here.
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")

        _LAUNCHES[:] = pdl_launches() if args.pdl else launches()
        jobs = [
            (i, arch)
            for arch in archs
            for i, launch in enumerate(_LAUNCHES)
            if arch >= launch.min_arch
            and (launch.quick or not args.quick)
            and (args.only in launch.kernel or args.only in launch.config)
        ]
        print(
            f"triton {triton.__version__}, ptxas {get_ptxas(90).path} / {get_ptxas(80).path}: "
            f"{len(jobs)} compiles for sm_{', sm_'.join(map(str, archs))}",
            flush=True,
        )
        if args.jobs > 1 and len(jobs) > 1:
            ctx = multiprocessing.get_context("fork")  # the workers inherit _LAUNCHES
            with ctx.Pool(min(args.jobs, len(jobs))) as pool:
                results = []
                for r in pool.imap(_compile, jobs):
                    print(_row(r, args.loads), flush=True)
                    results.append(r)
        else:
            results = []
            for job in jobs:
                r = _compile(job)
                print(_row(r, args.loads), flush=True)
                results.append(r)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    failed = [r for r in results if not r["ok"]]
    spilled = [r for r in results if r["ok"] and r["spills"]]
    for r in failed:
        print(f"FAILED: {r['kernel']} sm_{r['arch']} {r['config']}: {r['error'].strip().splitlines()[0]}")
    print(
        f"{len(results) - len(failed)}/{len(results)} compiled, {len(failed)} failed, {len(spilled)} of them "
        f"spill registers; {time.perf_counter() - start:.1f}s"
    )
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
