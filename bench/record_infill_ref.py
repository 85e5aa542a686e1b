"""Record llama-server's /infill on tinyqwen35 given FIM tokens (tests/support/fim_models.py), for
tests/server/test_infill.py, which holds mtpserve's /infill to it:

    PYTHONPATH=. .venv/bin/python bench/record_infill_ref.py --llama-server PATH

Three servers (`-np 1 -c 512 -b 64 -n 16`, so that the prefix, suffix and extra context are cut; without `-n`
the extra context alone would fill n_ctx - n_batch + 2 tokens, and with the rest overflow the slot): the model with
prefix, suffix and middle tokens only; with the repo and file-separator tokens too; the latter with
`--spm-infill`. Each answers the cases below greedily; recorded per case: the request, the prompt as llama-server
renders it, its token count, the generated token ids and the top-1 / top-2 logprob margins (near ties < 0.05 nats).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import httpx

from mtpserve.tuning.runner import managed_server
from tests.support.fim_models import fim_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "tinyqwen35_infill_llama.json"
SERVER_FLAGS = ["-np", "1", "-c", "512", "-b", "64", "-n", "16", "-t", "2"]
CONFIGS = [("fim", []), ("fim_repo", []), ("fim_repo", ["--spm-infill"])]
LONG_CODE = "".join(f"def step_{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(24))
CASES = {
    "llama_test": {  # llama.cpp's tools/server/tests/unit/test_infill.py
        "input_prefix": '#include <cstdio>\n#include "llama.h"\n\nint main() {\n',
        "prompt": "    int n_threads = llama_",
        "input_suffix": "}\n",
    },
    "extra_files": {
        "input_extra": [
            {"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"},
            {"text": "def helper():\n    return 42\n"},  # no filename: llama-server's "tmp"
        ],
        "input_prefix": "import os\n\ndef main():\n",
        "prompt": "    value = helper",
        "input_suffix": "\n    print(value)\n",
    },
    "everything_cut": {  # prefix over 3/4 of -b 64, suffix over the rest, extra files over n_ctx - n_batch + 2
        "input_extra": [{"filename": f"mod_{i}.py", "text": LONG_CODE} for i in range(3)],
        "input_prefix": LONG_CODE,
        "prompt": "def step_24(",
        "input_suffix": LONG_CODE,
    },
    "mixed_and_special_text": {  # token ids among the prefix's strings; "<think>" in code stays text, in the
        # prompt it is parsed as the special token
        "input_prefix": ["x = '<think>'\n", 17, 42, "\nclass A:\n"],
        "prompt": "    <think>",
        "input_suffix": ["    pass\n", 99],
    },
    "no_prompt_no_suffix": {"input_prefix": "for i in range(10):\n", "input_suffix": ""},
}
NEAR_TIE = 0.05
# llama-server's limits for code completion, on the repo variant's server: (path, body) each answered greedily
EDITOR_CASES = {
    "infill_n_indent_1": ("/infill", {**CASES["llama_test"], "n_indent": 1, "n_predict": 32}),
    "completion_n_indent_4": ("/completion", {"prompt": "def fibonacci(n):\n", "n_indent": 4, "n_predict": 64}),
    "completion_n_indent_8": ("/completion", {"prompt": "def fibonacci(n):\n", "n_indent": 8, "n_predict": 64}),
    "completion_no_indent_limit": ("/completion", {"prompt": "def fibonacci(n):\n", "n_predict": 64}),
}
# requests naming their own sampler chain (`samplers`), drawn with a seed: llama.vim's and llama.vscode's infill
# chain, a chain in chars, greedy by a temperature stage first, penalties after top-k
LLAMA_VIM = {"top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True}
OWN_CHAINS = {
    "llama_vim_infill": ("/infill", {**CASES["no_prompt_no_suffix"], **LLAMA_VIM, "n_predict": 24, "seed": 42}),
    "llama_vim_infill_cut": ("/infill", {**CASES["everything_cut"], **LLAMA_VIM, "n_predict": 24, "seed": 11}),
    "llama_vim_infill_mixed": ("/infill", {**CASES["mixed_and_special_text"], **LLAMA_VIM, "n_predict": 24, "seed": 3}),
    "llama_vim_infill_extra": ("/infill", {**CASES["extra_files"], **LLAMA_VIM, "n_predict": 24, "seed": 7}),
    "chars_kt": ("/completion", {"prompt": "def fibonacci(n):\n", "samplers": "kt", "temperature": 0.7, "seed": 3}),
    "temperature_first_greedy": (
        "/completion",
        {"prompt": "import numpy as np\n", "samplers": ["temperature", "top_k"], "temperature": 0.0, "seed": 5},
    ),
    "penalties_after_top_k": (
        "/completion",
        {"prompt": "class Stack:\n", "samplers": ["top_k", "penalties", "min_p"], "repeat_penalty": 1.3, "seed": 9},
    ),
}
# the fields llama.vim asks for (autoload/llama.vim)
RESPONSE_FIELDS = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached", "nothing/here"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--n-predict", type=int, default=12)
    args = ap.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, extra_flags in CONFIGS:
            model = fim_model(variant, Path(tmp))
            cmd = [args.llama_server, "-m", str(model), *SERVER_FLAGS, *extra_flags]
            with managed_server(cmd) as url, httpx.Client(timeout=600) as c:
                for name, case in CASES.items():
                    options = {"n_predict": args.n_predict, "temperature": 0.0, "n_probs": 2, "cache_prompt": False}
                    r = c.post(f"{url}/infill", json=case | options | {"return_tokens": True})
                    if r.status_code != 200:
                        raise SystemExit(f"{variant} {name}: {r.status_code} {r.text}")
                    answer = r.json()
                    probs = answer["completion_probabilities"]
                    margins = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in probs]
                    records.append(
                        {
                            "variant": variant,
                            "flags": extra_flags,
                            "case": name,
                            "prompt": answer["prompt"],
                            "tokens_evaluated": answer["tokens_evaluated"],
                            "generated_token_ids": answer["tokens"],
                            "top1_top2_logprob_margin": margins,
                            "near_tie_positions": [i for i, m in enumerate(margins) if m < NEAR_TIE],
                        }
                    )
                    print(variant, extra_flags, name, answer["tokens_evaluated"], repr(answer["content"]))
        editor = {}
        with managed_server([args.llama_server, "-m", str(fim_model("fim_repo", Path(tmp))), *SERVER_FLAGS]) as url:
            for name, (path, case) in EDITOR_CASES.items():
                body = case | {"temperature": 0.0, "n_probs": 2, "cache_prompt": False, "return_tokens": True}
                answer = httpx.post(f"{url}{path}", json=body, timeout=600).json()
                margins = [
                    p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"]
                    for p in answer["completion_probabilities"]
                ]
                editor[name] = {
                    "path": path,
                    "body": case,
                    "content": answer["content"],
                    "stop_type": answer["stop_type"],
                    "generated_token_ids": answer["tokens"],
                    "near_tie_positions": [i for i, m in enumerate(margins) if m < NEAR_TIE],
                }
                print(name, answer["stop_type"], repr(answer["content"]))
            for name, (path, case) in OWN_CHAINS.items():
                body = {"n_predict": 24} | case | {"cache_prompt": False, "return_tokens": True}
                answer = httpx.post(f"{url}{path}", json=body, timeout=600).json()
                editor[name] = {"path": path, "body": case, "content": answer["content"], "tokens": answer["tokens"]}
                print(name, answer["stop_type"], repr(answer["content"]))
            body = CASES["llama_test"] | {"n_predict": 8, "temperature": 0.0, "response_fields": RESPONSE_FIELDS}
            fields = httpx.post(f"{url}/infill", json=body, timeout=600).json()
            editor["response_fields"] = {"body": body, "keys": sorted(fields), "content": fields["content"]}
            print("response_fields", fields)
        # without -n the files alone may fill n_ctx - n_batch + 2 tokens: the prompt overflows the slot
        model = fim_model("fim", Path(tmp))
        flags = ["-np", "1", "-c", "512", "-b", "64", "-t", "2"]
        with managed_server([args.llama_server, "-m", str(model), *flags]) as url:
            r = httpx.post(f"{url}/infill", json=CASES["everything_cut"], timeout=600)
            overflow = {"variant": "fim", "server_flags": flags, "case": "everything_cut", "status": r.status_code}
            overflow["error"] = r.json()["error"]
            print("overflow", r.status_code, r.text[:200])
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True).stderr.strip()
    version = next((line for line in version.splitlines() if line.startswith("version:")), version)
    record = {"llama_server": version, "server_flags": SERVER_FLAGS, "n_predict": args.n_predict}
    args.out.write_text(
        json.dumps({**record, "cases": CASES, "answers": records, "overflow": overflow, "editor": editor}, indent=1)
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
