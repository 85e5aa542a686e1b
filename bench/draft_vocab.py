"""The MTP draft's vocabulary (`--spec-draft-vocab N`: the draft scores only the first N token ids, so a draft step
reads N rows of the 1.04 GB output layer instead of all 248,320): what it costs in acceptance, what it buys in time.

    .venv/bin/python bench/draft_vocab.py [--tokens 128] [--json OUT]

Three measurements, one table each:
* tinyqwen35 (Q4_K_M, its own 4,096-token vocabulary), draft-mtp n_max 2, greedy, through the engine: drafts and
  accepted drafts for N = all, 2048, 1024, 512, over prompts cut from Python's standard library and this
  project's docs (`--tokens` each).
* The fixtures' Qwen3.5 vocabulary (../shared/fixtures/vocab/ggml-vocab-qwen35.gguf, 151,936 tokens; the 27B's
  has 248,320 and may order them otherwise: the only Qwen vocabulary on hand): the share of tokens with an id
  below N in code (the standard library's json package, statistics.py, argparse.py), in English prose
  (docs/*.md), and in other languages (the Japanese, Chinese, Korean, Russian, Arabic and Hindi message catalogs
  of this machine's /usr/share/locale, where present). A draft can only be accepted when the target's token is
  among the first N, so that share bounds what N keeps of the acceptance.
* The decode cycle's time model (bench/gpu_time_model.py) for the 27B at 4096 tokens with draft-mtp n_max 2, the
  draft step's output layer cut to N rows, and the deployment's 63% acceptance scaled by the share above (the
  code's; assumed: a target token outside the first N is a rejected draft, one inside is accepted as often as
  before).
"""

from __future__ import annotations

import argparse
import gettext
import glob
import json
import sys
import sysconfig
from pathlib import Path

import gpu_time_model as tm
import torch

from mtpserve.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams, SpecConfig
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
TINY = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"
QWEN_VOCAB_FILE = FIXTURES / "vocab" / "ggml-vocab-qwen35.gguf"
TINY_SIZES = (0, 2048, 1024, 512)
QWEN_SIZES = (0, 131072, 65536, 32768, 16384)
LANGUAGES = ("ja", "zh_CN", "ko", "ru", "ar", "hi")


def texts() -> dict[str, str]:
    std = Path(sysconfig.get_paths()["stdlib"])
    code = [*sorted(std.glob("json/*.py")), std / "statistics.py", std / "argparse.py"]
    docs = sorted(glob.glob(str(REPO / "docs" / "*.md")))
    return {"code": "".join(p.read_text() for p in code), "prose": "".join(Path(p).read_text() for p in docs)}


def translations(limit: int = 40_000) -> str:
    """Translated messages of the gettext catalogs under /usr/share/locale, up to `limit` characters a language."""
    out = []
    for lang in LANGUAGES:
        text = ""
        for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
            try:
                with open(path, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog  # the messages themselves
            except (OSError, UnicodeDecodeError):
                continue
            text += "\n".join(v for k, v in catalog.items() if k and isinstance(v, str))
            if len(text) >= limit:
                break
        out.append(text[:limit])
    return "".join(out)


def tiny_drafts(spec: SpecConfig, tokens: int) -> dict:
    """tinyqwen35's drafts and accepted drafts under `spec`, greedy, `tokens` after each of 4 prompts (the first
    384 tokens of 1,200 characters from the code and the prose, at two places each)."""
    tokenizer = Tokenizer.from_gguf(TINY)
    prompts = [t[i : i + 1200] for t in texts().values() for i in (0, 20000)]
    config = EngineConfig(n_parallel=1, ctx_size=2048, spec=spec)
    drafted = accepted = 0
    with Engine(load(TINY), tokenizer, config, plan_for_file(TINY, config)) as engine:
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_special=False)[:384]
            request = Request(ids, SamplingParams(temperature=0.0), n_predict=tokens, ignore_eos=True)
            finish = next(e for e in engine.submit(request) if isinstance(e, FinishEvent))
            drafted += finish.timings.draft_n
            accepted += finish.timings.draft_n_accepted
    return {"drafted": drafted, "accepted": accepted, "acceptance": round(accepted / max(drafted, 1), 4)}


def tiny_acceptance(tokens: int) -> list[dict]:
    rows = []
    for size in TINY_SIZES:
        rows.append(
            {"draft_vocab": size or 4096, **tiny_drafts(SpecConfig("draft-mtp", n_max=2, draft_vocab=size), tokens)}
        )
        print(f"tinyqwen35 draft vocab {size or 'all'}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def qwen_coverage() -> dict[str, dict[int, float]]:
    tokenizer = Tokenizer.from_gguf(QWEN_VOCAB_FILE)
    out = {}
    for name, text in {**texts(), "other languages": translations()}.items():
        ids = tokenizer.encode(text, add_special=False)
        if ids:
            out[name] = {
                size: round(sum(1 for i in ids if i < (size or tm.VOCAB)) / len(ids), 4) for size in QWEN_SIZES
            }
    return out


def predicted(coverage: dict[int, float]) -> list[dict]:
    host = tm.measure_host()
    weights = tm.Bytes.of_deployment(shortlist=False)  # the whole head, cut to its first N rows
    rows = []
    for size in QWEN_SIZES:
        kept = size or tm.VOCAB
        head = weights.output_layer * kept // tm.VOCAB
        cut = tm.Bytes(weights.trunk, weights.mtp_block, head, head)
        acceptance = tm.ACCEPTANCE * coverage[size]
        result = tm.predict(
            host_ms_per_token=host[0], host_ms_per_mtp_cycle=host[1], weights=cut, acceptance=acceptance
        )
        speeds = {p["device"]: p["tok_s"] for p in result if p["context"] == 4096 and p["spec"] == "draft-mtp"}
        rows.append({"draft_vocab": kept, "acceptance": round(acceptance, 4), "tok_s": speeds})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tiny = tiny_acceptance(args.tokens)
    coverage = qwen_coverage()
    prediction = predicted(coverage["code"])
    print("| tinyqwen35 draft vocabulary | drafted | accepted | acceptance |\n|---:|---:|---:|---:|")
    for r in tiny:
        print(f"| {r['draft_vocab']:,} | {r['drafted']} | {r['accepted']} | {r['acceptance']:.1%} |")
    kinds = list(coverage)
    print(f"\n| first N ids | {' | '.join(kinds)} | 27B acceptance (63% x code) | H200 tok/s | 2 x 2080 Ti tok/s |")
    print("|---:|" + "---:|" * (len(kinds) + 3))
    for size, p in zip(QWEN_SIZES, prediction, strict=True):
        shares = " | ".join(f"{coverage[k][size]:.1%}" for k in kinds)
        speeds = f"{p['tok_s']['H200']} | {p['tok_s']['2x2080Ti']}"
        print(f"| {p['draft_vocab']:,} | {shares} | {p['acceptance']:.1%} | {speeds} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"tinyqwen35": tiny, "coverage": coverage, "predicted": prediction}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
