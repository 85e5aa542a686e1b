"""The decode cycle's time model: what a token of Qwen3.6-27B Q4_K_M costs on a GPU, part by part, without a GPU.

    .venv/bin/python bench/gpu_time_model.py [--static docs/perf/gpu_static_after.json] [--json OUT] [--runs N]
        [--host-from docs/perf/gpu_time_model.json]

bench/gpu_static.py calls `predict` too (its JSON's `predicted` and `host_ms_per_mtp_cycle`). A step (one token,
or a verification of 1 + n_max tokens, or an MTP draft) costs the sum of five parts:

* weights: the bytes the step's matrices hold (tuning.synthetic's tensors of the deployment's file: the 64 layers
  with the output norm and layer, 15.82 GB; the token embedding gives one row) over HBM x BANDWIDTH_FRACTION. A
  verification reads them once for all its rows (the GEMVs take 1-8 rows a pass). A draft step reads the MTP
  block (0.27 GB) and what scores its draft: with `--spec-draft-head auto` on a GPU a Q4_0 copy of the output
  layer (0.72 GB, models.draft_head) and the output layer's rows of the copy's top 64, else the output layer
  (1.04 GB); a catch-up reads the MTP block alone.
* attention: the KV cache's bytes at the context (16 layers, K and V, 4 KV heads x 256 at q8_0's 34 bytes a 32)
  once a pass, each over its launch's own bound: min(its issue bound from gpu_static's table, HBM x
  BANDWIDTH_FRACTION). On the H200 the planar q8_0 cache is read by the int8 kernel: a decode step's 6 query
  heads a KV head in one 16-row block, a verification's 3 tokens x 6 = 18 query rows in one 32-row block. On the
  2080 Ti by its mma.sync twin (attention_mma): 6 rows on one warp, 18 on a program of 4 warps, one pass each. A
  draft step attends in the MTP block's one layer.
* other: the Gated DeltaNet states (48 layers x 48 heads x 128 x 128 float32) read and written each step, a
  verification writing one more per token (kept for the rollback; `state_passes`); with the layer split, the
  hidden state handed to the next card (n_embd float32 over PCIe, plus its latency).
* launches: the step's kernels (bench/decode_launches.py on the GPU path's planar q8_0 cache: 693 a step, 693 a
  verification, 36 a draft (35 drawn at a temperature), 20 a catch-up; a kernel whose
  attention took a verification in more passes would count one more launch a pass a layer) x LAUNCH_US each, the
  fixed cost of a kernel in a graph replay beyond its memory time.
* host: the engine's own time per cycle, measured by bench/engine_overhead.py's stand-in (tinyqwen35 whose passes
  cost nothing, its logits handed over uncopied and ranked by the device path's code on the CPU: the engine step,
  the sampler, speculation's bookkeeping), plus each pass's ranking: the GPU path leaves the logits on the device
  and ranks a pass's rows there together (engine.sampling.rows_ranked_on_device: the argmax, or the top-k of a
  sampling request), RANK_US of device time (assumed the same for a verification's 3 rows as for one: 3 MB,
  about a microsecond of HBM, the rest fixed costs), then one synchronizing copy of the candidates
  (COPY_LATENCY_US; a few hundred bytes). The stand-in's ranking runs its torch calls on CPU tensors of the
  fixture's 4,096-token rows, so their compute is in the measured host time too: an over-count kept.
* `predicted_sampled`: the same at llama-server's default chain (T 0.8, top-k 40, top-p 0.95, min-p 0.05), which a
  request without sampling fields gets: the host time measured at that chain with drafts drawn from it (the
  stand-in's rows are the draft head's own, so every draft is kept; a verification's rows ranked together, their
  candidates copied in one and kept or drawn in one C call, ops.verify_drawn), and each draft step reading what a
  greedy one reads (MTPDrawGraph draws over the shortlisting head's rows since 2026-12-07; the whole output layer
  before) in `Kernels.draw` launches. The
  acceptance is the same 63%: the 27B's at a temperature is not measured (tinyqwen35 kept 0.69 of drawn drafts at T 0.8
  against 0.36 under llama.cpp's rule: docs/performance.md).

The parts add: kernels run one after another in one stream, and the host and the device do not overlap (the
engine waits for the logits before it prepares the next step). No speculation: a step gives one token. draft-mtp
(n_max 2): a cycle is one verification, two draft steps and one catch-up, and gives 1 + 2 x acceptance tokens
(acceptance: accepted / drafted, llama.cpp's measure; the deployment's 63%). The layer split over two RTX 2080 Ti
runs the cards in series, so a step costs what one card streaming every weight would, plus the hand-over.

Row split as tensor parallelism (issue 40; built on CPU ranks, not on CUDA): the same two cards each hold half of
every matrix, of the KV heads (2 of 4) and of the DeltaNet states, and stream them at once; they meet in two
all-reduces a layer
(after the attention or DeltaNet output projection and after the FFN's down projection, as vLLM's Qwen models do)
of the tokens' float32 hidden states, plus one gathering the vocabulary-split output layer's candidates (the CPU
ranks gather whole logits; on GPUs each row's top candidates would cross), each costing the link's latency plus
its bytes and a launch. Priced over PCIe 3.0 through host memory and over the 2080
Ti's NVLink bridge (DEVICES); the JSON keeps them apart from what the code runs (`predicted_row_split`), and
`row_split_vs_layer_split` gives each over the layer split's tok/s. `predicted_other`: an H100 SXM, the other kind
of machine a session may be lent, so that a run on one has a prediction to stand beside.

Every assumption is a named constant below, with where it comes from; none is tuned to reach a goal. Calibration,
once a GPU is lent: bench/gpu_check.sh's GEMV micro-benchmark measures BANDWIDTH_FRACTION per kernel, its
profiler table the launch cost, and its decode tok/s the whole; docs/performance.md puts them beside this.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Assumptions (module docstring).
BANDWIDTH_FRACTION = 0.80  # of HBM a streaming kernel reaches: issue 38's rule until bench/gemv_l2.py measures it
LAUNCH_US = 1.5  # per kernel in a graph replay: docs/gpu-decode.md's 1-2.5 us, the middle (not yet measured)
COPY_LATENCY_US = 10.0  # a synchronizing device-to-host copy's fixed cost (not yet measured)
DRAFT_HEAD_ROWS = 64  # the stand-in's draft head in the host measurement (its rows are device work)
# a 248,320-logit row's argmax or top-k on the device, eager kernels included (bench/gpu.py's `ranking` measures it
# with the copy; not yet run on a GPU)
RANK_US = 20.0
ACCEPTANCE = 0.63  # the deployment's draft acceptance with llama.cpp, n_max 2
# llama-server's default chain, which a request without sampling fields gets (`predicted_sampled`)
SAMPLED_CHAIN = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
N_MAX = 2
CONTEXTS = (4096, 131072)

# The deployment's model (../shared/spec/qwen35-architecture.md; tuning.synthetic.Qwen35Shape).
N_EMBD = 5120
VOCAB = 248_320  # bench/draft_vocab.py cuts the draft's output layer to a share of it
ATTENTION_LAYERS, KV_HEADS, HEAD_DIM, QUERY_HEADS = 16, 4, 256, 24
Q8_0_BYTES_PER_VALUE = 34 / 32
GDN_LAYERS, GDN_HEADS, GDN_DIM = 48, 48, 128


@dataclass(frozen=True)
class Device:
    name: str
    arch: str  # gpu_static's arch key for decode attention's issue bound
    hbm_tbps: float
    pcie_copy_gbps: float  # a pageable device-to-host copy (`.cpu()`): half the link's rate, assumed
    cards_in_series: int  # layer split: a step crosses cards - 1 boundaries
    attention_tbps_fallback: float  # decode attention's slowest launch's issue bound when no gpu_static table is given
    tensor_parallel: int = 1  # row split (issue 40): cards that each hold 1/tp of every matrix, KV head and state
    allreduce_us: float = 0.0  # a small all-reduce's latency between those cards
    allreduce_gbps: float = 0.0  # and the rate its bytes move at


DEVICES = {
    # H200: 4.8 TB/s HBM3e; PCIe 5.0 x16 (64 GB/s a direction) at half for pageable copies
    "H200": Device("H200", "sm_90", 4.8, 25.0, 1, 4.78),
    # H100 SXM5 80 GB (the lent machines' other kind): 3.35 TB/s HBM3 and the H200's 132 SMs at 1.98 GHz, so
    # gpu_static's sm_90 issue bounds hold for it as they are; a PCIe H100 (2.0 TB/s, 114 SMs) would be slower
    "H100": Device("H100", "sm_90", 3.35, 25.0, 1, 4.78),
    # RTX 2080 Ti: 616 GB/s GDDR6; PCIe 3.0 x16 (~12 GB/s in practice) at half; layer split 1:1 over two cards
    "2x2080Ti": Device("2x2080Ti", "sm_75", 0.616, 6.0, 2, 1.15),
    # The same two cards as tensor parallelism (issue 40's `-sm row`): both stream half of every matrix at once.
    # Over PCIe 3.0 through host memory (GeForce cards without peer-to-peer): NCCL's small all-reduce between two
    # such cards takes ~12 us (all-to-all of 8-64 B, 2 x RTX 4090, P2P off: tinygrad/open-gpu-kernel-modules#17),
    # 15 assumed for the older platform, its bytes at the 6 GB/s of a copy. Over the 2080 Ti's NVLink bridge (two
    # links, 50 GB/s a direction): ~10 us (2 GPUs over NVLink, all_reduce_perf at 8-128 B: NVIDIA/nccl-tests#123).
    "2x2080Ti-row-pcie": Device("2x2080Ti-row-pcie", "sm_75", 0.616, 6.0, 1, 1.15, 2, 15.0, 6.0),
    "2x2080Ti-row-nvlink": Device("2x2080Ti-row-nvlink", "sm_75", 0.616, 6.0, 1, 1.15, 2, 10.0, 50.0),
}
ISSUE_DEVICES = ("H200", "2x2080Ti")  # `predicted`: issue 38's; the H100 goes in `predicted_other`
ALLREDUCES_PER_LAYER = 2  # row split: after the attention or DeltaNet output projection, and after the FFN's down


@dataclass(frozen=True)
class Bytes:
    """Bytes each kind of step reads from the model's weights (the deployment's file)."""

    trunk: int  # 64 layers + output norm + output layer
    mtp_block: int
    output_layer: int
    draft_head: int  # what a draft step reads to score its draft (models.draft_head: the head or its Q4_0 copy)

    @classmethod
    def of_deployment(cls, shortlist: bool = True) -> Bytes:
        """The 27B's; `shortlist`: drafts scored as `--spec-draft-head auto` does on a GPU, a Q4_0 copy of the
        output layer (18 bytes a 32 values) and the output layer's rows of its top SHORTLIST."""
        from mtpserve.models.draft_head import SHORTLIST, copy_row_bytes
        from mtpserve.tuning.synthetic import Qwen35Shape, tensors

        shape = Qwen35Shape()
        specs = tensors(shape)
        mtp = sum(t.nbytes for t in specs if t.name.startswith(f"blk.{shape.n_layer}."))
        embedding = sum(t.nbytes for t in specs if t.name == "token_embd.weight")
        output = sum(t.nbytes for t in specs if t.name == "output.weight")
        head = VOCAB * copy_row_bytes(N_EMBD) + SHORTLIST * output // VOCAB if shortlist else output
        return cls(sum(t.nbytes for t in specs) - mtp - embedding, mtp, output, head)


