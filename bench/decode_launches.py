"""GPU kernels a CUDA decode step of Qwen3.6-27B launches, counted without a GPU (bench/gpu_static.py's counts).

    TRITON_INTERPRET=1 .venv/bin/python bench/decode_launches.py [--json OUT]

The model: the 27B's layer pattern and type plan at small widths. 64 trunk layers, every 4th full attention
(recurrent[i] = (i + 1) % 4 != 0: 48 Gated DeltaNet + 16 gated attention), one MTP block; the 27B's head counts
and head sizes (attention H=24 Hkv=4 D=256, DeltaNet Hk=16 Hv=48 K=V=128, conv kernel 4), but n_embd 256, n_ff
512 and a 2048-token vocabulary: how many kernels a step launches does not depend on the widths, only on the
code path, and every row length stays a multiple of 256 so no tensor falls back to another type. Random weights
(bench/gpu.py's `random_weights`), a q8_0 KV cache, the token table in host memory as the server places it.

The type plan (Q4_K_M, llama-quantize's rules as mtpserve.quant.mix writes them down; checked here against
../shared/fixtures/tinyqwen35-mtp-Q4_K_M.gguf, made by llama.cpp's quantizer, when that file is present):
* 1-D tensors, norms, ssm_conv1d, ssm_a, ssm_dt.bias: F32;
* output.weight: Q6_K;
* attn_v (attention layers) and attn_qkv (Gated DeltaNet layers), counted together in layer order, and ffn_down:
  Q6_K on the `use_more_bits` positions i of n = 65 (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, integer
  division: layers 0-7, 10, 13, ..., 55, 56-64), Q4_K elsewhere;
* every other matrix (token_embd, attn_q/k/output, attn_gate, ssm_alpha/beta, ssm_out, ffn_gate/up, the MTP
  block's eh_proj): Q4_K. (The fixture's ssm_out is Q5_0 only because its 128-wide rows do not divide into
  256-blocks; the 27B's 6144 do.)

What is counted (tests/support/launch_count.py: aten ops that launch a kernel, Triton launches recorded and
skipped) is what a CUDA graph of the engine captures (models/graphs.py), run eagerly under the counter:
* decode: DecodeGraph's step (every trunk layer, the final norm and the LM head) for one token of one sequence;
* verify: the Speculator's verification step, StepGraph of n_max + 1 = 3 tokens with per-token states kept;
* mtp_draft: one MTP draft step (MTPDraftGraph unchained, as with the token table in host memory: the MTP
  block, the head's Q4_0 copy and its top-64, the head's rows of those and their top-k, as --spec-draft-head
  auto scores a draft on a GPU); mtp_draw: one draft step drawn at a temperature (MTPDrawGraph unchained: the
  MTP block, the same shortlisting head, and the server's default chain, top-k 40, and the draw); mtp_catch_up:
  the MTP block's pass over 3 accepted rows.
The host work around a replay (embedding on the host, copies in, logits out) is not part of the graph: not
counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from gpu import QWEN36_27B, random_weights  # noqa: E402 - bench/gpu.py, beside this script

from mtpserve.engine.drafters import DRAFT_TOP_K  # noqa: E402
from mtpserve.models.base import WeightStore  # noqa: E402
from mtpserve.models.draft_head import DraftHead  # noqa: E402
from mtpserve.models.graphs import DecodeGraph, MTPDraftGraph, MTPDrawGraph, MTPRowsGraph, StepGraph  # noqa: E402
from mtpserve.models.loader import build_model  # noqa: E402
from mtpserve.models.qwen35 import DecoderLayer, Qwen35Config  # noqa: E402
from mtpserve.ops.sampling_chain import ChainShape, top_candidates  # noqa: E402
from mtpserve.quant.mix import FILE_TYPES, ModelFacts, plan_types  # noqa: E402
from mtpserve.quant.types import GGMLType  # noqa: E402
from tests.support.launch_count import LaunchCount, count_launches  # noqa: E402

SMALL_27B = replace(QWEN36_27B, n_vocab=2048, n_embd=256, n_ff=512)
N_MAX = 2  # draft tokens per verification (--spec-draft-n-max): a verification evaluates n_max + 1 tokens
CONTEXT = 512
SHARED = Path(os.environ.get("MTPSERVE_SHARED", REPO.parent / "shared"))
FIXTURE = SHARED / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
TOP = 20


def type_plan(config: Qwen35Config) -> dict[str, GGMLType]:
    """Every tensor's type in the deployment's Q4_K_M file, as bench/gpu.py's `random_weights` types them."""
    specs = [s for s in config.tensor_specs() if s.required or s.name == "output.weight"]
    stored = {s.name: (tuple(reversed(s.shape)), GGMLType.F32) for s in specs}
    return plan_types(stored, FILE_TYPES["Q4_K_M"], ModelFacts("qwen35", config.n_layer + config.n_nextn))


