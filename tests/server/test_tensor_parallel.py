"""The deployment's command line with `-sm row -ts 1,1 --device cpu,cpu` (issue 40): two tensor-parallel ranks on
the CPU (engine.tensor_parallel) answer as the one-rank server does, through the official OpenAI client."""

from __future__ import annotations

import openai
import pytest

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

KEY, ALIAS = "tp-key-1234", "tp"
NEAR_TIE = 0.05  # nats, as in the fixtures
DEPLOYMENT = ["-c", "8192", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "--spec-type", "draft-mtp"]
DEPLOYMENT += ["--spec-draft-n-max", "2", "--api-key", KEY, "--alias", ALIAS, "-t", "2"]
QUESTIONS = ["Write a python function that adds two numbers.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = ["-m", str(tinyqwen_path("Q4_K_M"))]
    logs = tmp_path_factory.mktemp("tp")
    one = ServerProcess([*model, *DEPLOYMENT], logs / "one.log")
    try:
        two = ServerProcess([*model, *DEPLOYMENT, "-sm", "row", "-ts", "1,1", "--device", "cpu,cpu"], logs / "two.log")
    except BaseException:
        one.stop()
        raise
    yield one, two
    one.stop()
    two.stop()


def _ask(server: ServerProcess, question: str):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    return client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": question}],
        max_tokens=48,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )


def test_two_ranks_answer_as_one_with_the_deployments_flags(servers):
    one, two = servers
    assert "tensor parallel over 2 ranks (cpu,cpu, threads)" in two.log()
    for question in QUESTIONS:
        a, b = _ask(one, question), _ask(two, question)
        tokens = [t.token for t in a.choices[0].logprobs.content]
        margins = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in a.choices[0].logprobs.content]
        first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
        assert [t.token for t in b.choices[0].logprobs.content][:first_tie] == tokens[:first_tie], question
        timings = b.model_extra["timings"]
        assert timings["predicted_n"] == len(b.choices[0].logprobs.content) and timings["draft_n"] > 0
