"""A static performance model of the CUDA decode step, without a GPU: kernels launched per step, and each decode
kernel's instruction-issue bound against the memory bandwidth it should reach.

    .venv/bin/python bench/gpu_static.py [--json OUT] [--quick]

Two parts, run side by side (the counts in a subprocess under TRITON_INTERPRET=1, the compiles here without it):

* Kernel counts (bench/decode_launches.py): kernels_per_decode_step, kernels_per_verify_step (n_max + 1 = 3
  tokens, per-token states kept), kernels_per_mtp_draft and kernels_per_mtp_catch_up, with the top kernel names
  and a breakdown per layer kind, on the 27B's layer pattern and Q4_K_M type plan at small widths.
* Decode kernels: every configuration of tests/support/gpu_compile.py's `launches()` with `decode` set, compiled
  for sm_90 and sm_75 (Triton's ahead-of-time pipeline and bundled ptxas), its hot loop read off the SASS
  (tests/support/sass.py). For each: registers, spill bytes, SASS instructions per loop iteration (per warp),
  weight (or KV) bytes a program reads per iteration, num_warps, and

      issue_bound_tbps = bytes_per_iteration / (num_warps * sass_instructions_per_iteration)
                         * SMs * 4 schedulers * clock / 1e12

  the bandwidth at which the SMs run out of instruction issue slots. `ok`: issue_bound >= 1.5 x the HBM
  bandwidth and no spills. Kernels without a memory-streaming loop (attention's combine pass; the gated delta
  rule without kept states, whose state is read before its loop over tokens and written after) have a null
  bound: `ok` is then no spills alone.

The model's assumptions: one warp instruction per scheduler per cycle is the ceiling (4 schedulers an SM on both
parts, no dual issue); every SASS line of the loop issues once per iteration, predicated off or not; each weight
byte comes from DRAM once; clocks at boost (H200 1.98 GHz, RTX 2080 Ti 1.545 GHz). It ignores latency hiding,
occupancy, tail effects (the last wave of programs), the L2 (activations and reused KV tiles come from it), the
code outside the loop, and the other kernels' time. So it is an upper bound on what a kernel can stream: a kernel
below 1.5 x HBM cannot be memory-bound; one above it may still not be (latency, occupancy).

Calibration, when a GPU is lent: bench/gpu_check.sh's GEMV micro-benchmark (bench/gemv_l2.py, weights rotated
through more than twice the L2) measures the achieved bandwidth of each GEMV configuration; measured / min(issue
bound, HBM) per configuration is the calibration, and a kernel whose ratio stays well below 1 is limited by what
the model ignores.

`--quick` (the test suite's run): the counts, and only the decode launches marked quick. The full run compiles
every decode configuration for both archs in parallel (minutes on 2 cores).

Then the decode cycle's time model (bench/gpu_time_model.py, its assumptions in its docstring) from these counts
and decode attention's bounds, with the host time measured here by bench/engine_overhead.py's stand-in: the JSON's
`predicted` (tok/s and ms a token by part for an H200 and 2 x RTX 2080 Ti with the layer split, at 4096 and 131072
tokens, with and without draft-mtp), `predicted_sampled` (the same at the server's default chain, drafts drawn),
`predicted_row_split` (the two 2080 Ti as issue 40's tensor parallelism, over PCIe and over NVLink: built on CPU
ranks, not on CUDA), `row_split_vs_layer_split`, `host_ms_per_mtp_cycle` and `host_ms_per_mtp_cycle_sampled`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "TRITON_INTERPRET" in os.environ:  # compiling needs triton without its interpreter
    os.environ.pop("TRITON_INTERPRET")
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

import argparse
import json
import multiprocessing
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import gpu_time_model  # noqa: E402

from tests.support import gpu_compile, sass  # noqa: E402

GOAL = 1.5  # the issue bound must clear the HBM bandwidth by this factor (issue 19)


@dataclass(frozen=True)
class Arch:
    gpu: str
    sms: int
    schedulers: int  # per SM, each issuing one warp instruction a cycle
    clock_ghz: float  # boost
    hbm_tbps: float


ARCHS = {
    90: Arch("H200", 132, 4, 1.98, 4.8),
    75: Arch("RTX 2080 Ti", 68, 4, 1.545, 0.616),
}


def issue_bound_tbps(bytes_per_iteration: int, num_warps: int, instructions: int, arch: Arch) -> float:
    """TB/s at which a kernel streaming `bytes_per_iteration` per program per loop iteration, each of its
    num_warps warps issuing `instructions` per iteration, runs out of issue slots (module docstring)."""
    bytes_per_instruction = bytes_per_iteration / (num_warps * instructions)
    return bytes_per_instruction * arch.sms * arch.schedulers * arch.clock_ghz * 1e9 / 1e12


def analyse(job: tuple[int, int]) -> dict:
    """Compile decode launch i for sm_`arch` and read its hot loop: one row of the `kernels` table."""
    i, sm = job
    launch = gpu_compile._LAUNCHES[i]
    arch = ARCHS[sm]
    row: dict = {
        "name": f"{launch.kernel} {launch.config}",
        "kernel": launch.kernel,
        "arch": f"sm_{sm}",
        "gpu": arch.gpu,
        "rows": launch.rows,
        "registers": None,
        "spill_bytes": None,
        "sass_instructions_per_iteration": None,
        "bytes_per_iteration": launch.bytes_per_iteration,
        "num_warps": None,
        "issue_bound_tbps": None,
        "hbm_tbps": arch.hbm_tbps,
        "ok": False,
        "note": "",
    }
    start = time.perf_counter()
    try:
        kernel, report, row["num_warps"] = gpu_compile.compile_launch(launch, sm)
        row["registers"], _, row["spill_bytes"] = gpu_compile.ptxas_usage(report)
        text = sass.disassemble(kernel.asm["cubin"])
        loop = sass.hot_loop(text) if launch.bytes_per_iteration is None else sass.streaming_loop(text)
        row["sass_instructions_per_iteration"] = len(loop) if loop else None
        spill_free = not row["spill_bytes"]
        if launch.bytes_per_iteration is None or loop is None:
            row["note"] = "no memory-streaming loop: no issue bound"
            row["ok"] = spill_free
        else:
            bound = issue_bound_tbps(launch.bytes_per_iteration, row["num_warps"], len(loop), arch)
            row["issue_bound_tbps"] = round(bound, 3)
            row["ok"] = spill_free and bound >= GOAL * arch.hbm_tbps
    except Exception as e:  # noqa: BLE001 - a failed compile is a row of the report
        row["note"] = f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def kernel_rows(quick: bool, jobs: int) -> list[dict]:
    """Every decode launch (quick ones only with `quick`) on sm_90 and sm_75, compiled in parallel."""
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")  # as at run time: noise here
    gpu_compile._LAUNCHES[:] = gpu_compile.launches()
    todo = [
        (i, sm)
        for i, launch in enumerate(gpu_compile._LAUNCHES)
        if launch.decode and (launch.quick or not quick)
        for sm in ARCHS
        if sm >= launch.min_arch
    ]
    if jobs > 1 and len(todo) > 1:
        with multiprocessing.get_context("fork").Pool(min(jobs, len(todo))) as pool:  # workers inherit _LAUNCHES
            return pool.map(analyse, todo)
    return [analyse(job) for job in todo]


def count_kernels(out: Path, log: Path) -> subprocess.Popen:
    """bench/decode_launches.py in a subprocess under the interpreter, writing its JSON to `out`, stderr to `log`."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "bench" / "decode_launches.py"), "--json", str(out)]
    with log.open("w") as err:  # a file, not a pipe: nothing blocks while the compiles run
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)


