"""How far a path's log-probabilities lie from llama.cpp's, and how far the model itself carries a tiny change.

    .venv/bin/python bench/numerics_vs_llama.py [--model smollm2|gemma3|tinyqwen35] [--path cpu|gpu]
        [--positions 8] [--perturb 1e-5] [--json OUT]

Every greedy case of the model's fixture (../shared/fixtures/refs: llama.cpp's completions, with the top-5
log-probabilities of their first 16 positions), teacher-forced: the prompt, then llama.cpp's tokens one at a time,
with the f16 KV cache and the 4096-token context its server ran with, and its prompt batches (a model with recurrent or
sliding-window layers has its prompt cut 4 and 516 tokens before the end, where llama-server keeps checkpoints: batch
ends change float rounding). At each of the first --positions positions, the path's log-probability of
each of llama.cpp's five candidates against llama.cpp's: the table gives the mean, 90th percentile and largest
difference (nats). `--path gpu` is the GPU path: on CUDA where there is one, else emulated on CPU under the Triton
interpreter with the matmuls on their PyTorch twins (~6 s a SmolLM2 token).

`--perturb EPS` also runs the path with the first block's output multiplied by 1 + EPS * N(0, 1) per element and
gives the same statistics between the two runs: how far the model carries a change the size of float32 summation
order (the GPU path and the CPU path differ by 1e-5 relative at SmolLM2's first block). A path whose distance from
llama.cpp is no larger than that shows no error beyond what the model makes of rounding alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.server_batches import needs_checkpoints, server_prompt_batches  # noqa: E402

FIXTURES = REPO.parent / "shared" / "fixtures"
CONTEXT = 4096  # the fixtures' llama-server: -c 4096
REFS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.json",
    "gemma3": "gemma-3-270m-q4_k_m.json",
    "tinyqwen35": "tinyqwen35-mtp-Q4_K_M.json",
}


def model_file(key: str) -> Path:
    from mtpserve.default_models import DEFAULT_MODELS, model_path

    return FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf" if key == "tinyqwen35" else model_path(DEFAULT_MODELS[key])


@contextmanager
def perturbed_first_block(model, eps: float) -> Iterator[None]:
    """Within the block, the model's first block returns its output times 1 + eps * N(0, 1) (seeded)."""
    import torch

    first, cls = model.layers[0], type(model.layers[0])
    call = cls.__call__

    def perturbed(self, *args, **kwargs):
        y = call(self, *args, **kwargs)
        if self is not first:
            return y
        return y * (1 + eps * torch.randn(y.shape, generator=torch.Generator().manual_seed(0)).to(y.device))

    cls.__call__ = perturbed
    try:
        yield
    finally:
        cls.__call__ = call


def teacher_forced(model, cases: list[dict], positions: int, gpu: bool, eps: float = 0.0) -> list[list]:
    """Per case and position: the log-probabilities (float list over the vocabulary's llama.cpp candidates)."""
    import torch

    from mtpserve.ops.device import emulate_gpu

    emulated = gpu and not torch.cuda.is_available()
    out = []
    with emulate_gpu(matmul="torch") if emulated else nullcontext():
        with perturbed_first_block(model, eps) if eps else nullcontext():
            for n, case in enumerate(cases):
                ids = case["prompt_token_ids"]
                state = model.new_state(CONTEXT, "f16", "f16")
                start = 0
                for end in server_prompt_batches(len(ids), None, needs_checkpoints(model)):
                    logits = model.prefill(ids[start:end], state)
                    start = end
                rows = []
                for pos in range(positions):
                    logprobs = torch.log_softmax(logits.float().reshape(-1).cpu(), -1)
                    rows.append([logprobs[c["id"]].item() for c in case["top_probs_first16"][pos]["top"]])
                    logits = model.decode(case["generated_token_ids"][pos], state)
                out.append(rows)
                print(f"  case {n + 1}/{len(cases)} ({case['name']})", file=sys.stderr, flush=True)
    return out


def stats(a: list[list], b: list[list]) -> dict:
    import torch

    d = (torch.tensor(a) - torch.tensor(b)).abs().flatten()
    return {"n": d.numel(), "mean": d.mean().item(), "p90": d.quantile(0.9).item(), "max": d.max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(REFS), default="smollm2")
    parser.add_argument("--path", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--positions", type=int, default=8, help="positions a case, at most 16")
    parser.add_argument("--perturb", type=float, default=0.0, metavar="EPS")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    if args.path == "gpu" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: emulating the GPU path needs TRITON_INTERPRET=1 set before the run")
    from mtpserve.models.loader import load

    ref = json.loads((FIXTURES / "refs" / REFS[args.model]).read_text())
    cases = ref["greedy"]["completions"]  # raw prompts (the chat cases' batches also end at the last user turn)
    positions = min(args.positions, *(len(c["top_probs_first16"]) for c in cases))
    llama = [[[c["logprob"] for c in p["top"]] for p in case["top_probs_first16"][:positions]] for case in cases]
    device = "cuda" if args.path == "gpu" and torch.cuda.is_available() else "cpu"
    model = load(model_file(args.model), device=device)
    ours = teacher_forced(model, cases, positions, args.path == "gpu")
    rows = {"against llama.cpp": stats(ours, llama)}
    if args.perturb:
        rows[f"perturbed by {args.perturb:g} at block 0"] = stats(
            ours, teacher_forced(model, cases, positions, args.path == "gpu", args.perturb)
        )
    print(f"{args.model}, {args.path} path ({device}), {len(cases)} cases x {positions} positions x top 5, nats")
    print(f"{'':32} {'mean':>8} {'p90':>8} {'max':>8}")
    for name, s in rows.items():
        print(f"{name:32} {s['mean']:8.4f} {s['p90']:8.4f} {s['max']:8.4f}")
    if args.json:
        meta = {"model": args.model, "path": args.path, "device": device, "positions": positions}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
