"""The CUDA backend on the deployment's model shapes: a random-weight Qwen3.6-27B in Q4_K_M, built on the GPU in
seconds (no file, no network), measured the way the mission measures it.

    .venv/bin/python bench/gpu.py [--layers 64] [--contexts 4096,32768] [--acceptance 0.63] [--json out.json]
    .venv/bin/python bench/gpu.py --tiny --device cpu       # the same script on small shapes, on CPU (a smoke run)
    .venv/bin/python bench/gpu.py --llama-bench llama.cpp/build/bin/llama-bench   # with llama.cpp side by side

What it builds: `Qwen35Config` with the 27B's shapes (../shared/spec/qwen35-architecture.md §1: 64 trunk layers,
48 Gated DeltaNet + 16 gated attention, one MTP block, n_embd 5120, n_ff 17408, vocab 248320), every tensor typed
by llama-quantize's Q4_K_M rules (mtpserve.quant.mix), filled with random bytes whose f16 block scales are set to
small sane values: random 4-bit codes need no quantizer and read exactly as many bytes as trained ones.

What it measures (one table on stdout, everything in --json):
* weight bytes read per decoded token (every matrix a token passes through: trunk, final norm, LM head; the
  embedding reads one row), and per MTP draft step;
* a device-to-device copy's bandwidth (read + write bytes / time): the ceiling;
* decode tokens/s at batch 1 at each context depth, replayed from a CUDA graph as the server does, and the
  eager step's time beside it (the difference is Python and kernel launches) (the KV cache and recurrent state
  are filled to the depth with random values rather than by a prefill: decode speed depends on the depth, not on
  the values), and the achieved bandwidth (weight + KV bytes read per token / time) as a fraction of the copy's;
* draft-mtp: the measured cost of a verification step (n_max + 1 tokens, per-token recurrent states kept), of
  the MTP draft steps and of the MTP catch-up (all captured, as the server runs them), combined with a recorded
  acceptance rate (the deployment's 63% at n_max 2, by default) into expected decode tokens/s; and the same with
  the drafts drawn at the server's default chain (MTPDrawGraph through the shortlisting head, the chain);
* decode of `--batch` sequences together (4; --parallel without speculation), tokens/s in all;
* prefill tokens/s (ubatches of 512 from an empty context);
* one Gated DeltaNet layer's chunked rule over a 512-token ubatch, its chunk scan as the Triton kernel and as
  PyTorch's loop;
* the GEMV alone on the 27B's commonest matrices (Q4_K and Q6_K), 1 and 3 rows, as the type's word kernel (the
  default) and as the generic sub-tile kernel, as a fraction of the copy's bandwidth;
* memory: weights, and the state of one sequence at 262144 tokens with a q8_0 KV cache (MTP cache included);
* the peer, with `--llama-bench PATH`: the same random model written as a GGUF file (`write_gguf`: llama.cpp
  reads the same shapes, types and bytes) and run by llama-bench with the same settings (every layer on the
  GPU, flash attention, the same KV cache type): decode of 64 tokens at each depth and the same prefill, each
  as ours / theirs. llama-bench has no speculative decoding, so the draft-mtp row has no peer here.

Parts and switches (bench/gpu_check.sh's bench stage runs `--parts decode,mtp,prefill --contexts 4096,65536` with
`--split-matmuls`, `--gemv-k-splits`, `--gemv-l2-ahead`, `--pdl` and `--attention-choices`): `--parts` picks among
gemv, decode, mtp (the draft-mtp row of each depth), batch, prefill, chunk_scan, memory (all by default).
`--gemv-k-splits N` and `--attention-choices A,B` time the captured decode step and verification again at each
depth, captured afresh with the few-row GEMVs split N ways along K, then with each decode attention choice of
bench/attention_gpu.py (what the kernel's choices are worth where the server runs them, beside that script's
kernel-alone numbers). `--gemv-l2-ahead N` does the same at the first depth with the K-quant GEMVs prefetching their
weights N steps ahead into L2 (kernels/triton/prefetch.py), alone and with the K split. `--pdl` does the same with
programmatic dependent launch (kernels/triton/pdl.py), at the first depth only (with the L2 prefetch as well when
asked), and checks that the PDL graph's logits equal the plain graph's bit for bit.
`--split-matmuls` splits a decode step's time between the GEMVs and everything else: the captured step is timed
again with every matmul of the GPU path (ops.quant_gemv's entries and the Triton wrappers, wherever a module
holds them) replaced by a no-op returning an empty output of the same shape, so the graph holds only the small
kernels (norms, roundings, rope, attention, the recurrence, ...); the difference is the matmuls' time. Each eager
step's GPU kernels are also counted with and without them (torch.profiler), the launches a token costs.
On CUDA, one graphed decode step and one graphed MTP cycle (verification, drafts, catch-up) at each depth are
profiled kernel by kernel (torch.profiler): count, busy time, the span and the idle time between kernels, the top
kernels by time, printed as each is made and kept in the JSON (`decode_profile`, `mtp_cycle_profile`).

The GPU's numbers go into docs/performance.md (a dated entry with the GPU's name), the headline into the README.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from mtpserve.engine import SpecConfig
from mtpserve.engine.drafters import DRAFT_TOP_K, draft_head
from mtpserve.models.base import Batch, WeightStore
from mtpserve.models.draft_head import DraftHead
from mtpserve.models.graphs import DecodeGraph, MTPDraftGraph, MTPDrawGraph, MTPRowsGraph, StepGraph
from mtpserve.models.loader import build_model
from mtpserve.models.qwen35 import Qwen35Config
from mtpserve.ops.gated_delta import gated_delta_chunk_scan_reference, gated_delta_rule_chunked
from mtpserve.ops.sampling_chain import ChainParams, ChainShape
from mtpserve.quant.mix import FILE_TYPES, ModelFacts, plan_types
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.types import GGMLType, block_geometry
from mtpserve.quant.writer import write_metadata

QWEN36_27B = Qwen35Config(
    architecture="qwen35",
    n_vocab=248320,
    n_embd=5120,
    n_layer=64,
    n_nextn=1,
    n_ff=17408,
    n_head=24,
    n_head_kv=4,
    head_dim=256,
    rms_eps=1e-6,
    n_rot=64,
    rope_base=1e7,
    rope_sections=(11, 11, 10, 0),
    context_length=262144,
    d_conv=4,
    ssm_head_dim=128,
    n_k_heads=16,
    n_v_heads=48,
    recurrent=tuple((i + 1) % 4 != 0 for i in range(64)) + (False,),
    tied_embeddings=False,
)
TINY = replace(
    QWEN36_27B,
    n_vocab=2048,
    n_embd=256,
    n_layer=4,
    n_ff=512,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_rot=16,
    rope_sections=(3, 3, 2, 0),
    ssm_head_dim=32,
    n_k_heads=2,
    n_v_heads=4,
    recurrent=(True, True, True, False, False),
)
# Byte offsets of each type's f16 scale fields (../shared/spec/gguf-quant-formats.md §3).
F16_FIELDS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def with_layers(config: Qwen35Config, n_layer: int) -> Qwen35Config:
    """The first n_layer trunk layers of config (same pattern), plus its MTP block."""
    return replace(config, n_layer=n_layer, recurrent=config.recurrent[:n_layer] + (False,) * config.n_nextn)


def random_blocks(
    ggml_type: GGMLType, rows: int, cols: int, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """Random GGUF blocks [rows, cols / QK * type_size] whose f16 fields hold scales in [1e-4, 6e-4): values of
    a few hundredths, like trained weights."""
    qk, size = block_geometry(ggml_type)
    n_blocks = cols // qk
    b = torch.randint(0, 256, (rows, n_blocks, size), dtype=torch.uint8, device=device, generator=gen)
    for offset in F16_FIELDS[ggml_type]:
        scale = (torch.rand(rows, n_blocks, device=device, generator=gen) * 5e-4 + 1e-4).half()
        b[:, :, offset : offset + 2] = scale.view(torch.uint8).view(rows, n_blocks, 2)
    return b.view(rows, -1)


def random_weights(config: Qwen35Config, device: torch.device, seed: int = 0) -> dict[str, QTensor | torch.Tensor]:
    """Every tensor of `config` as Q4_K_M would type it, random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    # The required tensors, and an untied LM head (the 27B has its own output.weight).
    specs = [s for s in config.tensor_specs() if s.required or s.name == "output.weight"]
    stored = {s.name: (tuple(reversed(s.shape)), GGMLType.F32) for s in specs}
    types = plan_types(stored, FILE_TYPES["Q4_K_M"], ModelFacts("qwen35", config.n_layer + config.n_nextn))
    tensors: dict[str, QTensor | torch.Tensor] = {}
    for spec in specs:
        t = types[spec.name]
        if len(spec.shape) == 1 or t == GGMLType.F32:
            dense = torch.rand(spec.shape, device=device, generator=gen) * 0.2 + 0.9  # norms ~1, positive
            if spec.name.endswith("ssm_a"):
                dense = -dense  # -exp(A_log): a decay
            tensors[spec.name] = dense
        else:
            rows, cols = spec.shape
            tensors[spec.name] = QTensor(random_blocks(t, rows, cols, device, gen), t, spec.shape, spec.name)
    return tensors


