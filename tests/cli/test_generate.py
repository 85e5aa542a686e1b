"""`mtpserve generate` and `mtpserve perplexity` against llama.cpp's outputs for the same files."""

from __future__ import annotations

import json
import re

from mtpserve.cli import main

from ..conftest import shared_path, tinyqwen_path
from ..support.vocabs import reference


def test_generate_json_matches_llama_cpp(capsys):
    ref = reference("tinyqwen35-mtp-Q8_0")
    case = ref["greedy"]["completions"][0]
    n = 16
    rc = main(
        [
            "generate",
            "-m",
            str(tinyqwen_path("Q8_0")),
            "-p",
            case["prompt"],
            "-n",
            str(n),
            "--temp",
            "0",
            "--json",
            "--n-probs",
            "5",
            "--ignore-eos",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    first_tie = min(case["near_tie_positions"] + [n])
    assert rc == 0 and out["prompt_ids"] == case["prompt_token_ids"]
    assert out["generated_ids"][:first_tie] == case["generated_token_ids"][:first_tie]
    assert case["generated_text"].startswith(out["text"]) or first_tie < n
    for ours, theirs in zip(out["top_probs"], case["top_probs_first16"][:first_tie]):
        assert [t["id"] for t in ours] == [t["id"] for t in theirs["top"]]
        assert all(abs(a["prob"] - b["prob"]) < 2e-2 for a, b in zip(ours, theirs["top"]))


def test_generate_rejects_a_prompt_longer_than_the_context(capsys):
    rc = main(["generate", "-m", str(tinyqwen_path("Q8_0")), "-p", "x " * 300, "-n", "8", "-c", "256"])
    err = capsys.readouterr().err
    assert rc == 1 and "exceeds the available context size (256 tokens)" in err and "Traceback" not in err


def test_perplexity_prints_chunks_and_final_estimate_like_llama_perplexity(capsys):
    ref = reference("tinyqwen35-mtp-Q4_K_M")["perplexity"]
    text = shared_path("fixtures", "eval", ref["text_file"])
    rc = main(
        [
            "perplexity",
            "-m",
            str(tinyqwen_path("Q4_K_M")),
            "-f",
            str(text),
            "--ctx-size",
            str(ref["ctx"]),
            "--chunks",
            str(ref["chunks"]),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    chunks = re.findall(r"\[(\d+)\]([\d.]+),", out)
    final = float(re.search(r"Final estimate: PPL = ([\d.]+) \+/- [\d.]+", out).group(1))
    assert [int(i) for i, _ in chunks] == list(range(1, ref["chunks"] + 1))
    assert float(chunks[-1][1]) == final and abs(final - ref["ppl"]) / ref["ppl"] < 0.01
