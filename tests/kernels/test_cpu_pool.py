"""The C kernels' thread pool (kernels/cpu/pool.c): any thread count, any caller thread, the same numbers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.ops import attention, linear
from mtpserve.quant.qtensor import QTensor

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernel library did not build here")


def _q4_0(n: int, k: int) -> QTensor:
    values = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    data = torch.from_numpy(quants.quantize(values, T.Q4_0).view(np.uint8)).reshape(n, -1)
    return QTensor(data, T.Q4_0, (n, k), "w.Q4_0")


def _with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("poll", [0, 50])
def test_results_do_not_depend_on_the_thread_count_or_the_poll(poll):
    # 7 threads on a 2-core machine: more threads than cores still gives every item exactly once
    cpu_kernels.configure_pool(poll)
    try:
        w, x = _q4_0(1000, 512), torch.randn(9, 512)
        q, k, v = torch.randn(5, 8, 64), torch.randn(300, 2, 64), torch.randn(300, 2, 64)
        pos = torch.arange(300)

        def run():
            return linear.linear(x, w), attention.attention(q, k, v, pos[-5:], pos, 0.125)

        (y1, a1), (y2, a2), (y7, a7) = (_with_threads(n, run) for n in (1, 2, 7))
        assert torch.equal(y1, y2) and torch.equal(y1, y7)
        assert torch.equal(a1, a2) and torch.equal(a1, a7)
    finally:
        cpu_kernels.configure_pool(50)


@needs_kernels
def test_callers_on_several_threads_share_one_pool_and_get_their_own_results():
    lib = cpu_kernels.load()
    w = _q4_0(2048, 256)
    inputs = [torch.randn(3, 256) for _ in range(4)]
    alone = [_with_threads(2, lambda x=x: linear.linear(x, w)) for x in inputs]
    workers_before = lib.mtp_pool_workers()
    results: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}

    def caller(i: int) -> None:
        for _ in range(50):
            results[i].append(linear.linear(inputs[i], w))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    _with_threads(2, lambda: [t.start() for t in threads] and [t.join() for t in threads])
    for i in range(4):
        assert all(torch.equal(y, alone[i]) for y in results[i])
    # four calling threads, one pool: no team per caller
    assert lib.mtp_pool_workers() == max(workers_before, 1)


def test_poll_outside_0_100_is_refused():
    with pytest.raises(ValueError, match="0-100"):
        cpu_kernels.configure_pool(101)
    with pytest.raises(ValueError, match="0-100"):
        cpu_kernels.configure_pool(-1)


def test_physical_cores_counts_smt_siblings_once():
    """Against another account of the topology: distinct (package, core id) pairs of the CPUs we may run on."""
    n = cpu_kernels.physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    topology = [Path(f"/sys/devices/system/cpu/cpu{c}/topology") for c in os.sched_getaffinity(0)]
    if all((t / "core_id").exists() and (t / "physical_package_id").exists() for t in topology):
        cores = {((t / "physical_package_id").read_text(), (t / "core_id").read_text()) for t in topology}
        assert n == len(cores)


def test_every_item_runs_exactly_once_over_many_quick_calls(tmp_path):
    """A million calls that follow each other faster than the workers wake, at C speed: a worker holding a claim
    of the last call must never claim items of the next (it did once: the count overshot and the caller waited
    forever)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    here = Path(__file__).parent
    binary = tmp_path / "pool_stress"
    sources = [here / "pool_stress.c", cpu_kernels.HERE / "pool.c"]
    subprocess.run(
        [compiler, "-O2", "-pthread", f"-I{cpu_kernels.HERE}", *map(str, sources), "-o", str(binary)], check=True
    )
    try:
        out = subprocess.run([str(binary), "1000000"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool deadlocked")
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout


@needs_kernels
def test_cpu_strict_pins_the_thread_that_calls_the_kernels_and_the_workers_to_one_cpu_each():
    """In a child process (pinning is for the process's life): the configuring thread stays free; the thread that
    runs the kernels (the engine's, in the server) and the worker each get one CPU of their own."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    script = """
import os, threading, torch
from mtpserve.kernels import cpu
from mtpserve.ops import linear
from tests.kernels.test_cpu_pool import _q4_0
allowed = os.sched_getaffinity(0)
cpu.configure_pool(50, True)
torch.set_num_threads(2)
w, x, seen = _q4_0(2048, 256), torch.randn(3, 256), {}
def engine():
    linear.linear(x, w)
    seen["engine"] = os.sched_getaffinity(threading.get_native_id())
t = threading.Thread(target=engine)
t.start()
t.join()
masks = []
for tid in os.listdir(f"/proc/{os.getpid()}/task"):
    try:
        masks.append(len(os.sched_getaffinity(int(tid))))
    except OSError:  # a thread that ended between the listing and here
        pass
print(os.sched_getaffinity(0) == allowed, len(seen["engine"]), cpu.load().mtp_pool_workers(), masks)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2]
    )
    fields = out.stdout.split(maxsplit=3)
    assert len(fields) == 4, f"exit {out.returncode}: {out.stdout}{out.stderr}"
    main_free, engine_cpus, workers, mask_sizes = fields  # mask_sizes: each live thread's CPU count
    assert main_free == "True" and engine_cpus == "1", out.stdout + out.stderr
    # the pool's worker has one CPU too (a CI run once saw every thread at two: the worker count says whether the
    # worker was never made or made unpinned)
    assert int(workers) >= 1 and "1" in mask_sizes.strip("[]\n").split(", "), out.stdout


@needs_kernels
@pytest.mark.parametrize("rows,n", [(131, 640), (7, 256), (1, 2048)])
def test_rms_norm_rows_are_their_own_at_any_thread_count(rows: int, n: int):
    """Four rows' sums in flight at once and a prompt's rows over the pool: every row still its own ordered double sum,
    the same bits as the row normed alone (and in place, as the blocks norm their outputs)."""
    lib = cpu_kernels.load()
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 3
    w = torch.rand(n) + 0.5

    def normed(x: torch.Tensor, threads: int, one_row_at_a_time: bool = False) -> torch.Tensor:
        y = torch.empty_like(x)
        for r in range(rows) if one_row_at_a_time else [None]:
            src, dst = (x, y) if r is None else (x[r], y[r])
            lib.mtp_rms_norm(src.data_ptr(), w.data_ptr(), dst.data_ptr(), src.numel() // n, n, 1e-6, threads)
        return y

    alone = normed(x, 1, one_row_at_a_time=True)
    for threads in (1, 2, 7):
        assert torch.equal(normed(x, threads), alone)
    in_place = x.clone()
    lib.mtp_rms_norm(in_place.data_ptr(), w.data_ptr(), in_place.data_ptr(), rows, n, 1e-6, 2)
    assert torch.equal(in_place, alone)


@needs_kernels
@pytest.mark.parametrize("fn", ["mtp_swiglu", "mtp_geglu"])
def test_gated_activations_over_the_pool_are_the_same_bits(fn: str):
    lib = cpu_kernels.load()
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(128 * 2048, generator=gen) * 4, torch.randn(128 * 2048, generator=gen)

    def run(threads: int) -> torch.Tensor:
        y = torch.empty_like(gate)
        getattr(lib, fn)(gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel(), threads)
        return y

    one = run(1)
    for threads in (2, 7):
        assert torch.equal(run(threads), one)
