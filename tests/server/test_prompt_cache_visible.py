"""The prompt cache seen from outside: a chat displaced by a side request on one slot comes back (`timings.cache_n`),
and /metrics, /props and the log say what the cache holds and did."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

MIB = 1 << 20


def _chat(url: str, system: str, user: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 8,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_displaced_chat_is_restored_and_the_cache_is_reported(tmp_path):
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "-np", "1", "-c", "8192", "-t", "2", "--metrics", "--cache-ram", "64"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        system = "You are a careful coding agent. " + " ".join(f"Rule {i}: keep files small." for i in range(120))
        first = _chat(server.url, system, "List the files.")
        side = _chat(server.url, "Write a five-word title.", "List the files.")
        again = _chat(server.url, system, "List the files again, with their sizes.")
        metrics = _metrics(server.url)
        props = httpx.get(server.url + "/props", timeout=30).json()["prompt_cache"]
        log = server.log()
    finally:
        server.stop()
    shared = first["timings"]["prompt_n"] - 30  # the system prompt: the first prompt less its user message and tail
    assert side["timings"]["cache_n"] < 10
    assert again["timings"]["cache_n"] >= shared, (first["timings"], again["timings"])
    assert metrics["llamacpp:prompt_cache_hits_total"] >= 1
    assert metrics["llamacpp:prompt_cache_tokens_restored_total"] >= shared
    assert 0 < metrics["llamacpp:prompt_cache_bytes"] <= 64 * MIB
    assert metrics["llamacpp:prompt_cache_limit_bytes"] == props["limit_bytes"] == 64 * MIB
    assert props["entries"] == metrics["llamacpp:prompt_cache_entries"] >= 1
    assert "prompt cache is enabled, size limit: 64 MiB" in log
    assert "prompt_save" in log and "restored" in log
