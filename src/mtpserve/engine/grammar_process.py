"""Grammar compilation in worker processes, so that a grammar can be given up on: when it runs past its time or
its memory, when its client leaves, when the server stops. xgrammar's compiler offers no limit and cannot be
interrupted (a 100,000-value enum was still compiling after 6 minutes, 6,000 optional properties took 2.4 GB,
and a thread stuck in it held SIGTERM's shutdown: issue 36, finding 3), but a process can be killed.

The parent sends (kind, source); the worker compiles it, checks that some token can start it, and answers with
the compiled grammar serialized (`CompiledGrammar.serialize_json`: 1.5 MB and 17 ms to read back for a 24-tool
structural tag at 152K tokens, against 108 ms to compile) or the library's complaint. `CompilerProcesses` keeps
up to `limits.workers` of them, each started on first need (python + xgrammar + torch: ~2.7 s, ~270 MB) and
again after one is killed; waiting compiles take the next free worker smallest grammar first, so an agent's
ordinary tool set is not queued behind a hostile one.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from .config import GrammarLimits
from .errors import Cancelled, InvalidRequest, ServerError, ShuttingDown

log = logging.getLogger("mtpserve.engine")

POLL_S = 0.05  # how often a waiting compile looks at its deadline, its client, its worker's memory
START_S = 120.0  # a worker's start (python, xgrammar, torch, the vocabulary: ~3 s), which no grammar is charged for
OK, INVALID = b"O", b"E"


class InvalidGrammar(InvalidRequest):
    """A schema or grammar that does not compile."""


class GrammarLimitExceeded(InvalidGrammar):
    """A grammar too large, too slow or too big in memory to compile within the server's limits."""


# --- the worker process ---------------------------------------------------------------------------------------


def compile_source(compiler: Any, kind: str, source: str) -> Any:
    """The xgrammar CompiledGrammar of a source of `kind` (engine.grammar's kinds); ValueError with the reason a
    source is refused."""
    from ..chat.structured import StructuredOutputError, json_grammar, library_message

    try:
        if kind == "json_schema":
            return compiler.compile_grammar(json_grammar(json.loads(source)))
        if kind == "gbnf":
            return compiler.compile_grammar(source)
        return compiler.compile_structural_tag(source)
    except StructuredOutputError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the library's errors (RuntimeError, ValueError, its own) say what is wrong
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {library_message(e)}"[:500]) from None