def summarise(rows: list[dict]) -> dict:
    gemvs = [r for r in rows if r["kernel"].startswith("gemv")]
    spills = [r["spill_bytes"] for r in rows if r["spill_bytes"] is not None]
    return {
        "decode_gemvs_ok": bool(gemvs) and all(r["ok"] for r in gemvs),
        "decode_gemvs": len(gemvs),
        "decode_gemvs_failing": sorted({f"{r['name']} ({r['arch']})" for r in gemvs if not r["ok"]}),
        "max_decode_spill_bytes": max(spills, default=None),
        "failed_compiles": [f"{r['name']} ({r['arch']})" for r in rows if r["note"].startswith("FAILED")],
    }


def report(result: dict) -> str:
    c = result["counts"]
    lines = [
        f"mtpserve bench/gpu_static.py  {result['date']}  git {result['git']}  ({result['seconds']:.0f} s)",
        f"kernels per decode step {c['kernels_per_decode_step']}   per verification step ({c['n_max'] + 1} tokens) "
        f"{c['kernels_per_verify_step']}   per MTP draft step {c['kernels_per_mtp_draft']}   per MTP catch-up "
        f"{c['kernels_per_mtp_catch_up']}",
    ]
    for name, s in c["steps"].items():
        kinds = ", ".join(f"{k} {v['per_layer']:.1f} x {v['layers']}" for k, v in s["by_layer_kind"].items())
        lines.append(f"  {name}: {s['kernels']} ({s['triton']} Triton, {s['aten']} aten); per layer: {kinds}")
        lines.append("    " + ", ".join(f"{k} {v}" for k, v in s["top"]))
    lines += [
        "",
        "| kernel | arch | rows | regs | spill B | SASS/iter | bytes/iter | warps | issue bound TB/s | HBM TB/s | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def cell(v: object) -> str:
        return "-" if v is None else str(v)

    for r in result["kernels"]:
        ok = ("ok" if r["ok"] else "NO") + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {r['name']} | {r['arch']} | {cell(r['rows'])} | {cell(r['registers'])} | {cell(r['spill_bytes'])} | "
            f"{cell(r['sass_instructions_per_iteration'])} | {cell(r['bytes_per_iteration'])} | "
            f"{cell(r['num_warps'])} | {cell(r['issue_bound_tbps'])} | {r['hbm_tbps']} | {ok} |"
        )
    s = result["summary"]
    lines += [
        "",
        f"decode GEMVs meet the goal (issue bound >= {GOAL} x HBM, no spills) on sm_90 and sm_75: "
        f"{s['decode_gemvs_ok']} ({len(s['decode_gemvs_failing'])} of {s['decode_gemvs']} rows fail: see the JSON)",
        f"max decode spill bytes: {s['max_decode_spill_bytes']}",
    ]
    if s["failed_compiles"]:
        lines.append(f"FAILED compiles: {', '.join(s['failed_compiles'])}")
    return "\n".join(lines)