@dataclass(frozen=True)
class Kernels:
    """Kernels a step launches (bench/decode_launches.py, through gpu_static's JSON)."""

    decode: int = 693
    verify: int = 693  # the int8 kernels take its 18 rows a KV head in one launch (the float kernel: two, 709)
    draft: int = 36  # the shortlisting head's (--spec-draft-head auto on a GPU), its copy's top 64 in two stages
    catch_up: int = 20
    draw: int = 35  # a draft drawn at a temperature (MTPDrawGraph: the same head, the chain in one launch)


def kv_bytes(context: int, layers: int = ATTENTION_LAYERS) -> float:
    return layers * 2 * KV_HEADS * HEAD_DIM * Q8_0_BYTES_PER_VALUE * context


def gdn_state_bytes() -> int:
    return GDN_LAYERS * GDN_HEADS * GDN_DIM * GDN_DIM * 4


def state_passes(tokens: int) -> int:
    """The Gated DeltaNet states' bytes a trunk pass moves, in states: read once and written back in place, and a
    pass of several tokens also writes the state after each of its tokens but the last for the rollback
    (models.qwen35's `decode` with steps; the last is the state written in place, which no rollback returns to)."""
    return 1 + tokens


def attention_passes(tokens: int, arch: str, kernel: str | None = None) -> int:
    """Passes over the cache: the row blocks of a KV head's query rows, as decode attention cuts them on `arch`.
    sm_90 reads the planar q8_0 cache with the int8 kernel for a decode step
    (kernels.triton.attention_int8.int8_row_blocks: 6 rows in one 16-row block) and with the fp16 mma16 kernel for
    more than 16 rows (kernels.triton.attention_mma16.mma16_row_blocks: a verification's 18 in one program); sm_75
    with its mma.sync twin (kernels.triton.attention_mma.mma_row_blocks: 6 rows on one warp, 18 on four, one
    program each). `kernel` "float": the float kernel's (kernels.triton.attention.row_blocks: 6 rows in one 8-row
    block, 18 in a 16-row and a 4-row one), on either arch."""
    from mtpserve.kernels.triton.attention import row_blocks
    from mtpserve.kernels.triton.attention_int8 import int8_row_blocks
    from mtpserve.kernels.triton.attention_mma import mma_row_blocks
    from mtpserve.kernels.triton.attention_mma16 import mma16_row_blocks

    rows = tokens * (QUERY_HEADS // KV_HEADS)
    if kernel == "float":
        return sum(n for _, n, _ in row_blocks(rows, HEAD_DIM))
    if arch == "sm_90":
        return sum(b[1] for b in (mma16_row_blocks(rows) if rows > 16 else int8_row_blocks(rows)))
    return sum(b[1] for b in mma_row_blocks(rows))


def pass_bounds(bounds: float | dict[int, list[float]], tokens: int, arch: str) -> list[float]:
    """Decode attention's issue bound for each pass of a step of `tokens` tokens: one figure for every pass, or
    gpu_static's per launch (its T=1 and T=3 rows; the slowest for each pass where this step's are missing)."""
    if isinstance(bounds, dict):
        if tokens in bounds:
            return bounds[tokens]
        return [min(min(b) for b in bounds.values())] * attention_passes(tokens, arch)
    return [bounds] * attention_passes(tokens, arch)


@dataclass
class Parts:
    weights: float = 0.0
    attention: float = 0.0
    launches: float = 0.0
    host: float = 0.0
    other: float = 0.0

    def add(self, other: Parts) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)

    def total(self) -> float:
        return sum(asdict(self).values())


