"""Constrained decoding: a request's output held to a grammar (a JSON schema, a GBNF grammar, or an xgrammar
structural tag: free text, reasoning and tool calls in a model's own format), with xgrammar.

Why xgrammar and not llguidance (bench/grammar_engines.py, docs/constrained-decoding.md): on the deployment's
248,320-token vocabulary both fill a JSON schema's mask in well under a millisecond (xgrammar 0.010 ms a token,
llguidance 0.043), far below a decode step; llguidance compiles faster (1.6 ms against 73 ms, and we cache
compiled grammars by content hash, so an agent's resent tools compile once); xgrammar alone ships Qwen 3.5's
XML tool-call format as a preset (parameters typed by each tool's JSON schema, the reasoning block before the
calls, `required` / forced / `parallel_tool_calls`), and it is vLLM's and SGLang's engine.

`GrammarCompiler` (one per engine: it holds the vocabulary) compiles a `GrammarSpec` in a worker process within
the server's limits (grammar_process.py), cached; a bad grammar is an `InvalidGrammar` (400) naming the library's
complaint or the limit it ran past. `Constraint` is one request's matcher: `masked`
gives the logits with every token the grammar forbids at -inf, `accept` advances it past the token sampled,
`rollback` undoes accepted tokens. A JSON schema's values are laid out as `JSON.stringify(value, null, 2)`
with bounded digit runs (chat.structured.json_grammar says why). The vocabulary gives control tokens their
text (so `<think>` and `<tool_call>` can be matched as text) except end-of-generation tokens, which are the
grammar's stop tokens; a request's constraint also bans the control tokens whose text its output would not
contain (those outside its `keep_special`), so the text the client gets is the text the grammar saw.

The next mask is computed while the next forward pass runs: `accept` hands the mask's computation to a worker
thread (the forward pass spends its time in torch kernels, which release the GIL, so the two run side by side)
and `masked` waits for it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..tokenizer import Tokenizer
from .config import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from .grammar_process import CompilerProcesses, InvalidGrammar
from .request import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_KINDS = ("json_schema", "gbnf", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept (each a few hundred KB at most for a tool set)
CACHE_BYTES = 256 << 20  # ... and their memory at most

__all__ = ["Constraint", "GrammarCompiler", "GrammarLimits", "InvalidGrammar", "LazyGrammarCompiler"]


class GrammarCompiler:
    """Compiles grammars against one tokenizer's vocabulary (padded to the model's `n_vocab` rows of logits)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        n_vocab: int,
        limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS,
        threads: int = 2,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        import xgrammar

        self._xgr = xgrammar
        eog = sorted(tokenizer.eog_ids)
        vocab = [b"" if i in tokenizer.eog_ids else tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self._info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=eog)
        self.processes = CompilerProcesses(self._info.serialize_json(), limits, threads)
        self.cache_bytes, self._cached_bytes = cache_bytes, 0
        self.n_vocab = n_vocab
        self.control = torch.zeros(n_vocab, dtype=torch.bool)
        for i in range(tokenizer.n_vocab):
            if tokenizer.is_special(i) and i not in tokenizer.eog_ids:
                self.control[i] = True
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="mtpserve-grammar")

    def compile(self, spec: GrammarSpec, cancelled: threading.Event | None = None) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when it was compiled before); given up with Cancelled
        when `cancelled` is set first (its client left)."""
        if spec.kind not in GRAMMAR_KINDS:
            raise InvalidGrammar(f"unknown grammar kind {spec.kind!r} (expected one of {', '.join(GRAMMAR_KINDS)})")
        key = (spec.kind, hashlib.sha256(spec.source.encode()).hexdigest())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        serialized = self.processes.compile(spec.kind, spec.source, cancelled)
        compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > CACHE_SIZE or (self._cached_bytes > self.cache_bytes and len(self._cache) > 1):
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= dropped.memory_size_bytes
        return compiled

    @property
    def cached_bytes(self) -> int:
        """Memory of the compiled grammars this compiler keeps."""
        return self._cached_bytes

    def constraint(self, spec: GrammarSpec, keep_special: Collection[int] = ()) -> Constraint:
        """A fresh matcher for one request; the control tokens outside `keep_special` banned."""
        banned = self.control.clone()
        for token in keep_special:
            if 0 <= token < self.n_vocab:
                banned[token] = False
        return Constraint(
            self._xgr.GrammarMatcher(self.compile(spec)), self.n_vocab, _allowed_words(banned), self._masks
        )

    def close(self) -> None:
        """Kill the compiler processes (compiles under way end with an error) and stop filling masks."""
        self.processes.close()
        self._masks.shutdown(wait=False, cancel_futures=True)


class LazyGrammarCompiler:
    """A GrammarCompiler made on first use (its vocabulary takes ~1 s at 250K tokens), from any thread."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, limits: GrammarLimits) -> None:
        self._args = (tokenizer, n_vocab, limits)
        self._lock = threading.Lock()
        self._stopped = self._closed = False
        self.made: GrammarCompiler | None = None

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self.made is None:
                self.made = GrammarCompiler(*self._args)
                if self._closed:
                    self.made.close()
                elif self._stopped:
                    self.made.processes.close()
            return self.made

    def stop_compiling(self) -> None:
        """Compiles under way or to come end with ShuttingDown; running requests' constraints go on."""
        with self._lock:
            self._stopped = True
            if self.made is not None:
                self.made.processes.close()

    def close(self) -> None:
        with self._lock:
            self._stopped = self._closed = True
            if self.made is not None:
                self.made.close()


