"""`GET /metrics`: llama-server's Prometheus metrics (`llamacpp:` names, ../shared/spec/server-api.md
§3.3), through prometheus_client. Request totals are counted here when a request ends; slot, queue and
speculative counters are read from the engine at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine import EngineClient, FinishEvent, MemoryUsage

PREFIX = "llamacpp:"


@dataclass
class RequestTotals:
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    n_tokens_max: int = 0
    requests_finished: int = 0


class ServerMetrics:
    """Totals since start-up; `prompt_tokens_seconds`/`predicted_tokens_seconds` are averaged over what
    finished since the previous scrape, as llama-server's are."""

    def __init__(self, engine: Callable[[], EngineClient | None]) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.totals = RequestTotals()
        self._since_scrape = RequestTotals()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.start_time = time.time()

    def record(self, event: FinishEvent) -> None:
        t = event.timings
        with self._lock:
            for totals in (self.totals, self._since_scrape):
                totals.prompt_tokens += t.prompt_n
                totals.prompt_tokens_cached += t.cache_n
                totals.prompt_seconds += t.prompt_ms / 1000
                totals.tokens_predicted += t.predicted_n
                totals.tokens_predicted_seconds += t.predicted_ms / 1000
                totals.n_tokens_max = max(totals.n_tokens_max, t.cache_n + t.prompt_n + t.predicted_n)
                totals.requests_finished += 1

    def render(self) -> bytes:
        # llama-server types n_tokens_max, a running maximum, as a counter without the `_total` that
        # prometheus_client gives every counter it writes: written as a gauge, then retyped
        text = generate_latest(self.registry)
        return text.replace(b"# TYPE llamacpp:n_tokens_max gauge", b"# TYPE llamacpp:n_tokens_max counter")

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            totals, recent = self.totals, self._since_scrape
            self._since_scrape = RequestTotals()
        engine = self._engine()
        counters = engine.counters() if engine else None

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        yield counter("prompt_tokens", "Number of prompt tokens processed.", totals.prompt_tokens)
        yield counter(
            "prompt_tokens_cached", "Number of prompt tokens reused from the cache.", totals.prompt_tokens_cached
        )
        yield counter("prompt_seconds", "Prompt process time.", totals.prompt_seconds)
        yield counter("tokens_predicted", "Number of generation tokens processed.", totals.tokens_predicted)
        yield counter("tokens_predicted_seconds", "Predict process time.", totals.tokens_predicted_seconds)
        yield counter("requests_finished", "Requests that ended (any reason but an error).", totals.requests_finished)
        n_decode = counters.n_decode_total if counters else 0
        yield counter("n_decode", "Total number of llama_decode() calls.", n_decode)
        yield gauge("n_tokens_max", "Largest observed n_tokens.", totals.n_tokens_max)
        busy_per_decode = counters.n_busy_slots_total / n_decode if counters and n_decode else 0.0
        yield gauge("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.", busy_per_decode)
        prompt_rate = recent.prompt_tokens / recent.prompt_seconds if recent.prompt_seconds else 0.0
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", prompt_rate)
        predicted_rate = (
            recent.tokens_predicted / recent.tokens_predicted_seconds if recent.tokens_predicted_seconds else 0.0
        )
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.", predicted_rate)
        usage = engine.memory_usage() if engine else None
        yield gauge("requests_processing", "Number of requests processing.", usage.busy_slots if usage else 0)
        yield gauge("requests_deferred", "Number of requests deferred.", usage.queued if usage else 0)
        yield from _prompt_cache_metrics(usage)
        spec = counters.spec if counters else None
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.draft_tokens if spec else 0)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.accepted_tokens if spec else 0)
        yield counter("spec_decode_num_drafts", "Verification steps with a draft.", spec.drafts if spec else 0)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position.",
            labels=["position"],
        )
        for position, n in enumerate(spec.accepted_per_position if spec else []):
            per_pos.add_metric([str(position)], n)
        yield per_pos


def _prompt_cache_metrics(usage: MemoryUsage | None) -> Iterator[Metric]:
    """The host-memory prompt cache (--cache-ram): mtpserve's own names, beside llama-server's."""
    values = usage or MemoryUsage(0, 0, 0, 0, 0, 0)
    rows = [
        (GaugeMetricFamily, "prompt_cache_bytes", "Bytes of prompt states held in the host-memory prompt cache.",
         values.cache_bytes),
        (GaugeMetricFamily, "prompt_cache_limit_bytes", "The prompt cache's limit in bytes (-1: none, 0: off).",
         values.cache_limit_bytes),
        (GaugeMetricFamily, "prompt_cache_entries", "Prompt states held in the prompt cache.", values.cache_entries),
        (CounterMetricFamily, "prompt_cache_hits", "Requests resumed from the prompt cache.", values.cache_hits),
        (CounterMetricFamily, "prompt_cache_tokens_restored", "Prompt tokens restored from the prompt cache.",
         values.cache_tokens_restored),
        (CounterMetricFamily, "prompt_cache_tokens_evicted", "Tokens of prompt states evicted from the prompt cache.",
         values.cache_tokens_evicted),
    ]  # fmt: skip
    for family, name, doc, value in rows:
        yield family(PREFIX + name, doc, value=value)