def step(
    device: Device,
    attention_tbps: float | dict[int, list[float]],
    *,
    weights: float,
    tokens: int,
    context: int,
    trunk: bool,
    kernels: int,
    logits_rows: int,
) -> Parts:
    """One pass on the device and its logits rows' ranking, in ms (the engine's own host time not included).
    `trunk`: the 64 layers (else the MTP block's one); a trunk pass of several tokens keeps each one's states.
    With tensor parallelism each card streams 1/tp of the weights, KV heads and states at once, and the cards meet
    in ALLREDUCES_PER_LAYER all-reduces of the tokens' float32 hidden states a layer (each also a kernel), plus
    one that gathers the vocabulary-split output layer's candidates where logits are asked for."""
    stream_tbps = device.hbm_tbps * BANDWIDTH_FRACTION
    layers = (GDN_LAYERS + ATTENTION_LAYERS) if trunk else 1
    attention_layers = ATTENTION_LAYERS if trunk else 1
    tp = device.tensor_parallel
    states = gdn_state_bytes() * state_passes(tokens) if trunk else 0
    handover = (device.cards_in_series - 1) * (
        tokens * N_EMBD * 4 / (device.pcie_copy_gbps * 1e6) + COPY_LATENCY_US / 1e3
    )
    # a pass's rows ranked together on the device, their candidates in one copy (engine.sampling.rows_ranked)
    copies = (1 if logits_rows else 0) * (RANK_US + COPY_LATENCY_US) / 1e3
    n_allreduce = (layers * ALLREDUCES_PER_LAYER + (1 if logits_rows else 0)) if tp > 1 else 0
    allreduce = n_allreduce * (
        device.allreduce_us / 1e3 + (tokens * N_EMBD * 4 / (device.allreduce_gbps * 1e6) if tp > 1 else 0)
    )
    return Parts(
        weights=weights / tp / (stream_tbps * 1e9),
        attention=kv_bytes(context, attention_layers)
        / tp
        * sum(1 / (min(bound, stream_tbps) * 1e9) for bound in pass_bounds(attention_tbps, tokens, device.arch)),
        launches=(kernels + n_allreduce) * LAUNCH_US / 1e3,
        host=copies,
        other=states / tp / (stream_tbps * 1e9) + (handover if trunk else 0) + allreduce,
    )


