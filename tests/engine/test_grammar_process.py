"""Grammar compilation within limits (issue 36, finding 3): a source over the size limit is refused before any
work, a compile past its time or memory is killed and the next one gets a fresh worker, a compile is given up when
its client leaves or the server closes, and waiting compiles are served smallest first."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import pytest

from mtpserve.engine.config import GrammarLimits
from mtpserve.engine.errors import Cancelled, ServerError
from mtpserve.engine.grammar import GrammarCompiler, InvalidGrammar
from mtpserve.engine.grammar_process import CompilerProcesses, GrammarLimitExceeded
from mtpserve.engine.request import GrammarSpec
from mtpserve.tokenizer import Tokenizer

from ..conftest import tinyqwen_path

# ~0.6 MB of schema that takes xgrammar minutes and gigabytes to compile at this vocabulary (100,000 values took
# over 6 minutes in the report)
HEAVY = GrammarSpec("json_schema", json.dumps({"type": "string", "enum": [f"value-{i:06d}" for i in range(40_000)]}))
SMALL = GrammarSpec("gbnf", 'root ::= "yes" | "no"')


@cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tinyqwen_path("Q4_K_M"))


def _compiler(**limits: float) -> GrammarCompiler:
    tokenizer = _tokenizer()
    return GrammarCompiler(tokenizer, tokenizer.n_vocab, GrammarLimits(**limits))  # type: ignore[arg-type]


def test_a_source_over_the_size_limit_is_refused_before_any_worker_starts():
    compiler = _compiler(max_bytes=1000)
    try:
        with pytest.raises(GrammarLimitExceeded, match=r"--grammar-max-size"):
            compiler.compile(GrammarSpec("gbnf", "root ::= " + " | ".join(f'"{i}"' for i in range(500))))
        assert compiler.processes.started == 0
    finally:
        compiler.close()


def test_a_compile_past_its_time_is_killed_and_the_next_gets_a_fresh_worker():
    compiler = _compiler(timeout_s=2.0, workers=1, max_memory=64 << 30)  # only the time can end it
    try:
        compiler.compile(SMALL)  # the worker's start is not charged to the grammar
        worker = compiler.processes._workers[0]
        with pytest.raises(GrammarLimitExceeded, match=r"over 2 s \(--grammar-timeout\)"):
            compiler.compile(HEAVY)
        assert worker.proc.poll() is not None  # killed, not left compiling
        assert compiler.compile(GrammarSpec("gbnf", 'root ::= "ok"')).memory_size_bytes > 0
        assert compiler.processes.started == 2
    finally:
        compiler.close()


def test_a_compile_past_its_memory_is_killed():
    """The limit below what any worker needs: the first look at its memory while it compiles ends the compile
    (the start of a worker is not counted)."""
    compiler = _compiler(max_memory=16 << 20, timeout_s=600.0)
    try:
        with pytest.raises(GrammarLimitExceeded, match=r"over 16 MiB \(--grammar-max-memory\)"):
            compiler.compile(HEAVY)
        assert all(w is None for w in compiler.processes._workers)
    finally:
        compiler.close()


def test_a_compile_is_given_up_when_its_client_leaves():
    compiler = _compiler(timeout_s=600.0, max_memory=8 << 30)  # limits the heavy schema does not reach in seconds
    try:
        compiler.compile(SMALL)  # the workers are up: the client leaves mid-compile
        left = threading.Event()
        threading.Timer(1.0, left.set).start()
        with pytest.raises(Cancelled):  # not the 600 s limit
            compiler.compile(HEAVY, left)
        assert all(w is None for w in compiler.processes._workers)
        compiler.compile(SMALL)  # and the compiler goes on
    finally:
        compiler.close()


def test_closing_ends_compiles_under_way_and_kills_the_workers():
    compiler = _compiler(timeout_s=600.0, max_memory=8 << 30)
    outcome: list[BaseException] = []

    def compile_heavy() -> None:
        try:
            compiler.compile(HEAVY)
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's
            outcome.append(e)

    thread = threading.Thread(target=compile_heavy)
    thread.start()
    while not any(w is not None and w.ready for w in compiler.processes._workers):  # compiling, not starting
        time.sleep(0.05)
    workers = [w for w in compiler.processes._workers if w is not None]
    compiler.close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ServerError)
    assert all(w.proc.poll() is not None for w in workers)
    with pytest.raises(ServerError, match="shutting down"):
        compiler.compile(GrammarSpec("gbnf", 'root ::= "late"'))


def test_a_bad_grammar_is_still_a_400_with_the_library_complaint():
    compiler = _compiler()
    try:
        with pytest.raises(InvalidGrammar, match="invalid gbnf"):
            compiler.compile(GrammarSpec("gbnf", "root ::= "))
        compiler.compile(SMALL)  # the worker that said so serves on
        assert compiler.processes.started == 1
    finally:
        compiler.close()


def test_waiting_compiles_take_the_next_free_worker_smallest_first():
    """Every worker busy; a large compile waits, then a small one: the freed worker goes to the small one."""
    pool = CompilerProcesses("{}", GrammarLimits(workers=1, timeout_s=600.0))
    busy = pool._take(0, time.monotonic() + 600, None)
    order: list[str] = []

    def wait(name: str, size: int) -> None:
        slot = pool._take(size, time.monotonic() + 600, None)
        order.append(name)
        pool._release(slot)

    large = threading.Thread(target=wait, args=("large", 500_000))
    large.start()
    while len(pool._waiting) < 1:
        time.sleep(0.01)
    small = threading.Thread(target=wait, args=("small", 100))
    small.start()
    while len(pool._waiting) < 2:
        time.sleep(0.01)
    pool._release(busy)
    large.join(10)
    small.join(10)
    assert order == ["small", "large"]


def test_a_worker_outlives_the_request_thread_that_needed_it():
    """The kernel's parent-death signal follows the thread that started a worker; request threads end when idle,
    so workers are started from the pool's own thread."""
    compiler = _compiler()
    try:
        thread = threading.Thread(target=compiler.compile, args=(SMALL,))
        thread.start()
        thread.join()
        (worker,) = [w for w in compiler.processes._workers if w is not None]
        time.sleep(0.5)
        assert worker.proc.poll() is None
        compiler.compile(GrammarSpec("gbnf", 'root ::= "again"'))
        assert compiler.processes.started == 1
    finally:
        compiler.close()