def fixture_mismatches(path: Path = FIXTURE) -> list[str] | None:
    """Tensors of the llama.cpp-quantized fixture whose type the plan gets wrong (None: no fixture)."""
    if not path.exists():
        return None
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    block_count = int(reader.fields["qwen35.block_count"].contents())
    stored = {t.name: (tuple(int(n) for n in t.shape), GGMLType.F32) for t in reader.tensors}
    plan = plan_types(stored, FILE_TYPES["Q4_K_M"], ModelFacts("qwen35", block_count))
    return [
        f"{t.name}: {t.tensor_type.name} in the file, {plan[t.name].name} planned"
        for t in reader.tensors
        if plan[t.name] != GGMLType(int(t.tensor_type))
    ]


def plan_summary(plan: dict[str, GGMLType], n_layer: int) -> dict:
    """Tensors per type, and the layers whose attn_v/attn_qkv and ffn_down are Q6_K."""

    def q6k_layers(*suffixes: str) -> list[int]:
        return sorted(
            int(name.split(".")[1])
            for name, t in plan.items()
            if t == GGMLType.Q6_K and name.startswith("blk.") and name.endswith(suffixes)
        )

    return {
        "tensors_by_type": dict(Counter(t.name for t in plan.values())),
        "q6_k_attn_v_or_qkv_layers": q6k_layers("attn_v.weight", "attn_qkv.weight"),
        "q6_k_ffn_down_layers": q6k_layers("ffn_down.weight"),
        "output": plan["output.weight"].name,
        "layers": n_layer + 1,
    }


def layer_kind(layer: DecoderLayer, n_layer: int) -> str:
    if layer.index >= n_layer:
        return "mtp_block"
    return "gated_deltanet" if layer.recurrent else "gated_attention"


def count(step: Callable[[], object], n_layer: int) -> LaunchCount:
    """The kernels `step` launches, attributed to the kind of layer they run in ("other": outside any)."""
    original = DecoderLayer.__call__

    def call(layer: DecoderLayer, *args: object) -> torch.Tensor:
        with counted.scope(layer_kind(layer, n_layer)):
            return original(layer, *args)

    with torch.inference_mode(), count_launches():  # launches skipped, counts dropped
        # A graph is captured after a warm-up run, as models.graphs does; on this CPU-emulated model the first call
        # also merges the weight groups (ops.linear_gpu.merge_rows), which a CUDA model does at load.
        step()
    with torch.inference_mode(), mock.patch.object(DecoderLayer, "__call__", call), count_launches() as counted:
        step()
    return counted


def two_stage_extra(vocab: int = QWEN36_27B.n_vocab, k: int = 64) -> int:
    """Kernels a draft step's top-k of the 27B's row (the shortlisting head's copy's top 64) launches beyond
    SMALL_27B's (ops.sampling_chain.top_candidates takes a long row in two stages): the one count here that
    depends on a width."""

    def launches(n: int) -> int:
        with torch.inference_mode(), count_launches() as counted:
            top_candidates(torch.zeros(n), k)
        return counted.total

    return launches(vocab) - launches(SMALL_27B.n_vocab)


def summary(c: LaunchCount, layers: dict[str, int]) -> dict:
    by_kind = {}
    for kind, kernels in sorted(c.by_scope.items()):
        total = sum(kernels.values())
        n = layers.get(kind, 1)
        by_kind[kind] = {"layers": n, "kernels": total, "per_layer": total / n}
    return {
        "kernels": c.total,
        "triton": c.triton,
        "aten": c.total - c.triton,
        "top": c.kernels.most_common(TOP),
        "by_layer_kind": by_kind,
        "host_kernel_calls": dict(c.host_kernel_calls),
        "host_reads": dict(c.host_reads),
        "unlisted_views": sorted(c.unlisted_views),
    }