def predict(
    *,
    host_ms_per_token: float,
    host_ms_per_mtp_cycle: float,
    attention_tbps: dict[str, float | dict[int, list[float]]] | None = None,
    kernels: Kernels = Kernels(),
    weights: Bytes | None = None,
    acceptance: float = ACCEPTANCE,
    contexts: tuple[int, ...] = CONTEXTS,
    drawn: bool = False,
) -> list[dict]:
    """tok/s and ms a token by part, for each device, context and speculation setting (`weights`: the steps' bytes,
    the deployment's by default; bench/draft_vocab.py cuts the draft's head, bench/draft_head.py compares heads).
    `drawn`: drafts drawn at a temperature (MTPDrawGraph), through the same head with `kernels.draw` a step."""
    w = weights or Bytes.of_deployment()
    out = []
    for device in DEVICES.values():
        at = (attention_tbps or {}).get(device.arch, device.attention_tbps_fallback)
        for context in contexts:
            plain = step(device, at, weights=w.trunk, tokens=1, context=context, trunk=True, kernels=kernels.decode,
                         logits_rows=1)  # fmt: skip
            plain.host += host_ms_per_token
            # the counts are the int8 attention kernel's; a kernel taking a verification in more passes launches more
            extra = ATTENTION_LAYERS * (attention_passes(1 + N_MAX, device.arch) - attention_passes(1 + N_MAX, "sm_90"))
            cycle = step(device, at, weights=w.trunk, tokens=1 + N_MAX, context=context, trunk=True,
                         kernels=kernels.verify + extra, logits_rows=1 + N_MAX)  # fmt: skip
            # tensor parallelism scores drafts with the whole head (it refuses --spec-draft-head q4_0; its draft
            # kernels are counted as the shortlisting head's, 5 more a step)
            head = w.draft_head if device.tensor_parallel == 1 else w.output_layer
            per_draft = kernels.draw if drawn else kernels.draft
            for _ in range(N_MAX):
                cycle.add(step(device, at, weights=w.mtp_block + head, tokens=1, context=context,
                               trunk=False, kernels=per_draft, logits_rows=1))  # fmt: skip
            cycle.add(step(device, at, weights=w.mtp_block, tokens=1, context=context, trunk=False,
                           kernels=kernels.catch_up, logits_rows=0))  # fmt: skip
            cycle.host += host_ms_per_mtp_cycle
            for spec, parts, tokens in (("none", plain, 1.0), ("draft-mtp", cycle, 1 + N_MAX * acceptance)):
                ms = {k: round(v / tokens, 4) for k, v in asdict(parts).items()}
                tok_s = round(1e3 * tokens / parts.total(), 1)
                out.append({"device": device.name, "context": context, "spec": spec, "tok_s": tok_s, "ms": ms})
    return out