def git_commit() -> str:
    run = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="the counts and only the quick decode launches")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    parser.add_argument("--host-tokens", type=int, default=256, help="tokens a round of the host-time stand-in")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="mtpserve-gpu-static-"))
    os.environ["TRITON_CACHE_DIR"] = str(scratch / "cache")  # a fresh cache: every configuration really compiles
    try:
        counts_json, counts_log = scratch / "counts.json", scratch / "counts.log"
        counter = count_kernels(counts_json, counts_log)
        rows = kernel_rows(args.quick, args.jobs)
        if counter.wait() != 0:
            err = counts_log.read_text()[-3000:]
            print(f"bench/gpu_static.py: counting the kernels failed:\n{err}", file=sys.stderr)
            return 1
        counts = json.loads(counts_json.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "git": git_commit(),
        "quick": args.quick,
        "seconds": time.perf_counter() - start,
        "goal": f"issue bound >= {GOAL} x HBM bandwidth, no spills",
        "archs": {f"sm_{sm}": vars(a) for sm, a in ARCHS.items()},
        "kernels_per_decode_step": counts["kernels_per_decode_step"],
        "kernels_per_verify_step": counts["kernels_per_verify_step"],
        "kernels_per_mtp_draft": counts["kernels_per_mtp_draft"],
        "kernels_per_mtp_catch_up": counts["kernels_per_mtp_catch_up"],
        "kernels_per_mtp_draw": counts["kernels_per_mtp_draw"],
        "counts": counts,
        "kernels": rows,
        "summary": summarise(rows),
    }
    host = gpu_time_model.measure_host(tokens=args.host_tokens)
    sampled = gpu_time_model.measure_host(tokens=args.host_tokens, sampling="default")
    timed = gpu_time_model.model(result, host, sampled_host=sampled)
    result.update(timed)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print("\n" + gpu_time_model.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
