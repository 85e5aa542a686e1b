"""The MTP draft's head (`--spec-draft-head`): a Q4_0 copy of the output layer shortlisting 64 rows for it, against
the output layer itself. What it keeps of the drafts, what it buys in time.

    .venv/bin/python bench/draft_head.py [--tokens 128] [--positions 1500] [--json OUT]

Three measurements, one table each:
* Real heads on real hidden states: the fixtures' tinyqwen35 (Q4_K_M, its Q6_K head, on its MTP block's output:
  what a draft scores), and the two PyPI models the tests hold to llama.cpp (SmolLM2-135M-Instruct, Gemma 3 270M:
  their Q8_0 heads, tied to the embeddings, on the trunk's final hidden states; their vocabularies 49,152 and
  262,144 wide), over `--positions` tokens of Python's json package and this project's docs. For each: how often
  the copy's own argmax is the head's (what a 4-bit head alone would draft), the worst place of the head's
  argmax in the copy's order (1: first), the share of positions whose head top-10 lie in the copy's top-64
  (then the shortlisted top-10 are the head's: the draft and its p_min probability), how often the shortlisted
  argmax is the head's (the draft itself), the bytes a draft step reads; and for drafts drawn at the server's
  default chain (T 0.8, top-k 40, top-p 0.95, min-p 0.05: models.graphs.MTPDrawGraph draws over the shortlisted
  rows on a GPU) the share of positions whose head top-40 lie in the copy's top-64, and the total variation
  between the chain's distribution over the shortlisted rows and over the whole row (engine.sampling's chain on
  both), mean and largest: what a draft's acceptance can lose to the shortlist (acceptance is the sum over tokens
  of min(p, q), which moving q by a distance d changes by at most d).
* tinyqwen35 in the engine, draft-mtp n_max 2, greedy, on CPU: drafted and accepted drafts with the whole head and
  with the shortlisting one (`--tokens` a prompt, bench/draft_vocab.py's prompts).
* The decode cycle's time model (bench/gpu_time_model.py) for the 27B at 4096 and 131072 tokens with draft-mtp:
  a draft step reading the 1.04 GB output layer, or the 0.72 GB copy and 64 of the head's rows; the deployment's
  63% acceptance for both (the shortlist keeps the head's drafts where the copy's top 64 hold its top 10).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gpu_time_model as tm
import torch
from draft_vocab import TINY, texts, tiny_drafts

from mtpserve.engine import SamplingParams, SpecConfig
from mtpserve.engine.sampling import Sampler
from mtpserve.models.draft_head import SHORTLIST, DraftHead
from mtpserve.models.loader import load
from mtpserve.ops.linear import linear
from mtpserve.tokenizer import Tokenizer

MODELS = Path.home() / ".cache" / "mtpserve" / "models"  # `make models`
HEADS = {
    "tinyqwen35 Q4_K_M (MTP head)": TINY,
    "SmolLM2-135M-Instruct Q4_1": MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "Gemma 3 270M Q4_K_M": MODELS / "gemma-3-270m-q4_k_m.gguf",
}
STATIC = tm.REPO / "docs" / "perf" / "gpu_static_after.json"
TOP_K = 10  # the draft's top-k (engine.drafters.DRAFT_TOP_K): its argmax and its p_min probability
DEFAULT_CHAIN = SamplingParams(temperature=0.8)  # llama-server's: top-k 40, top-p 0.95, min-p 0.05


def within(top: torch.Tensor, shortlist: torch.Tensor) -> torch.Tensor:
    """Per position, whether every id of `top` [P, k] is among `shortlist` [P, s]."""
    return (top[:, :, None] == shortlist[:, None, :]).any(-1).all(-1)


def chain_distance(exact: torch.Tensor, shortlist: torch.Tensor) -> float:
    """Total variation between the default chain's distribution over a whole row `exact` [V] and over its
    `shortlist` rows alone (the rest -inf), as engine.sampling computes both."""
    whole = Sampler(DEFAULT_CHAIN).probabilities(exact)
    row = torch.full_like(exact, float("-inf"))
    row[shortlist] = exact[shortlist]
    short = Sampler(DEFAULT_CHAIN).probabilities(row)
    return 0.5 * sum(abs(whole.get(t, 0.0) - short.get(t, 0.0)) for t in whole.keys() | short.keys())


def hidden_states(path: Path, positions: int) -> tuple[object, torch.Tensor]:
    """The model and what its draft head (or LM head) scores over `positions` tokens of code and prose."""
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    half = [tokenizer.encode(t[:20000], add_special=False)[: positions // 2] for t in texts().values()]
    mtp = getattr(model, "mtp_kv_index", None) is not None
    rows = []
    for ids in half:
        state = model.new_state(positions, mtp=True) if mtp else model.new_state(positions)
        hidden = torch.cat([model.forward(torch.tensor(ids[i : i + 256]), state) for i in range(0, len(ids), 256)])
        if mtp:
            _, hidden = model.mtp_step(hidden[:-1], torch.tensor(ids[1:]), state, with_logits=False)
        rows.append(hidden)
    return model, torch.cat(rows)


def head_recall(positions: int) -> list[dict]:
    rows = []
    for name, path in HEADS.items():
        if not Path(path).exists():
            print(f"{name}: {path} missing (make models)", file=sys.stderr)
            continue
        model, h = hidden_states(Path(path), positions)
        head = model.mtp_head if getattr(model, "mtp_kv_index", None) is not None else model.output
        short = DraftHead.shortlisting(head)
        assert short.coarse is not None
        exact = linear(h, head)
        coarse = linear(h, short.coarse)
        best = exact.argmax(-1)
        rank = (coarse > coarse.gather(1, best[:, None])).sum(-1)
        top10, top64 = exact.topk(TOP_K).indices, coarse.topk(SHORTLIST).indices
        held, held40 = (within(top, top64) for top in (top10, exact.topk(40).indices))
        same = sum(int(short.top(row[None], TOP_K)[1][0]) == int(b) for row, b in zip(h, best))
        distance = [chain_distance(row.float(), ids) for row, ids in zip(exact, top64)]
        rows.append(
            {
                "head": name,
                "type": head.ggml_type.name,
                "vocab": head.shape[0],
                "n_embd": head.shape[1],
                "positions": len(h),
                "copy_argmax_is_head_argmax": round(float((rank == 0).float().mean()), 4),
                "worst_place_of_head_argmax_in_copy": int(rank.max()) + 1,  # 1: the copy's own argmax
                "head_top10_in_copy_top64": round(float(held.float().mean()), 4),
                "shortlisted_argmax_is_head_argmax": round(same / len(h), 4),
                "head_top40_in_copy_top64": round(float(held40.float().mean()), 4),
                "default_chain_distance_mean": round(sum(distance) / len(distance), 5),
                "default_chain_distance_max": round(max(distance), 4),
                "bytes_read_over_head": round(short.nbytes_read() / head.nbytes, 3),
            }
        )
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def tiny_acceptance(tokens: int) -> list[dict]:
    rows = []
    for head in ("full", "q4_0"):
        rows.append({"draft_head": head, **tiny_drafts(SpecConfig("draft-mtp", n_max=2, draft_head=head), tokens)})
        print(f"tinyqwen35 draft head {head}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def predicted() -> list[dict]:
    """gpu_time_model's prediction with gpu_static's attention bounds and kernel counts (its draft step's are the
    shortlisting head's, 5 more than the whole head's: 15 us a cycle, left in both), the head's bytes as given."""
    static = json.loads(STATIC.read_text())
    host = tm.measure_host()
    rows = []
    for shortlist in (False, True):
        weights = tm.Bytes.of_deployment(shortlist=shortlist)
        result = tm.predict(
            host_ms_per_token=host[0],
            host_ms_per_mtp_cycle=host[1],
            attention_tbps=tm.attention_bounds(static),
            kernels=tm.kernel_counts(static),
            weights=weights,
        )
        for p in result:
            if p["spec"] == "draft-mtp" and p["device"] in ("H200", "2x2080Ti"):
                rows.append({"draft_head": "q4_0" if shortlist else "full", "draft_head_gb": weights.draft_head / 1e9,
                             "device": p["device"], "context": p["context"], "tok_s": p["tok_s"]})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--positions", type=int, default=1500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    recall = head_recall(args.positions)
    tiny = tiny_acceptance(args.tokens)
    prediction = predicted()
    print(
        "| head | type | vocab | positions | copy's argmax is the head's | worst place of the head's argmax in the "
        "copy | head's top-10 in the copy's top-64 | shortlisted argmax is the head's | bytes read | head's top-40 in "
        "the copy's top-64 | default chain, shortlisted against whole: total variation, mean / largest |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in recall:
        print(
            f"| {r['head']} | {r['type']} | {r['vocab']:,} | {r['positions']} | {r['copy_argmax_is_head_argmax']:.1%} "
            f"| {r['worst_place_of_head_argmax_in_copy']} | {r['head_top10_in_copy_top64']:.1%} "
            f"| {r['shortlisted_argmax_is_head_argmax']:.1%} | {r['bytes_read_over_head']:.2f}x "
            f"| {r['head_top40_in_copy_top64']:.1%} "
            f"| {r['default_chain_distance_mean']:.4f} / {r['default_chain_distance_max']:.3f} |"
        )
    print("\n| tinyqwen35 draft head | drafted | accepted | acceptance |\n|---|---:|---:|---:|")
    for r in tiny:
        print(f"| {r['draft_head']} | {r['drafted']} | {r['accepted']} | {r['acceptance']:.1%} |")
    print("\n| 27B draft head | GB a draft step reads | device | context | tok/s predicted |\n|---|---:|---|---:|---:|")
    for p in prediction:
        print(f"| {p['draft_head']} | {p['draft_head_gb']:.2f} | {p['device']} | {p['context']:,} | {p['tok_s']} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"heads": recall, "tinyqwen35": tiny, "predicted": prediction}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