class Constraint:
    """One request's grammar state; see the module docstring."""

    def __init__(
        self, matcher: xgrammar.GrammarMatcher, n_vocab: int, allowed: torch.Tensor, pool: ThreadPoolExecutor | None
    ) -> None:
        """`allowed`: int32 bitmask words (xgrammar's layout) of the tokens the request may produce at all."""
        import xgrammar

        self._xgr, self._matcher, self.n_vocab = xgrammar, matcher, n_vocab
        self._allowed = allowed
        self._bitmask = xgrammar.allocate_token_bitmask(1, n_vocab)
        self._pool = pool
        self._pending: Future[None] | None = None
        self._fresh = False  # the bitmask holds the current state's mask

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `logits` [V] with the tokens the grammar (or the ban) forbids at -inf."""
        self._wait()
        if not self._fresh:
            self._fill()
        out = logits.to("cpu", torch.float32, copy=True)  # the mask is applied on the host, where xgrammar fills it
        self._xgr.apply_token_bitmask_inplace(out[None, : self.n_vocab], self._bitmask)
        if out.max() == float("-inf"):  # nothing to draw: the request ends here, never with a made-up token
            raise InvalidGrammar("the grammar allows no token here (the tokens it expects are banned special tokens)")
        return out

    @property
    def complete(self) -> bool:
        """Whether the grammar accepted its stop token (an end-of-generation token): no token follows."""
        self._wait()
        return self._matcher.is_terminated()

    def accept(self, token: int, prefetch: bool = True) -> bool:
        """Advance past `token`; False (and no change) when the grammar forbids it. With `prefetch` the next
        mask starts filling in the background."""
        self._wait()
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        self._fresh = False
        if prefetch:
            self._prefetch()
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (the mask of the state it returns to starts filling)."""
        if n <= 0:
            return
        self._wait()
        self._matcher.rollback(n)
        self._fresh = False
        self._prefetch()

    def _prefetch(self) -> None:
        if self._pool is not None and not self._matcher.is_terminated():
            self._pending = self._pool.submit(self._fill)

    def _fill(self) -> None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        with torch.inference_mode():  # the engine thread made the bitmask in inference mode; this may be a worker
            self._bitmask &= self._allowed  # the request's bans
        self._fresh = True

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def _allowed_words(banned: torch.Tensor) -> torch.Tensor:
    """The complement of a bool mask [V] as int32 bitmask words [1, ceil(V / 32)], bit i of word w = token 32w + i."""
    pad = (-len(banned)) % 32
    allowed = torch.cat([~banned, torch.zeros(pad, dtype=torch.bool)]).view(-1, 32).to(torch.int64)
    words = (allowed << torch.arange(32)).sum(1)  # int64: bit 31 does not overflow
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[None]