def assumptions() -> dict:
    return {
        "bandwidth_fraction": BANDWIDTH_FRACTION,
        "launch_us": LAUNCH_US,
        "copy_latency_us": COPY_LATENCY_US,
        "rank_us": RANK_US,
        "acceptance": ACCEPTANCE,
        "n_max": N_MAX,
        "devices": {k: asdict(v) for k, v in DEVICES.items()},
        "parts_add": "kernels in series in one stream; host and device do not overlap",
        "allreduces_per_layer": ALLREDUCES_PER_LAYER,
    }


def attention_bounds(static: dict) -> dict[str, dict[int, list[float]]]:
    """Decode attention's issue bound per arch, step tokens and launch (q8_0 cache, D=256, the deployment's; the
    slower of with and without a window), from gpu_static's rows: a launch per row block size (BLOCK_M). Each arch
    takes the rows of the kernel decode_attention runs there (`RUNS_ON`; the float kernel's where those are
    missing)."""
    rows = [r for r in static.get("kernels", []) if r["kernel"] == "attn_split" and "K=Q8_0" in r["name"]]
    rows = [
        r for r in rows if "D=256" in r["name"] and r["issue_bound_tbps"] and "bench choice" not in r.get("note", "")
    ]

    def kernel(r: dict) -> str:
        return next((k for k in (" int8 ", " mma ", " mma16 ") if k in r["name"]), "float")

    present = {(r["arch"], kernel(r)) for r in rows}
    launches: dict[str, dict[int, dict[int, float]]] = {}
    for r in rows:
        tokens = int(re.search(r"\bT=(\d+)", r["name"]).group(1))
        runs = RUNS_ON.get(r["arch"], {}).get(tokens, "float")
        if kernel(r) != (runs if (r["arch"], runs) in present else "float"):
            continue
        block = re.search(r"\bBLOCK_M=(\d+)", r["name"])
        per_block = launches.setdefault(r["arch"], {}).setdefault(tokens, {})
        key = int(block.group(1)) if block else 0
        per_block[key] = min(per_block.get(key, math.inf), r["issue_bound_tbps"])
    return {
        arch: {tokens: [b for _, b in sorted(blocks.items(), reverse=True)] for tokens, blocks in per_step.items()}
        for arch, per_step in launches.items()
    }


