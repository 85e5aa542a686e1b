"""The benchmark's workload: chat requests streamed from an OpenAI-compatible server (mtpserve or
llama-server), each measured on both sides: the server's own `timings` (prompt and decode tokens/s,
`draft_n`, `draft_n_accepted`) and, on the client, the time to the first token and the arrival time of
every streamed chunk (for decode speed over the output length).

Tokens per verification step are derived from the counts: a speculative step emits its accepted drafts
plus one token of the trunk's own, so steps = predicted_n - draft_n_accepted.
"""

from __future__ import annotations

import inspect
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# The deployment guide's four requests: a question, code, an explanation, a longer piece of writing.
DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in a short paragraph how a hash table handles collisions.",
    "Write a short story of about 200 words about a lighthouse keeper.",
]


@dataclass
class RequestResult:
    label: str  # which prompt
    depth: int = 0  # tokens of filler context before the question (requested; see prompt_n)
    ok: bool = True
    error: str = ""
    ttft_ms: float = 0.0  # client side: request sent -> first generated text
    wall_ms: float = 0.0
    prompt_n: int = 0
    cache_n: int = 0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_per_second: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_n_per_pos: list[int] = field(default_factory=list)  # mtpserve's timings: drafts by position
    draft_n_accepted_per_pos: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds after the first chunk, one per text chunk

    @property
    def acceptance(self) -> float | None:
        return self.draft_n_accepted / self.draft_n if self.draft_n else None

    @property
    def tokens_per_step(self) -> float:
        steps = self.predicted_n - self.draft_n_accepted
        return self.predicted_n / steps if steps > 0 else float(self.predicted_n > 0)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["acceptance"], out["tokens_per_step"] = self.acceptance, self.tokens_per_step
        return out


@dataclass
class Workload:
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None  # None: the server's default
    top_p: float | None = None
    depths: list[int] = field(default_factory=list)  # extra requests with this much filler context
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 42

    def requests(self) -> list[tuple[str, int, list[dict[str, str]]]]:
        """(label, depth, messages) of every request, in order."""
        out = [(f"#{i + 1}", 0, [{"role": "user", "content": p}]) for i, p in enumerate(self.prompts)]
        for depth in self.depths:
            question = "Continue this code with one more function, and explain it briefly."
            out.append((f"depth {depth}", depth, [{"role": "user", "content": filler(depth) + "\n\n" + question}]))
        return out


def filler(tokens: int) -> str:
    """About `tokens` tokens of real Python source (4 characters per token is close for code)."""
    import statistics as source_module

    text = inspect.getsource(source_module)
    n_chars = tokens * 4
    return (text * (n_chars // len(text) + 1))[:n_chars]


def run_request(
    client: httpx.Client,
    url: str,
    messages: list[dict[str, str]],
    workload: Workload,
    label: str,
    depth: int = 0,
    model: str | None = None,
) -> RequestResult:
    """One streamed chat completion; errors are recorded, not raised (a benchmark reports them)."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": workload.max_tokens,
        "temperature": workload.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": workload.seed,
        "cache_prompt": False,
    }
    if model:
        body["model"] = model
    for key in ("top_k", "top_p"):
        if getattr(workload, key) is not None:
            body[key] = getattr(workload, key)
    if workload.chat_template_kwargs:
        body["chat_template_kwargs"] = workload.chat_template_kwargs
    result = RequestResult(label, depth)
    t0 = time.perf_counter()
    first: float | None = None
    timings: dict[str, Any] = {}
    try:
        for chunk in stream_chunks(client, url, body):
            timings = chunk.get("timings", timings)
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    result.chunk_times.append(now - first)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.ok, result.error = False, str(e)
    result.wall_ms = 1000 * (time.perf_counter() - t0)
    result.ttft_ms = 1000 * (first - t0) if first is not None else 0.0
    for key in ("prompt_n", "cache_n", "predicted_n", "draft_n", "draft_n_accepted"):
        setattr(result, key, int(timings.get(key, 0)))
    for key in ("prompt_per_second", "predicted_per_second"):
        setattr(result, key, float(timings.get(key, 0.0)))
    for key in ("draft_n_per_pos", "draft_n_accepted_per_pos"):
        setattr(result, key, [int(n) for n in timings.get(key, [])])
    if result.ok and not timings:
        result.ok, result.error = False, "the stream carried no timings (not llama-server's API?)"
    return result


def stream_chunks(client: httpx.Client, url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed /v1/chat/completions, parsed; RuntimeError for an HTTP error or an error event.
    A request the server closed its connection on before any response is sent once more, on a fresh connection:
    a kept-alive connection the server had closed while it sat in the pool (llama-server closes them between
    the requests of an interleaved bench: 5 of 36 failed so), as the official clients retry a connection error."""
    request = client.build_request("POST", f"{url}/v1/chat/completions", json=body)
    try:
        response = client.send(request, stream=True)
    except httpx.RemoteProtocolError:  # nothing was answered, so nothing ran: the same request again
        response = client.send(request, stream=True)
    try:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                raise RuntimeError(str(error.get("message", error) if isinstance(error, dict) else error))
            yield chunk
    finally:
        response.close()


@dataclass
class Summary:
    """One configuration's workload, summed as the deployment guide sums it."""

    requests: int
    failed: int
    prompt_per_second: float  # total prompt tokens / total prompt time
    predicted_per_second: float  # total generated tokens / total decode time
    acceptance: float | None  # total accepted / total drafted
    draft_n: int
    draft_n_accepted: int
    ttft_ms: float  # median
    tokens_per_step: float
    acceptance_per_pos: list[float | None] = field(default_factory=list)  # accepted / drafted at each position

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[RequestResult]) -> Summary:
    ok = [r for r in results if r.ok]
    prompt_s = sum(r.prompt_n / r.prompt_per_second for r in ok if r.prompt_per_second)
    decode_s = sum(r.predicted_n / r.predicted_per_second for r in ok if r.predicted_per_second)
    drafted, accepted = sum(r.draft_n for r in ok), sum(r.draft_n_accepted for r in ok)
    predicted = sum(r.predicted_n for r in ok)
    steps = predicted - accepted
    return Summary(
        requests=len(results),
        failed=len(results) - len(ok),
        prompt_per_second=sum(r.prompt_n for r in ok) / prompt_s if prompt_s else 0.0,
        predicted_per_second=predicted / decode_s if decode_s else 0.0,
        acceptance=accepted / drafted if drafted else None,
        draft_n=drafted,
        draft_n_accepted=accepted,
        ttft_ms=statistics.median(r.ttft_ms for r in ok) if ok else 0.0,
        tokens_per_step=predicted / steps if steps > 0 else 0.0,
        acceptance_per_pos=[p.rate if p.drafted else None for p in per_position(ok)],
    )


@dataclass(frozen=True)
class PositionCount:
    drafted: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def per_position(results: list[RequestResult]) -> list[PositionCount]:
    """Drafts and kept drafts at each draft position, summed over the requests ([] from a server without them)."""
    depth = max((len(r.draft_n_per_pos) for r in results), default=0)

    def total(key: str, i: int) -> int:
        return sum(getattr(r, key)[i] for r in results if i < len(getattr(r, key)))

    return [PositionCount(total("draft_n_per_pos", i), total("draft_n_accepted_per_pos", i)) for i in range(depth)]
