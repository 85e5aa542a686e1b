"""Record llama.cpp's infill sampler (llama_sampler_infill_apply) on candidate lists, for
tests/engine/test_sampler_order.py, which holds engine/sampler_order.infill to it decision for decision:

    PYTHONPATH=. .venv/bin/python bench/record_infill_sampler_ref.py --llama-cpp PATH/TO/llama.cpp

PATH/TO/llama.cpp: a source tree built with `cmake -B build` (its build/bin/libllama.so). A 25-line C program is
compiled against it that loads the vocabulary of tinyqwen35 given FIM tokens (tests/support/fim_models.py) and runs
the sampler on each list. The lists: the top 40 of the model's own logits along greedy continuations of prompts of
code (what llama.vim's chain hands the stage before top-p), shuffled; the same lists with their logits scaled
(flatter and sharper); and random lists with end-of-generation tokens among them, for the stage's two other
branches (only the end tokens left; no text token likely enough: the end token alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer
from tests.support.fim_models import fim_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "infill_sampler_llama.json"
HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"
int main(int argc, char **argv) {  /* stdin: "n id logit ..." a list; stdout: the survivors, "m id logit ..." */
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n;
    while (scanf("%d", &n) == 1) {
        llama_token_data *data = calloc(n, sizeof(llama_token_data));
        for (int i = 0; i < n; i++) { if (scanf("%d %f", &data[i].id, &data[i].logit) != 2) return 2; }
        llama_token_data_array arr = {data, (size_t)n, -1, false};
        struct llama_sampler *s = llama_sampler_init_infill(vocab);
        llama_sampler_apply(s, &arr);
        printf("%zu", arr.size);
        for (size_t i = 0; i < arr.size; i++) printf(" %d %.9g", arr.data[i].id, arr.data[i].logit);
        printf("\n");
        llama_sampler_free(s);
        free(data);
    }
    llama_model_free(model);
    return 0;
}
"""
PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n", "for i in range(10):\n    print(", "x = {'a': "]


def candidate_lists(model_path: Path, rng: np.random.Generator) -> list[tuple[list[int], list[float]]]:
    model, tokenizer = load(model_path), Tokenizer.from_gguf(model_path)
    eog = sorted(tokenizer.eog_ids)
    lists = []
    with torch.inference_mode():
        for text in PROMPTS:
            state = model.new_state(256)
            logits = model.prefill(tokenizer.encode(text, add_special=False), state)
            for _ in range(12):
                row = logits.float().numpy()
                top = np.argsort(-row, kind="stable")[:40]
                for scale in (1.0, 0.5, 2.0):
                    order = rng.permutation(len(top))
                    lists.append(([int(t) for t in top[order]], [float(row[t] * scale) for t in top[order]]))
                logits = model.decode(int(top[0]), state)
    for n in (3, 8, 20, 40):  # random lists with end tokens, flat to sharp
        for spread in (0.1, 1.0, 4.0):
            ids = rng.choice(np.arange(4090), size=n - 1, replace=False).tolist() + [int(rng.choice(eog))]
            values = (rng.standard_normal(n) * spread).astype(np.float32).tolist()
            lists.append((ids, values))
    return lists


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree, built (build/bin)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "infill_ref.c", Path(tmp) / "infill_ref"
        src.write_text(HARNESS)
        lib = args.llama_cpp / "build" / "bin"
        includes = ["-I", str(args.llama_cpp / "include"), "-I", str(args.llama_cpp / "ggml" / "include")]
        subprocess.run(["gcc", "-O1", "-o", str(exe), str(src), *includes, "-L", str(lib), "-lllama",
                        f"-Wl,-rpath,{lib}"], check=True)  # fmt: skip
        model = fim_model("fim_repo", Path(tmp))
        lists = candidate_lists(model, np.random.default_rng(0))
        stdin = "".join(f"{len(ids)} " + " ".join(f"{t} {v:.9g}" for t, v in zip(ids, vs)) + "\n" for ids, vs in lists)
        done = subprocess.run([str(exe), str(model)], input=stdin, capture_output=True, text=True, check=True)
    cases = []
    for (ids, values), line in zip(lists, done.stdout.splitlines()):
        fields = line.split()
        survivors = [(int(fields[1 + 2 * i]), float(fields[2 + 2 * i])) for i in range(int(fields[0]))]
        cases.append({"ids": ids, "logits": values, "survivor_ids": [s[0] for s in survivors],
                      "survivor_logits": [s[1] for s in survivors]})  # fmt: skip
    args.out.write_text(
        json.dumps({"model": "tinyqwen35 fim_repo (tests/support/fim_models.py)", "cases": cases}) + "\n"
    )
    kinds = {len(c["survivor_ids"]) for c in cases}
    print(f"wrote {args.out}: {len(cases)} lists, survivor counts {sorted(kinds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