# The planar-q8_0 pass 1 decode_attention takes on each arch, for a decode step (1 token) and a verification (3)
RUNS_ON = {"sm_90": {1: " int8 ", 3: " mma16 "}, "sm_75": {1: " mma ", 3: " mma "}}


def kernel_counts(static: dict) -> Kernels:
    keys = ("kernels_per_decode_step", "kernels_per_verify_step", "kernels_per_mtp_draft", "kernels_per_mtp_catch_up")
    if not all(k in static for k in keys):
        return Kernels()
    return Kernels(*(static[k] for k in keys), static.get("kernels_per_mtp_draw", Kernels.draw))


def measure_host(tokens: int = 1024, rounds: int = 5, sampling: str = "greedy") -> tuple[float, float]:
    """(ms a token, ms an MTP cycle) of host work: bench/engine_overhead.py's stand-in at the fixture's
    vocabulary, draft-mtp with every draft accepted (so a cycle is 1 + n_max tokens). `sampling` "greedy", or
    "default": the server's default chain (SAMPLED_CHAIN) with drafts drawn from it (the stand-in's rows then
    are the draft head's own row, so p is q and the ratio rule keeps every draft)."""
    import statistics

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import engine_overhead as eo

    from mtpserve.engine import SamplingParams, SpecConfig
    from mtpserve.engine import sampling as host_sampling
    from mtpserve.tokenizer import Tokenizer

    torch.set_num_threads(2)
    args = argparse.Namespace(tokens=tokens, rounds=rounds)
    tokenizer = Tokenizer.from_gguf(eo.MODEL)
    chain = SamplingParams(temperature=0.0) if sampling == "greedy" else SamplingParams(**SAMPLED_CHAIN)
    # The GPU path's host work, not its device work: every logits row takes the device ranking's code (torch ops,
    # here on CPU tensors) and is as narrow as the stand-in allows (the fixture's own vocabulary), the draft head
    # scores DRAFT_HEAD_ROWS rows, the rows are handed over uncopied, so what the CPU computes is negligible and the
    # time is the engine's own plus its torch calls' dispatch. The rows' ranking and the draft's output layer on
    # the device are `step`'s terms (RANK_US, the weights), not counted twice.
    draft_mtp = SpecConfig(type="draft-mtp", n_max=N_MAX, draft_vocab=DRAFT_HEAD_ROWS)
    vocab = eo.stand_in_model_vocab()
    saved = host_sampling.HOST_DEVICES
    host_sampling.HOST_DEVICES = frozenset()
    try:
        plain = eo.engine_case(args, tokenizer, vocab, chain, None, None, fresh_logits=False)
        mtp = eo.engine_case(args, tokenizer, vocab, chain, None, draft_mtp, fresh_logits=False)
    finally:
        host_sampling.HOST_DEVICES = saved
    per_token, per_token_mtp = (statistics.median(host for host, _ in case[1:]) / 1e3 for case in (plain, mtp))
    return per_token, per_token_mtp * (1 + N_MAX)