def test_workers_die_with_a_server_that_is_killed(tmp_path):
    """SIGKILL leaves no compile running for nobody (PR_SET_PDEATHSIG)."""
    script = tmp_path / "server.py"
    script.write_text(
        "import sys, json\n"
        "from mtpserve.engine.grammar import GrammarCompiler\n"
        "from mtpserve.engine.request import GrammarSpec\n"
        "from mtpserve.tokenizer import Tokenizer\n"
        "tok = Tokenizer.from_gguf(sys.argv[1])\n"
        "c = GrammarCompiler(tok, tok.n_vocab)\n"
        "c.compile(GrammarSpec('gbnf', 'root ::= \"a\"'))\n"
        "print(' '.join(str(w.proc.pid) for w in c.processes._workers if w), flush=True)\n"
        "c.compile(GrammarSpec('json_schema', sys.stdin.read()))\n"
    )
    server = subprocess.Popen(
        [sys.executable, str(script), str(tinyqwen_path("Q4_K_M"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in server.stdout.readline().split()]
    server.stdin.write(HEAVY.source)
    server.stdin.close()
    time.sleep(1.0)  # compiling
    assert len(pids) == 1 and _alive(pids[0])
    server.kill()
    server.wait()
    for _ in range(100):
        if not _alive(pids[0]):
            break
        time.sleep(0.1)
    assert not _alive(pids[0])


def _alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by init, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