def counts(config: Qwen35Config = SMALL_27B) -> dict:
    """Kernels per decode, verification, MTP draft and MTP catch-up step (module docstring), with breakdowns."""
    from mtpserve.ops.device import emulate_gpu

    tensors = random_weights(config, torch.device("cpu"))
    model = build_model(WeightStore(tensors, "cpu", tensor_devices={"token_embd.weight": "cpu"}), config)
    n = config.n_layer
    trunk = {"gated_deltanet": sum(config.recurrent[:n]), "gated_attention": n - sum(config.recurrent[:n])}
    graphs: dict[str, tuple[Callable[[], object], dict[str, int]]] = {}
    with emulate_gpu(matmul="triton"):
        state = model.new_state(CONTEXT, "q8_0", "q8_0", mtp=True)  # laid out for the GPU path: planar q8_0
        state.n_past = CONTEXT // 2  # decode deep in the cache: the kernels launched do not depend on where
        decode = DecodeGraph(model, state, capture=False)
        verify = StepGraph(model, state, N_MAX + 1, keep_steps=True, capture=False)
        head = DraftHead.shortlisting(model.mtp_head)  # as --spec-draft-head auto scores drafts on a GPU
        draft = MTPDraftGraph(model, state, N_MAX, head, DRAFT_TOP_K, capture=False, chained=False)
        catch_up = MTPRowsGraph(model, state, N_MAX + 1, capture=False)
        graphs["decode"] = (lambda: [s._step() for s in decode.segments], trunk)
        graphs["verify"] = (lambda: [s._step() for s in verify.segments], trunk)
        # a draft drawn at a temperature (the server's default chain: top-k 40), through the same shortlisting head
        drawn = MTPDrawGraph(model, state, N_MAX, head, DRAFT_TOP_K, ChainShape(40, 0), capture=False, chained=False)
        graphs["mtp_draft"] = (draft._step, {"mtp_block": 1})
        graphs["mtp_draw"] = (drawn._step, {"mtp_block": 1})
        graphs["mtp_catch_up"] = (catch_up._step, {"mtp_block": 1})
        steps = {name: summary(count(step, n), layers) for name, (step, layers) in graphs.items()}
    plan = type_plan(config)
    return {
        "model": {k: v for k, v in asdict(config).items() if k != "recurrent"},
        "pattern": "recurrent[i] = (i + 1) % 4 != 0 for 64 trunk layers, then one MTP block",
        "n_max": N_MAX,
        "type_plan": plan_summary(plan, n),
        "type_plan_fixture_mismatches": fixture_mismatches(),
        "kernels_per_decode_step": steps["decode"]["kernels"],
        "kernels_per_verify_step": steps["verify"]["kernels"],
        "kernels_per_mtp_draft": steps["mtp_draft"]["kernels"] + two_stage_extra(),
        "kernels_per_mtp_draw": steps["mtp_draw"]["kernels"] + two_stage_extra(),
        "kernels_per_mtp_catch_up": steps["mtp_catch_up"]["kernels"],
        "steps": steps,
    }


def report(r: dict) -> str:
    lines = [
        f"kernels per decode step {r['kernels_per_decode_step']}, per verification step ({r['n_max'] + 1} tokens) "
        f"{r['kernels_per_verify_step']}, per MTP draft step {r['kernels_per_mtp_draft']} (drawn at a temperature "
        f"{r['kernels_per_mtp_draw']}), per MTP catch-up "
        f"({r['n_max'] + 1} rows) {r['kernels_per_mtp_catch_up']}"
    ]
    for name, s in r["steps"].items():
        kinds = ", ".join(
            f"{kind} {k['kernels']} ({k['per_layer']:.1f} x {k['layers']})" for kind, k in s["by_layer_kind"].items()
        )
        lines.append(f"  {name}: {s['kernels']} = {s['triton']} Triton + {s['aten']} aten; by layer kind: {kinds}")
        lines.append("    top: " + ", ".join(f"{k} {v}" for k, v in s["top"]))
        for key in ("host_kernel_calls", "host_reads", "unlisted_views"):
            if s[key]:
                lines.append(f"    {key}: {s[key]}")
    mismatches = r["type_plan_fixture_mismatches"]
    check = "no fixture" if mismatches is None else ("matches the fixture" if not mismatches else str(mismatches))
    lines.append(f"type plan: {r['type_plan']['tensors_by_type']} ({check})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the counts here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("bench/decode_launches.py: run with TRITON_INTERPRET=1 (the GPU path on CPU)", file=sys.stderr)
        return 2
    result = counts()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