def synthetic_vocab(n_vocab: int) -> dict[str, object]:
    """A SentencePiece-style tokenizer of n_vocab pieces (<unk>, <s>, </s>, the 256 byte pieces llama.cpp looks
    up at load time, then placeholders): a file llama.cpp loads, for benchmarks that feed token ids."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]  # llama.cpp's token types: unknown, control, byte, then normal
    pieces += [f"piece{i}" for i in range(len(pieces), n_vocab)]
    types += [1] * (n_vocab - len(types))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": np.zeros(n_vocab, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def write_gguf(config: Qwen35Config, tensors: dict[str, QTensor | torch.Tensor], path: str) -> int:
    """The random model as a GGUF file, one tensor at a time (llama.cpp reads the same shapes, types and
    bytes); returns the file's size."""
    values = {
        **config.metadata(),
        "general.name": "random Qwen3.6-27B-shaped Q4_K_M (bench/gpu.py)",
        **synthetic_vocab(config.n_vocab),
        "general.file_type": FILE_TYPES["Q4_K_M"].ftype,
    }
    kinds = {
        bool: GGUFValueType.BOOL,
        int: GGUFValueType.UINT32,
        float: GGUFValueType.FLOAT32,
        str: GGUFValueType.STRING,
        list: GGUFValueType.ARRAY,
        np.ndarray: GGUFValueType.ARRAY,
    }
    writer = GGUFWriter(path, config.architecture)
    write_metadata(writer, values, {k: kinds[type(v)] for k, v in values.items()})
    for name, t in tensors.items():
        if isinstance(t, QTensor):
            qtype = GGMLQuantizationType(t.ggml_type)
            writer.add_tensor_info(name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, tuple(t.shape), np.dtype(np.float32), t.numel() * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors.values():
        data = t.data if isinstance(t, QTensor) else t.float()
        writer.write_tensor_data(data.contiguous().cpu().numpy())
    writer.close()
    return os.path.getsize(path)


def decode_bytes(config: Qwen35Config, tensors: dict[str, QTensor | torch.Tensor]) -> tuple[int, int]:
    """(weight bytes a decoded token reads, bytes an MTP draft step reads)."""

    def size(name: str) -> int:
        t = tensors[name]
        return t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()

    trunk = [n for n in tensors if not n.startswith("blk.") or int(n.split(".")[1]) < config.n_layer]
    per_token = sum(size(n) for n in trunk if n != "token_embd.weight")
    per_token += tensors["token_embd.weight"].nbytes // config.n_vocab  # type: ignore[union-attr]
    mtp = [n for n in tensors if n.startswith(f"blk.{config.n_layer}.")]
    per_draft = sum(size(n) for n in mtp) + size("output.weight")
    return per_token, per_draft


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
        """Median seconds of fn over reps runs, after warm-up runs (Triton compiles on the first)."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer.median(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / t


def measure_ranking(device: torch.device, timer: Timer, n_vocab: int, reps: int) -> dict:
    """Microseconds to rank one logits row where it is and bring its candidates over (engine.sampling: the argmax of
    a greedy request with a ban, the top 40 of a sampling one with a 64-token penalty window), against copying the
    row whole: calibrates bench/gpu_time_model.py's RANK_US + COPY_LATENCY_US. And the top 41 alone, torch's top-k
    of the row against the two stages both rankings now take (ops.sampling_chain.top_candidates); and a
    verification's 3 rows at the server's top-k 40, ranked together in one copy (the model assumes one RANK_US)
    against each alone."""
    from mtpserve.engine.sampling import DeviceBias, ranked_on_device, rows_ranked_on_device
    from mtpserve.ops.sampling_chain import top_candidates

    row = torch.randn(n_vocab, generator=torch.Generator().manual_seed(5)).to(device)
    ban = DeviceBias.of({n_vocab - 1: float("-inf")}, device)
    window = {t: 1 for t in range(64)}
    greedy = timer.median(lambda: ranked_on_device(row, 1, ban, {}, 1.0, 0.0, 0.0), reps)
    top40 = timer.median(lambda: ranked_on_device(row, 40, ban, window, 1.1, 0.0, 0.0), reps)
    whole = timer.median(lambda: row.cpu(), reps)
    topk = timer.median(lambda: row.topk(41), reps)
    two_stages = timer.median(lambda: top_candidates(row, 41), reps)
    rows = torch.stack((row, row.flip(0), row.roll(1)))
    together = timer.median(lambda: rows_ranked_on_device(rows, 40, ban), reps)
    alone = timer.median(lambda: [ranked_on_device(r, 40, ban, {}, 1.0, 0.0, 0.0) for r in rows], reps)
    return {
        "vocab": n_vocab,
        "greedy_us": 1e6 * greedy,
        "top40_us": 1e6 * top40,
        "row_copy_us": 1e6 * whole,
        "topk41_us": 1e6 * topk,
        "top_candidates41_us": 1e6 * two_stages,
        "rows3_top40_together_us": 1e6 * together,
        "rows3_top40_each_us": 1e6 * alone,
    }


def fill_to_depth(model, state, depth: int, gen: torch.Generator) -> int:
    """Pretend `depth` tokens were evaluated: KV cells 0..depth-1 hold random rows (valid q8_0 blocks), the
    recurrent states random values. Returns the KV bytes a decoded token then reads."""
    kv_bytes = 0
    for kv in state.kv.values():
        for rows in (kv.k, kv.v):
            if rows.data.dtype == torch.uint8:
                qk, size = block_geometry(rows.type)
                per_row = rows.data.shape[1] // size
                rows.data[:depth] = random_blocks(rows.type, depth, per_row * qk, rows.data.device, gen)
            else:
                rows.data[:depth].normal_(generator=gen)
            kv_bytes += rows.data[:depth].numel() * rows.data.element_size()
        kv.positions[:depth] = torch.arange(depth, device=kv.positions.device)
        kv.length = depth
    for st in state.recurrent.values():
        st.conv.normal_(generator=gen)
        st.ssm.normal_(generator=gen).mul_(0.01)
    state.n_past = depth
    return kv_bytes


def truncate(state, depth: int) -> None:
    """Back to `depth` positions (decode runs repeat from the same depth)."""
    for kv in state.kv.values():
        kv.truncate(depth)
    state.n_past = depth


PARTS = ("gemv", "decode", "mtp", "batch", "prefill", "chunk_scan", "memory")
MATMULS = ("quant_linear", "quant_gemv", "quant_gemv_q8", "quant_matmul")  # the GPU path's and the kernels' entries


def _no_matmul(*args, **kwargs) -> torch.Tensor:
    """A matmul that launches nothing: an empty float32 [rows..., n] for (x, weight or blocks, ...) arguments."""
    if kwargs.get("out") is not None:
        return kwargs["out"]
    x = args[0]
    w = next(a for a in args[1:] if isinstance(a, QTensor) or (isinstance(a, torch.Tensor) and a.dtype == torch.uint8))
    return torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)


@contextmanager
def matmuls_skipped() -> Iterator[None]:
    """Every matmul entry (MATMULS of mtpserve.ops.quant_gemv and mtpserve.kernels.triton) replaced by `_no_matmul`
    in every mtpserve module that holds it (callers import them by name), restored after."""
    from mtpserve.kernels import triton as kernels
    from mtpserve.ops import quant_gemv

    originals = {id(f): f for m in (quant_gemv, kernels) for n in MATMULS if (f := getattr(m, n, None)) is not None}
    patched = []
    for module in [m for name, m in sys.modules.items() if name.startswith("mtpserve") and m is not None]:
        for name, value in list(vars(module).items()):
            if id(value) in originals and value is originals[id(value)]:
                setattr(module, name, _no_matmul)
                patched.append((module, name, value))
    try:
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)


def cuda_events(fn: Callable[[], object], device: torch.device) -> list:
    """The GPU kernels one call of fn launches, as torch.profiler's CUDA events (raises if the profiler fails)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def count_kernels(fn: Callable[[], object], device: torch.device) -> int | None:
    """GPU kernels one call of fn launches; None off CUDA or without the profiler."""
    if device.type != "cuda":
        return None
    try:
        return len(cuda_events(fn, device))
    except Exception as e:  # noqa: BLE001 - a count is a nicety; the timings stand without it
        print(f"kernel count failed: {e!r}", file=sys.stderr, flush=True)
        return None


def kernel_table(events: list, top: int = 25) -> dict:
    """GPU kernels of one profiled call, from torch.profiler's CUDA events (each with `name` and `time_range`):
    their count, summed time, the span from the first start to the last end (span - sum: the GPU idle between
    them, the launch gaps a graph should close), and the `top` kernels by time with their counts."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    busy = sum(t for _, t in by_name.values())
    span = max((e.time_range.end for e in events), default=0) - min((e.time_range.start for e in events), default=0)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "kernels": sum(n for n, _ in by_name.values()),
        "busy_us": round(busy, 1),
        "span_us": round(span, 1),
        "idle_us": round(max(span - busy, 0.0), 1),
        "top": [{"name": name[:120], "count": n, "us": round(t, 1)} for name, (n, t) in ranked],
    }


def profile_kernels(label: str, fn: Callable[[], object], device: torch.device) -> dict | None:
    """`kernel_table` of one call of fn (after it ran warm), printed as it is made; None off CUDA or if the
    profiler fails (the timings stand without it)."""
    if device.type != "cuda":
        return None
    try:
        table = kernel_table(cuda_events(fn, device))
    except Exception as e:  # noqa: BLE001 - as count_kernels
        print(f"profile of {label} failed: {e!r}", file=sys.stderr, flush=True)
        return None
    print(
        f"{label}: {table['kernels']} kernels, {table['busy_us']:.0f} us busy in a {table['span_us']:.0f} us span "
        f"({table['idle_us']:.0f} us idle)",
        flush=True,
    )
    for k in table["top"][:10]:
        print(f"  {k['us']:9.1f} us  {k['count']:4d} x  {k['name']}", flush=True)
    return table


def measure_without_matmuls(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer) -> dict:
    """The decode step with and without its matmuls (`matmuls_skipped`): graphed times and eager kernel counts."""

    def eager() -> None:
        truncate(state, depth)
        model.decode(token, state)

    counted = count_kernels(eager, model.device)
    with matmuls_skipped():
        graph = DecodeGraph(model, state)

        def graphed() -> None:
            truncate(state, depth)
            graph.decode(token)

        t = timer.median(graphed, args.reps, warmup=3)
        counted_without = count_kernels(eager, model.device)
    truncate(state, depth)
    return {
        "decode_no_matmul_ms": 1e3 * t,
        "kernels_per_token": counted,
        "kernels_per_token_no_matmul": counted_without,
    }


def time_captured(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer) -> tuple[float, float]:
    """(decode, verification) seconds of a decode step and an n_max + 1-token verification captured afresh, so with
    the kernel settings in force now."""
    decode_graph = DecodeGraph(model, state)
    verify_graph = StepGraph(model, state, args.n_max + 1, keep_steps=True)

    def decode() -> None:
        truncate(state, depth)
        decode_graph.decode(token)

    def verify() -> None:
        truncate(state, depth)
        verify_graph.step([token] * (args.n_max + 1))

    try:
        return timer.median(decode, args.reps, warmup=3), timer.median(verify, args.reps, warmup=3)
    finally:
        truncate(state, depth)


def time_gemv_setting(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer, **settings: int):
    """time_captured with these ops.quant_gemv settings (GEMV_K_SPLITS, GEMV_L2_AHEAD) in force, restored after."""
    from mtpserve.ops import quant_gemv

    before = {name: getattr(quant_gemv, name) for name in settings}
    for name, value in settings.items():
        setattr(quant_gemv, name, value)
    try:
        return time_captured(model, state, depth, token, args, timer)
    finally:
        for name, value in before.items():
            setattr(quant_gemv, name, value)


def measure_k_splits(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer) -> dict:
    """A graphed decode step and a 3-token verification with the integer GEMVs of the few-row matrices split
    --gemv-k-splits ways along K (ops.quant_gemv.GEMV_K_SPLITS, captured into fresh graphs), beside the default's."""
    t_decode, t_verify = time_gemv_setting(model, state, depth, token, args, timer, GEMV_K_SPLITS=args.gemv_k_splits)
    return {
        "gemv_k_splits": args.gemv_k_splits,
        "decode_k_split_ms": 1e3 * t_decode,
        "verify_k_split_ms": 1e3 * t_verify,
    }


def measure_l2_ahead(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer) -> dict:
    """The same with the Q4_K/Q5_K/Q6_K GEMVs prefetching their weights --gemv-l2-ahead K steps ahead into L2
    (ops.quant_gemv.GEMV_L2_AHEAD), and with --gemv-k-splits as well when it splits: each a cure for the GEMVs'
    missing bytes in flight, so their sum is worth knowing too."""
    ahead = args.gemv_l2_ahead
    t_decode, t_verify = time_gemv_setting(model, state, depth, token, args, timer, GEMV_L2_AHEAD=ahead)
    row = {"gemv_l2_ahead": ahead, "decode_l2_ahead_ms": 1e3 * t_decode, "verify_l2_ahead_ms": 1e3 * t_verify}
    if args.gemv_k_splits > 1:
        both = {"GEMV_L2_AHEAD": ahead, "GEMV_K_SPLITS": args.gemv_k_splits}
        t_decode, t_verify = time_gemv_setting(model, state, depth, token, args, timer, **both)
        row.update(decode_k_split_l2_ahead_ms=1e3 * t_decode, verify_k_split_l2_ahead_ms=1e3 * t_verify)
    return row


def measure_pdl(model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer) -> dict:
    """A graphed decode step and a verification with programmatic dependent launch (kernels.triton.pdl: each decode
    kernel launched while the one before it runs), beside the default's; and whether the PDL graph's logits equal
    a plain graph's bit for bit (the same kernels in the same order: a difference is a missing wait)."""
    from mtpserve.kernels.triton import pdl

    def replayed_logits() -> torch.Tensor:
        graph = DecodeGraph(model, state)
        for _ in range(3):  # eager, captured, replayed
            truncate(state, depth)
            logits = graph.decode(token)
        return logits.float().clone()

    want = replayed_logits()
    pdl.ENABLED = True
    row: dict = {}
    try:
        got = replayed_logits()
        t_decode, t_verify = time_captured(model, state, depth, token, args, timer)
        row = {
            "decode_pdl_ms": 1e3 * t_decode,
            "verify_pdl_ms": 1e3 * t_verify,
            "pdl_logits_equal": torch.equal(got, want),
        }
        if args.gemv_l2_ahead:  # the GEMVs' first steps prefetched into L2 before their wait, as CUTLASS's do
            ahead = {"GEMV_L2_AHEAD": args.gemv_l2_ahead}
            t_decode, t_verify = time_gemv_setting(model, state, depth, token, args, timer, **ahead)
            row.update(decode_pdl_l2_ahead_ms=1e3 * t_decode, verify_pdl_l2_ahead_ms=1e3 * t_verify)
    except Exception as e:  # noqa: BLE001 -- recorded; the depth's other numbers stand
        message = f"{type(e).__name__}: {e}"[:300]
        print(f"depth {depth}: programmatic dependent launch failed: {message}", file=sys.stderr, flush=True)
        return {**row, "pdl_failed": message}
    finally:
        pdl.ENABLED = False
        truncate(state, depth)
    return row


def measure_attention_choices(
    model, state, depth: int, token: int, args: argparse.Namespace, timer: Timer, decode_ms: float
) -> dict:
    """The graphed decode step and verification with each of --attention-choices (bench/attention_gpu.py's decode
    kernel choices, through ops.attention.DECODE_ATTENTION_CHOICE), each printed as measured beside the default's
    decode. A choice that fails is recorded and leaves the others measured."""
    from attention_gpu import choice_kwargs

    from mtpserve.ops import attention

    rows = []
    for name in args.attention_choices:
        row: dict = {"choice": name}
        attention.DECODE_ATTENTION_CHOICE.update(choice_kwargs(name))
        try:
            t_decode, t_verify = time_captured(model, state, depth, token, args, timer)
            row.update(decode_ms=1e3 * t_decode, verify_ms=1e3 * t_verify)
            shown = f"decode {row['decode_ms']:.2f} ms (default {decode_ms:.2f}), verification {row['verify_ms']:.2f}"
        except Exception as e:  # noqa: BLE001 -- one choice's failure leaves the others measured
            row["failed"] = shown = f"{type(e).__name__}: {e}"[:300]
        finally:
            attention.DECODE_ATTENTION_CHOICE.clear()
        print(f"depth {depth}: decode attention {name!r}: {shown}", file=sys.stderr, flush=True)
        rows.append(row)
    return {"attention_choices": rows}


def measure_decode(
    model,
    state,
    depth: int,
    args: argparse.Namespace,
    timer: Timer,
    gen: torch.Generator,
    weight_bytes: int,
    copy_bytes_per_s: float,
) -> dict:
    """Decode at `depth`: eager and graphed steps, and the draft-mtp estimate from its measured parts."""
    config, device = model.config, model.device
    token = 1000 % config.n_vocab
    kv_bytes = fill_to_depth(model, state, depth, gen)
    print(f"decode at depth {depth}", file=sys.stderr, flush=True)

    def decode_eager() -> None:
        truncate(state, depth)
        model.decode(token, state)

    graph = DecodeGraph(model, state)  # the captured step (on CPU: the same static step, run eagerly)

    def decode_graphed() -> None:
        truncate(state, depth)
        graph.decode(token)

    t_eager = timer.median(decode_eager, args.reps)
    t_decode = timer.median(decode_graphed, args.reps, warmup=3)
    row = {
        "depth": depth,
        "decode_ms": 1e3 * t_decode,
        "decode_eager_ms": 1e3 * t_eager,  # without the CUDA graph: the difference is Python and launches
        "decode_tokens_per_s": 1 / t_decode,
        "kv_bytes_per_token": kv_bytes,
        "bandwidth_fraction": (weight_bytes + kv_bytes) / t_decode / copy_bytes_per_s,
    }
    row["decode_profile"] = profile_kernels(f"graphed decode step at depth {depth}", decode_graphed, device)
    if args.split_matmuls:
        row.update(measure_without_matmuls(model, state, depth, token, args, timer))
        row["matmul_ms"] = row["decode_ms"] - row["decode_no_matmul_ms"]
    if args.gemv_k_splits > 1:
        row.update(measure_k_splits(model, state, depth, token, args, timer))
    if args.gemv_l2_ahead and depth == args.contexts[0]:  # the weights' stream: the same at any depth
        row.update(measure_l2_ahead(model, state, depth, token, args, timer))
    if args.attention_choices:
        row.update(measure_attention_choices(model, state, depth, token, args, timer, row["decode_ms"]))
    # PDL at the first depth only: it acts on the gaps between kernels, which the depth does not change, and its
    # kernels compile afresh (PDL is a compile-time choice), time the stage's later parts need
    pdl_here = args.pdl and depth == args.contexts[0]
    if "mtp" not in args.parts:
        return {**row, **measure_pdl(model, state, depth, token, args, timer)} if pdl_here else row

    # draft-mtp: n_max chained MTP draft steps (each with the LM head), one verification of n_max + 1 tokens
    # keeping per-token recurrent states, one MTP catch-up pass over the accepted tokens (timed at its longest,
    # n_max + 1 rows), each a captured step as the server runs them; an eager draft step beside them.
    mtp_kv = state.kv[model.mtp_kv_index]
    hidden = torch.zeros(1, config.n_embd, device=device)
    rows_in = torch.zeros(args.n_max + 1, config.n_embd, device=device)
    # the drafts as the server scores them on a GPU (--spec-draft-head auto: a Q4_0 copy shortlisting for the
    # 27B's Q6_K head; named here so that the CPU stand-in runs it too), and over the whole head beside them
    shortlisting = draft_head(model, SpecConfig("draft-mtp", draft_head="q4_0"))
    draft_graph = MTPDraftGraph(model, state, args.n_max, shortlisting, DRAFT_TOP_K)
    full_head_graph = MTPDraftGraph(model, state, args.n_max, DraftHead(model.mtp_head), DRAFT_TOP_K)
    # drafts drawn at the server's default chain (T 0.8, top-k 40, top-p 0.95, min-p 0.05), as a request without
    # sampling fields gets them: through the shortlisting head, the chain inside the graph
    draw_graph = MTPDrawGraph(model, state, args.n_max, shortlisting, DRAFT_TOP_K, ChainShape(40, 0))
    default_chain, uniforms = ChainParams(0.95, 0.05, 0.8), [0.5] * args.n_max
    rows_graph = MTPRowsGraph(model, state, args.n_max + 1)

    def draft_step_eager() -> None:
        mtp_kv.truncate(min(mtp_kv.length, depth))
        model.mtp_step(hidden, torch.full((1,), token), state)

    def draft_chain() -> None:
        mtp_kv.truncate(min(mtp_kv.length, depth))
        draft_graph.propose(hidden[0], token)

    def draft_chain_full_head() -> None:
        mtp_kv.truncate(min(mtp_kv.length, depth))
        full_head_graph.propose(hidden[0], token)

    def draft_drawn() -> None:
        mtp_kv.truncate(min(mtp_kv.length, depth))
        draw_graph.draw(hidden[0], token, default_chain, uniforms)

    def catch_up() -> None:
        mtp_kv.truncate(min(mtp_kv.length, depth))
        rows_graph.write(rows_in, [token] * (args.n_max + 1))

    def verify_eager() -> None:
        truncate(state, depth)
        batch = Batch.of(torch.full((args.n_max + 1,), token), [state])
        batch.keep_steps = True
        model.logits(model.forward_batch(batch), seq_len=args.n_max + 1)

    verify_graph = StepGraph(model, state, args.n_max + 1, keep_steps=True)

    def verify() -> None:
        truncate(state, depth)
        verify_graph.step([token] * (args.n_max + 1))

    t_draft_eager = timer.median(draft_step_eager, args.reps)
    t_drafts = timer.median(draft_chain, args.reps, warmup=3)
    t_drafts_full_head = timer.median(draft_chain_full_head, args.reps, warmup=3)
    t_drafts_drawn = timer.median(draft_drawn, args.reps, warmup=3)
    t_catch_up = timer.median(catch_up, args.reps, warmup=3)
    t_verify_eager = timer.median(verify_eager, args.reps)
    t_verify = timer.median(verify, args.reps, warmup=3)

    def cycle() -> None:  # one MTP cycle's device work, as the server replays it: verify, draft, catch up
        verify()
        draft_chain()
        catch_up()

    row["mtp_cycle_profile"] = profile_kernels(f"graphed MTP cycle at depth {depth}", cycle, device)
    truncate(state, depth)
    accepted = args.acceptance * args.n_max
    t_step = t_verify + t_drafts + t_catch_up
    if pdl_here:  # last: a capture with a new launch attribute that fails leaves this depth's numbers measured
        row.update(measure_pdl(model, state, depth, token, args, timer))
    return {
        **row,
        "draft_ms": 1e3 * t_drafts,  # all n_max draft steps, captured, the shortlisting head
        "draft_full_head_ms": 1e3 * t_drafts_full_head,  # the same over the whole head (--spec-draft-head full)
        "draft_drawn_ms": 1e3 * t_drafts_drawn,  # drawn at the server's default chain, the shortlisting head
        "draft_step_eager_ms": 1e3 * t_draft_eager,  # one draft step without the graph
        "catch_up_ms": 1e3 * t_catch_up,
        "verify_ms": 1e3 * t_verify,
        "verify_eager_ms": 1e3 * t_verify_eager,
        "mtp_tokens_per_step": 1 + accepted,
        "mtp_tokens_per_s": (1 + accepted) / t_step,
        # the same cycle with drafts drawn at the default chain (device time; the host's sampling not in it)
        "mtp_drawn_tokens_per_s": (1 + accepted) / (t_verify + t_drafts_drawn + t_catch_up),
    }


def measure_batch_decode(model, depth: int, args: argparse.Namespace, timer: Timer, gen: torch.Generator) -> dict:
    """`--batch` sequences at `depth` decoding together (--parallel without speculation), one captured step."""
    states = [model.new_state(depth + 256, args.cache_type, args.cache_type) for _ in range(args.batch)]
    for state in states:
        fill_to_depth(model, state, depth, gen)
    graph = StepGraph(model, states)
    tokens = [1000 % model.config.n_vocab] * args.batch

    def step() -> None:
        for state in states:
            truncate(state, depth)
        graph.step(tokens)

    t = timer.median(step, args.reps, warmup=3)
    return {"sequences": args.batch, "depth": depth, "step_ms": 1e3 * t, "tokens_per_s": args.batch / t}


def measure_prefill(model, args: argparse.Namespace, timer: Timer) -> float:
    """Prompt tokens/s from an empty context, ubatches of 512."""
    prompt = torch.randint(0, model.config.n_vocab, (args.prefill,), generator=torch.Generator().manual_seed(2))
    state = model.new_state(args.prefill + 256, args.cache_type, args.cache_type)

    def prefill() -> None:
        state.clear()
        model.prefill(prompt, state)

    return args.prefill / timer.median(prefill, max(1, args.reps // 4), warmup=1)


def measure_chunk_scan(config: Qwen35Config, device: torch.device, args: argparse.Namespace, timer: Timer) -> dict:
    """One Gated DeltaNet layer over a 512-token ubatch (8 chunks of 64): the chunk scan as the Triton kernel and
    as PyTorch's loop (its twin, what runs below sm_80), and the whole chunked rule as the GPU path runs it."""
    from mtpserve.kernels import triton as kernels

    T, C, Hk, Hv, K = 512, 64, config.n_k_heads, config.n_v_heads, config.ssm_head_dim
    gen = torch.Generator(device=device).manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    n = T // C
    u, w, q, k = randn(Hv, n, C, K), randn(Hv, n, C, K) / K, randn(Hv, n, C, K) / K, randn(Hv, n, C, K) / K**0.5
    qk = (randn(Hv, n, C, C) / C).tril()
    g_cum = (-0.05 * torch.rand(Hv, n, C, device=device, generator=gen)).cumsum(-1)
    state = randn(Hv, K, K)
    scan = (u, w, q, k, qk, g_cum)
    warmup = 0 if args.tiny else 2  # the smoke run only shows the wiring
    kernel_s = timer.median(lambda: kernels.gated_delta_chunk_scan(*scan, state.clone()), args.reps, warmup)
    loop_s = timer.median(lambda: gated_delta_chunk_scan_reference(*scan, state.clone()), args.reps, warmup)
    qh = torch.nn.functional.normalize(randn(T, Hk, K), dim=-1)
    kh = torch.nn.functional.normalize(randn(T, Hk, K), dim=-1)
    g = -torch.nn.functional.softplus(randn(T, Hv))
    beta = torch.sigmoid(randn(T, Hv))
    rule_s = timer.median(lambda: gated_delta_rule_chunked(qh, kh, randn(T, Hv, K), g, beta, state), args.reps, warmup)
    return {
        "tokens": T,
        "chunk": C,
        "scan_kernel_ms": 1e3 * kernel_s,
        "scan_loop_ms": 1e3 * loop_s,
        "chunked_rule_ms": 1e3 * rule_s,
    }


def measure_gemv(
    config: Qwen35Config,
    device: torch.device,
    args: argparse.Namespace,
    timer: Timer,
    gen: torch.Generator,
    copy_bytes_per_s: float,
) -> list[dict]:
    """The GEMV alone on the model's commonest matrices (Q4_K: the Gated DeltaNet input projection, the FFN
    gate/up; Q6_K: the FFN down projection, the LM head), 1 and 3 rows (decode, verification at n_max 2), as the
    type's word kernel and as the generic sub-tile kernel: time, and weight bytes read per second as a fraction
    of the copy's bandwidth."""
    from mtpserve.kernels import triton as kernels

    calls = 1 if args.tiny else 20  # launches per timing: a single ~20 us kernel is below the timer's noise
    qkv_rows = 2 * config.n_k_heads * config.ssm_head_dim + config.n_v_heads * config.ssm_head_dim
    matrices = [("attn_qkv", GGMLType.Q4_K, qkv_rows, config.n_embd)]
    if not args.tiny:  # the interpreter takes about a second a call: one case shows the wiring
        matrices += [
            ("ffn_up", GGMLType.Q4_K, config.n_ff, config.n_embd),
            ("ffn_down", GGMLType.Q6_K, config.n_embd, config.n_ff),
            ("output", GGMLType.Q6_K, config.n_vocab, config.n_embd),
        ]
    out = []
    for name, qtype, n, k in matrices:
        blocks = random_blocks(qtype, n, k, device, gen)
        for m in (1,) if args.tiny else (1, 3):
            x = torch.randn(m, k, device=device, generator=gen)
            row = {"matrix": name, "type": qtype.name, "shape": [n, k], "rows": m, "bytes": blocks.nbytes}
            for kernel, wide in (("words", True), ("sub_tile", False)):

                def run(x=x, blocks=blocks, qtype=qtype, wide=wide) -> None:
                    for _ in range(calls):
                        kernels.quant_gemv(x, blocks, qtype, wide_words=wide)

                t = timer.median(run, max(1, args.reps // 2), warmup=0 if args.tiny else 2) / calls
                row[f"{kernel}_us"] = 1e6 * t
                row[f"{kernel}_fraction_of_copy"] = blocks.nbytes / t / copy_bytes_per_s
            out.append(row)
        del blocks
    return out


def wait_for(path: str, seconds: float) -> bool:
    """Whether `path` exists, waiting up to `seconds` for it (a peer build still running in the background)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


def run_llama_bench(binary: str, args: list[str], timeout: float) -> dict[tuple[int, int, int], dict]:
    """llama-bench's results keyed by (n_prompt, n_gen, n_depth)."""
    run = subprocess.run([binary, *args, "-o", "json"], capture_output=True, text=True, timeout=timeout, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {run.returncode}: {run.stderr[-2000:]}")
    return {(r["n_prompt"], r["n_gen"], r["n_depth"]): r for r in json.loads(run.stdout)}


def measure_peer(
    config: Qwen35Config, tensors: dict, result: dict, args: argparse.Namespace, device: torch.device
) -> dict:
    """The peer's numbers (`_peer`), or what kept it from running."""
    try:
        return _peer(config, tensors, result, args, device)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _peer(config: Qwen35Config, tensors: dict, result: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """llama.cpp on the same model: the random weights written as a GGUF file and run by `--llama-bench` with the
    deployment's settings (every layer on the GPU, flash attention, the same KV cache type): decode of 64 tokens
    at each depth and the same prefill (ubatches of 512), each as ours / theirs."""
    if not wait_for(args.llama_bench, args.peer_wait):
        return {"error": f"{args.llama_bench} is missing (waited {args.peer_wait:.0f} s for its build)"}
    path = args.gguf or os.path.join(tempfile.gettempdir(), "mtpserve-bench-random.gguf")
    print(f"llama.cpp: writing the model to {path}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    size = write_gguf(config, tensors, path)
    peer: dict = {"binary": args.llama_bench, "gguf_bytes": size, "write_s": time.perf_counter() - t0}
    flags = ["-m", path, "-fa", "on", "-ctk", args.cache_type, "-ctv", args.cache_type, "-r", str(args.peer_reps)]
    flags += ["-ngl", "99"] if device.type == "cuda" else ["-ngl", "0", "-t", str(os.cpu_count() or 1)]
    depths = [row["depth"] for row in result["decode"]]
    print("llama.cpp: decode", file=sys.stderr, flush=True)
    decode = run_llama_bench(
        args.llama_bench, [*flags, "-p", "0", "-n", "64", "-d", ",".join(map(str, depths))], args.peer_timeout
    )
    print("llama.cpp: prefill", file=sys.stderr, flush=True)
    prefill = run_llama_bench(
        args.llama_bench, [*flags, "-p", str(args.prefill), "-n", "0", "-ub", "512"], args.peer_timeout
    )
    any_row = next(iter(decode.values()))
    peer.update(build_commit=any_row.get("build_commit"), backends=any_row.get("backends"), decode=[])
    for row in result["decode"]:
        theirs = decode[(0, 64, row["depth"])]
        peer["decode"].append(
            {
                "depth": row["depth"],
                "tokens_per_s": theirs["avg_ts"],
                "stddev": theirs["stddev_ts"],
                "ours_over_theirs": row["decode_tokens_per_s"] / theirs["avg_ts"],
            }
        )
    theirs = prefill[(args.prefill, 0, 0)]
    peer["prefill_tokens_per_s"] = theirs["avg_ts"]
    peer["prefill_ours_over_theirs"] = result["prefill_tokens_per_s"] / theirs["avg_ts"]
    if not args.gguf:
        os.remove(path)
    return peer


def shapes_name(args: argparse.Namespace) -> str:
    return "tiny (smoke run)" if args.tiny else "Qwen3.6-27B"


def peer_only(config: Qwen35Config, args: argparse.Namespace, device: torch.device) -> int:
    """The peer stage alone, against an earlier run's results (`--peer-only earlier.json`): the same random
    weights (same seed, same device), for a second call when the first ran out of time before llama.cpp."""
    with open(args.peer_only) as f:
        result = json.load(f)
    if result["config"]["n_layer"] != config.n_layer or result["shapes"] != shapes_name(args):
        print(
            f"bench/gpu.py: {args.peer_only} was measured on other shapes (pass the same --tiny/--layers)",
            file=sys.stderr,
        )
        return 2
    result["peer"] = measure_peer(config, random_weights(config, device), result, args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(report(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (a smoke run: seconds, any device)")
    p.add_argument("--layers", type=int, default=None, help="trunk layers to build (default: all)")
    p.add_argument(
        "--contexts",
        type=lambda text: [int(c) for c in text.split(",") if c],
        default="4096,32768",
        help="decode depths, comma-separated",
    )
    p.add_argument("--cache-type", default="q8_0", help="KV cache type (-ctk/-ctv)")
    p.add_argument("--n-max", type=int, default=2, help="draft-mtp tokens per step (--spec-draft-n-max)")
    p.add_argument("--acceptance", type=float, default=0.63, help="recorded draft acceptance (accepted / drafted)")
    p.add_argument("--batch", type=int, default=4, help="sequences decoding together for the batched row (1: skip)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for the prefill measurement")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--memory-ctx", type=int, default=262144, help="context for the memory measurement (0: skip)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--llama-bench", default=None, help="a llama-bench binary: run llama.cpp on the same model too")
    p.add_argument("--gguf", default=None, help="where the model is written for llama.cpp (default: a temp file)")
    p.add_argument("--peer-wait", type=float, default=0, help="seconds to wait for --llama-bench to appear")
    p.add_argument("--peer-reps", type=int, default=3, help="llama-bench repetitions (-r)")
    p.add_argument("--peer-timeout", type=float, default=300, help="seconds each llama-bench run may take")
    p.add_argument("--peer-only", default=None, help="only the peer, against this earlier run's JSON")
    p.add_argument("--parts", default=",".join(PARTS), help=f"what to measure, comma-separated (of {','.join(PARTS)})")
    p.add_argument("--split-matmuls", action="store_true", help="decode also without the matmuls, kernels counted")
    p.add_argument(
        "--gemv-k-splits",
        type=int,
        default=1,
        help="also time a decode step and a verification with the few-row GEMVs split this many ways along K",
    )
    p.add_argument(
        "--gemv-l2-ahead",
        type=int,
        default=0,
        help="also time a decode step and a verification (first depth) with the Q4_K/Q5_K/Q6_K GEMVs prefetching "
        "their weights this many K steps ahead into L2",
    )
    p.add_argument(
        "--pdl",
        action="store_true",
        help="also time a decode step and a verification with programmatic dependent launch (sm_90+)",
    )
    p.add_argument(
        "--attention-choices",
        default="",
        help="also time a decode step and a verification with each of these decode attention choices "
        "(bench/attention_gpu.py's names, comma-separated)",
    )
    args = p.parse_args(argv)
    args.parts = set(args.parts.split(","))
    args.attention_choices = [c.strip() for c in args.attention_choices.split(",") if c.strip()]
    try:
        from attention_gpu import choice_kwargs

        for name in args.attention_choices:
            choice_kwargs(name)
    except ValueError as e:
        p.error(str(e))
    if args.parts - set(PARTS):
        p.error(f"unknown --parts {sorted(args.parts - set(PARTS))}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU visible to torch (use --device cpu --tiny for a smoke run)", file=sys.stderr)
        return 2
    emulation = None
    if device.type == "cpu":  # the GPU path on CPU tensors: Triton's interpreter
        if os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "bench/gpu.py: on CPU, run with TRITON_INTERPRET=1 (the GPU path under Triton's interpreter)",
                file=sys.stderr,
            )
            return 2
        from mtpserve.ops.device import emulate_gpu

        emulation = emulate_gpu(matmul="torch")
        emulation.__enter__()
    config = TINY if args.tiny else QWEN36_27B
    if args.layers is not None:
        config = with_layers(config, args.layers)
    if args.peer_only:
        return peer_only(config, args, device)
    contexts = args.contexts
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(1)
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "shapes": shapes_name(args),
        "config": {k: v for k, v in asdict(config).items() if k != "recurrent"},
        "cache_type": args.cache_type,
        "n_max": args.n_max,
        "acceptance": args.acceptance,
    }
    print(
        f"building a random {'tiny' if args.tiny else 'Qwen3.6-27B-shaped'} Q4_K_M model, {config.n_layer} layers "
        f"+ MTP, on {result['device']}",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    tensors = random_weights(config, device)
    # The token table in host memory, where the server's placement keeps an untied one (llama.cpp does too).
    model = build_model(WeightStore(tensors, device, tensor_devices={"token_embd.weight": "cpu"}), config)
    per_token, per_draft = decode_bytes(config, tensors)
    timer.sync()
    result["build_s"] = time.perf_counter() - t0
    result["weight_bytes"] = sum(t.nbytes if isinstance(t, QTensor) else t.numel() * 4 for t in tensors.values())
    result["weight_bytes_per_token"] = per_token
    result["weight_bytes_per_draft_step"] = per_draft
    result["copy_bytes_per_s"] = copy_bandwidth(device, timer, 64 << 20 if args.tiny else 2 << 30)
    result["ranking"] = measure_ranking(device, timer, config.n_vocab, args.reps)

    def save() -> None:
        """The results so far to --json: a run cut short by a time limit still leaves what it measured."""
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    if "gemv" in args.parts:
        print("the GEMV alone", file=sys.stderr, flush=True)
        result["gemv"] = measure_gemv(config, device, args, timer, gen, result["copy_bytes_per_s"])
        save()

    result["decode"] = []
    if "decode" in args.parts:
        state = model.new_state(max(contexts) + 256, args.cache_type, args.cache_type, mtp=True)
        for depth in contexts:
            result["decode"].append(
                measure_decode(model, state, depth, args, timer, gen, per_token, result["copy_bytes_per_s"])
            )
            save()
        del state
    if args.batch > 1 and "batch" in args.parts:
        depth = min(contexts)
        print(f"decode {args.batch} sequences together at depth {depth}", file=sys.stderr, flush=True)
        result["batch_decode"] = measure_batch_decode(model, depth, args, timer, gen)
        save()
    if "prefill" in args.parts:
        print(f"prefill {args.prefill} tokens", file=sys.stderr, flush=True)
        result["prefill_tokens_per_s"] = measure_prefill(model, args, timer)
    if "chunk_scan" in args.parts:
        result["chunk_scan"] = measure_chunk_scan(config, device, args, timer)
    save()

    if args.memory_ctx and device.type == "cuda" and "memory" in args.parts:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        big = model.new_state(args.memory_ctx, "q8_0", "q8_0", mtp=True)
        torch.cuda.synchronize(device)
        result["memory"] = {
            "ctx": args.memory_ctx,
            "state_bytes": torch.cuda.memory_allocated(device) - before,
            "weights_bytes": result["weight_bytes"],
            "total_bytes": torch.cuda.memory_allocated(device),
            "peak_bytes": torch.cuda.max_memory_allocated(device),
        }
        del big
    if args.llama_bench and {"decode", "mtp", "prefill"} <= args.parts:  # the peer's rows compare with these
        result["peer"] = measure_peer(config, tensors, result, args, device)
        save()
    if emulation is not None:
        emulation.__exit__(None, None, None)

    print(report(result))
    save()
    failed = [c["choice"] for row in result["decode"] for c in row.get("attention_choices", []) if "failed" in c]
    if failed:
        print(f"bench/gpu.py: attention choices failed: {', '.join(sorted(set(failed)))}", file=sys.stderr)
    return 1 if failed else 0


def default_time(row: dict, key: str) -> str:
    """The default's time of `key` in a decode row, for the lines that compare a choice with it."""
    return f"{row[key]:.2f}" if key in row else "(not measured)"


def report(r: dict) -> str:
    gib = 1 << 30
    lines = [
        f"mtpserve bench/gpu.py  {r['date']}  {r['device']}  torch {r['torch']}",
        (
            f"model: random {r['shapes']}-shaped Q4_K_M, {r['config']['n_layer']} layers + MTP, "
            f"{r['weight_bytes'] / gib:.2f} GiB of weights (built in {r['build_s']:.1f} s)"
        ),
        (
            f"weight bytes per token {r['weight_bytes_per_token'] / gib:.3f} GiB, per MTP draft step "
            f"{r['weight_bytes_per_draft_step'] / gib:.3f} GiB; copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s"
        ),
        *(
            [
                f"a logits row of {rk['vocab']:,} ranked where it is and its candidates copied: greedy "
                f"{rk['greedy_us']:.0f} us, top-40 with penalties {rk['top40_us']:.0f} us (the whole row copied: "
                f"{rk['row_copy_us']:.0f} us); its top 41 alone: torch's top-k {rk['topk41_us']:.0f} us, in two "
                f"stages {rk['top_candidates41_us']:.0f} us; a verification's 3 rows' top 40 together "
                f"{rk['rows3_top40_together_us']:.0f} us, each alone {rk['rows3_top40_each_us']:.0f} us"
            ]
            if (rk := r.get("ranking"))
            else []
        ),
        "",
        "| GEMV | rows | word kernel us (of copy bw) | sub-tile kernel us (of copy bw) |",
        "|---|---:|---:|---:|",
        *(
            f"| {g['matrix']} {g['type']} {g['shape'][0]}x{g['shape'][1]} | {g['rows']} | {g['words_us']:.1f} "
            f"({100 * g['words_fraction_of_copy']:.0f}%) | {g['sub_tile_us']:.1f} "
            f"({100 * g['sub_tile_fraction_of_copy']:.0f}%) |"
            for g in r.get("gemv", [])
        ),
        "",
        (
            f"| depth | decode tok/s | ms/token | eager ms/token | KV GiB read | bandwidth / copy | "
            f"{r['n_max']} MTP drafts ms (whole head; eager, one) | MTP catch-up ms | "
            f"verify {r['n_max'] + 1} tokens ms (eager) | "
            f"draft-mtp n_max {r['n_max']} tok/s at {100 * r['acceptance']:.0f}% accepted |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["decode"]:
        lines.append(
            f"| {row['depth']} | {row['decode_tokens_per_s']:.1f} | {row['decode_ms']:.2f} | "
            f"{row['decode_eager_ms']:.2f} | "
            f"{row['kv_bytes_per_token'] / gib:.3f} | {100 * row['bandwidth_fraction']:.0f}% | "
            + (
                f"{row['draft_ms']:.2f} ({row['draft_full_head_ms']:.2f}; {row['draft_step_eager_ms']:.2f}) | "
                f"{row['catch_up_ms']:.2f} | "
                f"{row['verify_ms']:.2f} ({row['verify_eager_ms']:.2f}) | {row['mtp_tokens_per_s']:.1f} "
                f"(drawn at T 0.8: drafts {row['draft_drawn_ms']:.2f} ms, {row['mtp_drawn_tokens_per_s']:.1f}) |"
                if "draft_ms" in row
                else "- | - | - | - |"
            )
        )
    for row in r["decode"]:
        if "decode_no_matmul_ms" in row:
            lines.append(
                f"depth {row['depth']}: the captured step without its matmuls {row['decode_no_matmul_ms']:.2f} ms, "
                f"the matmuls {row['matmul_ms']:.2f} ms of {row['decode_ms']:.2f}; GPU kernels an eager step "
                f"{row['kernels_per_token']} ({row['kernels_per_token_no_matmul']} without the matmuls)"
            )
        if "decode_k_split_ms" in row:
            verify = f", verification {row['verify_k_split_ms']:.2f}" + (
                f" against {row['verify_ms']:.2f}" if "verify_ms" in row else ""
            )
            lines.append(
                f"depth {row['depth']}: the few-row GEMVs split {row['gemv_k_splits']} ways along K: decode "
                f"{row['decode_k_split_ms']:.2f} ms against {row['decode_ms']:.2f}{verify}"
            )
        if "decode_l2_ahead_ms" in row:
            lines.append(
                f"depth {row['depth']}: the GEMVs prefetching {row['gemv_l2_ahead']} K steps ahead into L2: decode "
                f"{row['decode_l2_ahead_ms']:.2f} ms against {row['decode_ms']:.2f}, verification "
                f"{row['verify_l2_ahead_ms']:.2f} against {default_time(row, 'verify_ms')}"
                + (
                    f"; with the K split as well: decode {row['decode_k_split_l2_ahead_ms']:.2f}, verification "
                    f"{row['verify_k_split_l2_ahead_ms']:.2f}"
                    if "decode_k_split_l2_ahead_ms" in row
                    else ""
                )
            )
        if "pdl_failed" in row:
            lines.append(f"depth {row['depth']}: programmatic dependent launch: FAILED {row['pdl_failed']}")
        if "decode_pdl_ms" in row:
            verify = f", verification {row['verify_pdl_ms']:.2f}" + (
                f" against {row['verify_ms']:.2f}" if "verify_ms" in row else ""
            )
            same = "equal" if row["pdl_logits_equal"] else "NOT EQUAL (a kernel reads before its wait)"
            lines.append(
                f"depth {row['depth']}: programmatic dependent launch: decode {row['decode_pdl_ms']:.2f} ms against "
                f"{row['decode_ms']:.2f}{verify}; logits {same} to the plain graph's"
                + (
                    f"; with the GEMVs' L2 prefetch as well: decode {row['decode_pdl_l2_ahead_ms']:.2f}, "
                    f"verification {row['verify_pdl_l2_ahead_ms']:.2f}"
                    if "decode_pdl_l2_ahead_ms" in row
                    else ""
                )
            )
        for c in row.get("attention_choices", []):
            shown = c.get("failed") or (
                f"decode {c['decode_ms']:.2f} ms against {default_time(row, 'decode_ms')}, verification "
                f"{c['verify_ms']:.2f} against {default_time(row, 'verify_ms')}"
            )
            lines.append(f"depth {row['depth']}: decode attention {c['choice']!r}: {shown}")
    lines.append("")
    if "batch_decode" in r:
        b = r["batch_decode"]
        lines.append(
            f"decode of {b['sequences']} sequences together at depth {b['depth']}: {b['step_ms']:.2f} ms a step, "
            f"{b['tokens_per_s']:.1f} tokens/s in all"
        )
    if "prefill_tokens_per_s" in r:
        lines.append(f"prefill: {r['prefill_tokens_per_s']:.0f} tokens/s")
    if "chunk_scan" in r:
        c = r["chunk_scan"]
        lines.append(
            f"one Gated DeltaNet layer, {c['tokens']} prompt tokens in chunks of {c['chunk']}: chunk scan "
            f"{c['scan_kernel_ms']:.3f} ms in Triton, {c['scan_loop_ms']:.3f} ms as PyTorch's loop; "
            f"whole chunked rule {c['chunked_rule_ms']:.3f} ms"
        )
    peer = r.get("peer")
    if peer and "error" in peer:
        lines.append(f"llama.cpp: not measured ({peer['error']})")
    elif peer:
        lines.append(
            f"llama.cpp ({peer['backends']}, build {peer['build_commit']}), the same model and settings: "
            + ", ".join(
                f"decode at {d['depth']} {d['tokens_per_s']:.1f} tok/s (ours / theirs {d['ours_over_theirs']:.2f})"
                for d in peer["decode"]
            )
            + f"; prefill {peer['prefill_tokens_per_s']:.0f} tok/s (ours / theirs "
            f"{peer['prefill_ours_over_theirs']:.2f})"
        )
    if "memory" in r:
        m = r["memory"]
        lines.append(
            f"memory at {m['ctx']} tokens, q8_0 KV: state {m['state_bytes'] / gib:.2f} GiB + weights "
            f"{m['weights_bytes'] / gib:.2f} GiB; allocated {m['total_bytes'] / gib:.2f} GiB, "
            f"peak {m['peak_bytes'] / gib:.2f} GiB"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
