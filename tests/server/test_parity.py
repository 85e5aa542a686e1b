"""llama-server's own requests, replayed over HTTP against `mtpserve serve`: the same tokens, text and
probabilities as llama.cpp recorded (../shared/fixtures/refs), for the three model families; and the
deployment's command line, pointed at tinyqwen35, speculating with its MTP head.

Tokens are compared up to the first recorded near tie (top-1/top-2 margin < 0.05 nats), texts only when
the whole generation has none.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import default_model, shared_path, tinyqwen_path
from ..support.server_process import ServerProcess

TOP_TOLERANCE = 2e-2  # probabilities, as the model-parity tests

MODELS = {
    "SmolLM2-135M-Instruct.Q4_1": lambda: default_model("smollm2"),
    "gemma-3-270m-q4_k_m": lambda: default_model("gemma3"),
    "tinyqwen35-mtp-Q4_K_M": lambda: tinyqwen_path("Q4_K_M"),
}


def _ref(name: str) -> dict:
    return json.loads(shared_path("fixtures", "refs", f"{name}.json").read_text())


# Gemma 3 over HTTP is `make test-all`'s (48 s, suite time): tests/models/test_parity.py holds its tokens and top-5
# probabilities to llama.cpp's and tests/chat its template; the other two families take the server's path here.
SLOW_OVER_HTTP = {"gemma-3-270m-q4_k_m"}


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_OVER_HTTP else name for name in MODELS],
)
def served(request, tmp_path_factory):
    name = request.param
    path = MODELS[name]()
    ref = _ref(name)
    # llama-server's reference command: 2 threads, seed 42, 4096 context, one slot.
    server = ServerProcess(
        ["-m", str(path), "-t", "2", "--seed", "42", "-c", "4096", "-np", "1", "--no-webui"],
        tmp_path_factory.mktemp("server") / "server.log",
    )
    yield name, ref, server
    server.stop()


def _compare(case: dict, ids: list[int], top: list[list[tuple[int, float]]] | None) -> None:
    expected = case["generated_token_ids"]
    ties = case["near_tie_positions"]
    upto = min([*ties, len(expected)])  # at a near tie either token may come, and anything after it
    assert ids[:upto] == expected[:upto], f"{case['name']}: tokens differ before the first near tie at {ties}"
    if top is not None:
        for got, want in zip(top, case["top_probs_first16"][: min(upto, 16)]):
            for (gid, gp), w in zip(got, want["top"]):
                if gid == w["id"]:
                    assert gp == pytest.approx(w["prob"], abs=TOP_TOLERANCE)


def test_replayed_requests_give_llama_cpp_tokens(served):
    _, ref, server = served
    cases = ref["greedy"]["chat"] + ref["greedy"]["completions"]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for case in cases:
            response = client.post(case["endpoint"], json=case["request"])
            assert response.status_code == 200, response.text
            body = response.json()
            if case["endpoint"] == "/completion":
                top = [
                    [(t["id"], math.exp(t["logprob"])) for t in p["top_logprobs"]]
                    for p in body["completion_probabilities"]
                ]
                _compare(case, body["tokens"], top)
                assert body["timings"]["prompt_n"] == case["prompt_n_server"]
                if not case["near_tie_positions"]:
                    assert body["content"] == case["generated_text"]
            else:
                content = body["choices"][0]["logprobs"]["content"]
                top = [[(t["id"], math.exp(t["logprob"])) for t in p["top_logprobs"]] for p in content]
                _compare(case, [p["id"] for p in content], top)
                assert body["usage"]["prompt_tokens"] == len(case["prompt_token_ids"])
                if not case["near_tie_positions"]:
                    assert body["choices"][0]["message"] == case["message"]
                    assert body["choices"][0]["finish_reason"] == case["finish_reason"]


DEPLOYMENT_COMMAND = (
    "--host 0.0.0.0 --port 8000 --alias Qwopus3.6-27B-v2-MTP --api-key local-qwopus-key --gpu-layers all "
    "--split-mode layer --tensor-split 1,1 --flash-attn on --ctx-size 262144 --parallel 1 --cache-type-k q8_0 "
    "--cache-type-v q8_0 --spec-type draft-mtp --spec-draft-n-max 2 --spec-draft-ngl all --no-mmproj --perf"
).split()

STARTUP_LINES = [
    "srv  llama_server: initializing ...",
    "srv    load_model: loading model '",
    "common_speculative_init_result: creating MTP draft context against the target model '",
    "srv    load_model: initializing, n_slots = 1, n_ctx_slot = 4096, kv_unified = 'false'",
    "spec common_specu: adding speculative implementation 'draft-mtp'",
    "spec common_specu: - n_max=2",
    "srv    load_model: speculative decoding context initialized",
    "slot   load_model: id  0 | task -1 | new slot, n_ctx = 4096",
    "srv          init: --cache-idle-slots requires --kv-unified, disabling",
    "srv  llama_server: model loaded",
    "srv  llama_server: server is listening on http://127.0.0.1:",
    "srv  update_slots: all slots are idle",
]


def test_the_deployment_command_line_serves_tinyqwen_with_mtp(tmp_path):
    """The reference command, pointed at tinyqwen35 with --ctx-size 4096 (host and port: the test's)."""
    path = tinyqwen_path("Q4_K_M")
    args = ["-m", str(path), *DEPLOYMENT_COMMAND]
    i = args.index("--ctx-size")
    args[i + 1] = "4096"
    for flag in ("--host", "--port"):  # the test's own address
        i = args.index(flag)
        del args[i : i + 2]
    server = ServerProcess([*args, "--metrics"], tmp_path / "server.log")  # and /metrics, to read its counters
    try:
        headers = {"Authorization": "Bearer local-qwopus-key"}
        body = {
            "model": "Qwopus3.6-27B-v2-MTP",
            "messages": [{"role": "user", "content": "Write a function that parses a URL."}],
            "max_tokens": 64,
            "temperature": 0,
        }
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        result = response.json()
        timings = result["timings"]
        assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0
        # acceptance by draft position: in timings, and in /metrics as llama.cpp names its counters
        assert sum(timings["draft_n_per_pos"]) == timings["draft_n"] and len(timings["draft_n_per_pos"]) <= 2
        assert sum(timings["draft_n_accepted_per_pos"]) == timings["draft_n_accepted"]
        scraped = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).text
        samples = {
            (s.name, s.labels.get("position")): s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
        }
        accepted = [samples[("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(2)]
        assert accepted == [float(n) for n in timings["draft_n_accepted_per_pos"]]  # the server's only request
        assert samples[("llamacpp:spec_decode_num_drafts_total", None)] > 0
        assert result["model"] == "Qwopus3.6-27B-v2-MTP"
        log = server.log()
        positions = [log.find(line) for line in STARTUP_LINES]
        missing = [line for line, at in zip(STARTUP_LINES, positions) if at < 0]
        assert not missing, f"start-up lines missing: {missing}\n{log}"
        assert positions == sorted(positions), f"start-up lines out of order:\n{log}"
        assert "--gpu-layers, --split-mode, --tensor-split, --spec-draft-ngl ignored" in log
        assert "draft acceptance = " in log  # --perf: the per-request timing lines
    finally:
        assert server.stop() == 0
