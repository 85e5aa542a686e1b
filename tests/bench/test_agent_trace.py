"""bench/agent_trace.py's agent pattern against a real mtpserve on one slot (`-np 1`, the prompt cache on by
default): the main conversation's turns cost about their new tokens although side requests (a title, sub-agents,
checks) take the slot between them, and all requests together about the minimum no cache could avoid. The
thinking-on bound is looser: a re-rendered turn drops its reasoning, so the cached state diverges earlier."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
MAIN_BOUND = {False: 1.3, True: 1.6}  # main turns' evaluated / their new tokens
ALL_BOUND = 1.15  # all requests' evaluated / the minimum


def _agent_trace():
    spec = importlib.util.spec_from_file_location("bench_agent_trace", REPO / "bench" / "agent_trace.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_the_main_conversation_survives_side_requests_on_one_slot(thinking: bool, tmp_path: Path) -> None:
    trace = _agent_trace()
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "-np", "1", "-c", "16384", "-t", "2", "--no-webui"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        records = trace.run_pattern(server.url, thinking, turns=6, max_tokens=48, server="mtpserve")
    finally:
        server.stop()
    lines = "\n".join(trace.progress_line(r) for r in records)
    assert len(records) == 15 and sum(r.kind == "main" for r in records) == 6, lines
    for r in records:  # the prompt the bench tokenized is the one the server evaluated
        assert r.prompt_n + r.cache_n == r.n_prompt, lines
    s = trace.summarize(records)
    assert s.main_evaluated <= MAIN_BOUND[thinking] * s.main_new, f"{s}\n{lines}"
    assert s.evaluated <= ALL_BOUND * s.minimum, f"{s}\n{lines}"