def median_host(runs: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(greedy, the server's default chain) host times, each part the median of `runs` measurements, greedy and
    sampled interleaved (this VM's host time moves 10-30% between runs)."""
    import statistics

    greedy, sampled = [], []
    for _ in range(runs):
        greedy.append(measure_host())
        sampled.append(measure_host(sampling="default"))
    return tuple(tuple(statistics.median(part) for part in zip(*taken)) for taken in (greedy, sampled))


def host_from(path: Path) -> tuple[tuple[float, float], tuple[float, float]]:
    """(greedy, sampled) host times as an earlier run of this script wrote them."""
    r = json.loads(path.read_text())
    greedy = (r["host_ms_per_token"], r["host_ms_per_mtp_cycle"])
    return greedy, (r["host_ms_per_token_sampled"], r["host_ms_per_mtp_cycle_sampled"])


def model(
    static: dict | None = None,
    host: tuple[float, float] | None = None,
    contexts: tuple[int, ...] = CONTEXTS,
    sampled_host: tuple[float, float] | None = None,
) -> dict:
    """The whole prediction: gpu_static's JSON (or {}) for the kernel counts and attention bounds, and the host
    time measured here unless given. `sampled_host`: the same at the server's default chain (measured with the
    greedy one where neither is given), for `predicted_sampled`: drafts drawn at that chain (absent without it)."""
    static = static or {}
    if host is None:
        host, sampled_host = measure_host(), sampled_host or measure_host(sampling="default")
    per_token, per_cycle = host
    shared = dict(attention_tbps=attention_bounds(static) or None, kernels=kernel_counts(static), contexts=contexts)
    predicted = predict(host_ms_per_token=per_token, host_ms_per_mtp_cycle=per_cycle, **shared)
    planned = [p for p in predicted if DEVICES[p["device"]].tensor_parallel > 1]
    result = {
        "host_ms_per_token": round(per_token, 4),
        "host_ms_per_mtp_cycle": round(per_cycle, 4),
        "assumptions": assumptions(),
        "predicted": [p for p in predicted if p["device"] in ISSUE_DEVICES],  # what the code runs: H200, layer split
        "predicted_other": [p for p in predicted if p not in planned and p["device"] not in ISSUE_DEVICES],
        "predicted_row_split": planned,  # issue 40's tensor parallelism: on CPU ranks today, not on CUDA
        "row_split_vs_layer_split": row_split_ratios(predicted),
    }
    if sampled_host is not None:
        sampled = predict(
            host_ms_per_token=sampled_host[0], host_ms_per_mtp_cycle=sampled_host[1], drawn=True, **shared
        )
        result["sampled_chain"] = SAMPLED_CHAIN
        result["host_ms_per_token_sampled"] = round(sampled_host[0], 4)
        result["host_ms_per_mtp_cycle_sampled"] = round(sampled_host[1], 4)
        result["predicted_sampled"] = [p for p in sampled if p["device"] in ISSUE_DEVICES]
    return result


def row_split_ratios(predicted: list[dict]) -> list[dict]:
    """Each tensor-parallel 2080 Ti prediction over the layer split's at the same context and speculation."""
    layer = {(p["context"], p["spec"]): p["tok_s"] for p in predicted if p["device"] == "2x2080Ti"}
    return [
        {
            "device": p["device"],
            "context": p["context"],
            "spec": p["spec"],
            "ratio": round(p["tok_s"] / layer[(p["context"], p["spec"])], 2),
        }
        for p in predicted
        if DEVICES[p["device"]].tensor_parallel > 1
    ]


def table(result: dict) -> str:
    lines = [
        f"host time (bench/engine_overhead.py's stand-in): {result['host_ms_per_token']:.3f} ms a greedy token, "
        f"{result['host_ms_per_mtp_cycle']:.3f} ms an MTP cycle"
        + (
            f"; at the server's default chain {result['host_ms_per_token_sampled']:.3f} ms a token, "
            f"{result['host_ms_per_mtp_cycle_sampled']:.3f} ms an MTP cycle (drafts drawn)"
            if "host_ms_per_mtp_cycle_sampled" in result
            else ""
        ),
        "",
        "| device | context | spec | tok/s | weights | attention | launches | host | other (ms a token) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    sampled = [{**p, "spec": p["spec"] + " (T 0.8, drawn)"} for p in result.get("predicted_sampled", [])]
    for p in result["predicted"] + sampled + result.get("predicted_other", []) + result["predicted_row_split"]:
        m = p["ms"]
        lines.append(
            f"| {p['device']} | {p['context']:,} | {p['spec']} | {p['tok_s']} | {m['weights']:.2f} | "
            f"{m['attention']:.2f} | {m['launches']:.2f} | {m['host']:.2f} | {m['other']:.2f} |"
        )
    lines += ["", "| row split over layer split | context | spec | ratio |", "|---|---:|---|---:|"]
    lines += [
        f"| {r['device']} | {r['context']:,} | {r['spec']} | {r['ratio']:.2f}x |"
        for r in result["row_split_vs_layer_split"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--static", default=str(REPO / "docs" / "perf" / "gpu_static_after.json"))
    parser.add_argument("--json", default=None, help="write the prediction here")
    parser.add_argument("--runs", type=int, default=1, help="host measurements, each part's median taken")
    parser.add_argument(
        "--host-from", default=None, help="take the host times of this earlier JSON: price a change of kernels alone"
    )
    args = parser.parse_args(argv)
    static = json.loads(Path(args.static).read_text()) if args.static else {}
    greedy, sampled = host_from(Path(args.host_from)) if args.host_from else median_host(args.runs)
    result = model(static, greedy, sampled_host=sampled)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