def starts(compiled: Any, n_vocab: int) -> bool:
    """Whether any token (an end-of-generation token included, for a grammar that matches "") may come first."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, n_vocab)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _serve(conn: Connection) -> None:
    """The worker's loop: the tokenizer first (its xgrammar JSON), then one grammar after another until EOF."""
    import xgrammar

    threads = int(conn.recv_bytes())
    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)  # the parent caches
    conn.send_bytes(OK)
    while True:
        try:
            kind, source = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            compiled = compile_source(compiler, kind, source)
            if kind != "structural_tag" and not starts(compiled, info.vocab_size):
                what = "JSON schema" if kind == "json_schema" else "grammar"
                raise ValueError(f"the {what} matches no text: no token can start it")
        except ValueError as e:
            conn.send_bytes(INVALID + str(e).encode())
            continue
        conn.send_bytes(OK + compiled.serialize_json().encode())


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the server dies, even by SIGKILL, even mid-compile. (The signal
    comes when the thread that started the worker ends: CompilerProcesses starts them from a thread of its own.)"""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        sys.exit(0)


# --- the parent's side ----------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the socket to it."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtpserve.engine.grammar_process", str(child.fileno()), str(os.getpid())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.ready = False  # it has read the tokenizer and said so

    def rss(self) -> int:
        """Resident bytes (0 where /proc is not there to say)."""
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class CompilerProcesses:
    """Compiles grammars in worker processes within `limits`; see the module docstring."""

    def __init__(self, tokenizer_json: str, limits: GrammarLimits, threads: int = 2) -> None:
        self.limits, self._tokenizer_json, self._threads = limits, tokenizer_json, threads
        self._workers: list[_Worker | None] = [None] * limits.workers  # None: not started (or killed)
        self._idle = list(range(limits.workers))  # slots no compile holds
        self._waiting: list[tuple[int, int]] = []  # (source size, arrival): a heap, smallest first
        self._arrivals = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.started = 0  # worker processes started, for tests and logs
        # workers are started from this one thread, which lives as long as the pool: the kernel's parent-death
        # signal follows the starting thread, and a request thread ends when idle (anyio's, after 10 s)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="mtpserve-grammar-start")

    def compile(self, kind: str, source: str, cancelled: threading.Event | None = None) -> str:
        """The compiled grammar serialized (CompiledGrammar.serialize_json). InvalidGrammar for a source that does
        not compile, GrammarLimitExceeded past a limit, Cancelled when `cancelled` is set first, ShuttingDown once
        `close` is called."""
        if len(source) > self.limits.max_bytes:
            raise GrammarLimitExceeded(
                f"the {kind.replace('_', ' ')} is {len(source)} bytes; this server compiles at most "
                f"{self.limits.max_bytes} (--grammar-max-size)"
            )
        deadline = time.monotonic() + self.limits.timeout_s
        slot = self._take(len(source), deadline, cancelled)
        try:
            worker = self._worker(slot)
            if not worker.ready:  # starting it is the server's time, not the grammar's
                started = time.monotonic()
                worker.conn.send_bytes(str(self._threads).encode())
                worker.conn.send_bytes(self._tokenizer_json.encode())  # blocks until it has imported xgrammar
                self._wait(worker, started + START_S, cancelled, starting=True)
                worker.conn.recv_bytes()
                worker.ready = True
                deadline += time.monotonic() - started
            worker.conn.send_bytes(json.dumps([kind, source]).encode())
            self._wait(worker, deadline, cancelled)
            answer = worker.conn.recv_bytes()
        except BaseException as e:
            self._kill(slot)  # the next compile on this slot starts a fresh worker
            if isinstance(e, (OSError, EOFError)):
                self._check(deadline, cancelled, "compiling the grammar")  # closed meanwhile: say so
                raise ServerError(f"the grammar compiler process failed ({type(e).__name__})") from None
            raise
        finally:
            self._release(slot)
        if answer.startswith(INVALID):
            raise InvalidGrammar(answer[1:].decode())
        return answer[1:].decode()

    def close(self) -> None:
        """Kill every worker; compiles under way or waiting end with ShuttingDown at once, and so do later ones."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            for slot, worker in enumerate(self._workers):
                if worker is not None and slot in self._idle:
                    worker.kill()
                elif worker is not None:
                    worker.proc.kill()  # its compile's thread sees it gone, and cleans up
        self._starter.shutdown(wait=False)

    def _take(self, size: int, deadline: float, cancelled: threading.Event | None) -> int:
        """A free worker slot, once this compile is the smallest waiting."""
        me = (size, next(self._arrivals))
        with self._cond:
            heapq.heappush(self._waiting, me)
            try:
                while not (self._idle and self._waiting[0] == me):
                    self._check(deadline, cancelled, "waiting for a grammar compiler")
                    self._cond.wait(POLL_S)
                self._check(deadline, cancelled, "waiting for a grammar compiler")
                return self._idle.pop()
            finally:
                self._waiting.remove(me)
                heapq.heapify(self._waiting)
                self._cond.notify_all()

    def _worker(self, slot: int) -> _Worker:
        """The slot's worker, started if it has none (or it died)."""
        with self._cond:
            worker = self._workers[slot]
            if worker is None or worker.proc.poll() is not None:
                if worker is not None:
                    worker.kill()
                if self._closed:
                    raise ShuttingDown()
                worker = self._workers[slot] = self._starter.submit(_Worker).result()
                self.started += 1
                log.info("srv  grammar: compiler process %d started (pid %d)", self.started, worker.proc.pid)
            return worker

    def _wait(
        self, worker: _Worker, deadline: float, cancelled: threading.Event | None, starting: bool = False
    ) -> None:
        """Until the worker answers; an error (the worker is then killed) when a limit or the client ends the wait."""
        what = "starting a grammar compiler" if starting else "compiling the grammar"
        while not worker.conn.poll(POLL_S):
            if worker.proc.poll() is not None:
                self._check(deadline, cancelled, what)
                raise ServerError(f"the grammar compiler process died (exit code {worker.proc.returncode})")
            self._check(deadline, cancelled, what)
            if not starting and worker.rss() > self.limits.max_memory:
                raise GrammarLimitExceeded(
                    f"compiling the grammar took over {self.limits.max_memory >> 20} MiB "
                    "(--grammar-max-memory); simplify the schema or grammar"
                )

    def _check(self, deadline: float, cancelled: threading.Event | None, what: str) -> None:
        if self._closed:
            raise ShuttingDown()
        if cancelled is not None and cancelled.is_set():
            raise Cancelled()
        if time.monotonic() > deadline:
            raise GrammarLimitExceeded(
                f"{what} took over {self.limits.timeout_s:g} s (--grammar-timeout); simplify the schema or grammar"
            )

    def _kill(self, slot: int) -> None:
        with self._cond:
            worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()

    def _release(self, slot: int) -> None:
        with self._cond:
            self._idle.append(slot)
            self._cond.notify_all()


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    _serve(Connection(int(sys.argv[1])))
