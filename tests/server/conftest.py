"""A tinyqwen35 server shared by the test modules that only send it requests (one start for all of them): the
fixture model with thinking and Qwen tool calls, an API key and an alias, 4 slots."""

from __future__ import annotations

import pytest

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

TINY_KEY = "tiny-key-5678"
TINY_ALIAS = "tiny"
# a tool's parameters the 4M-parameter model can fill within a few tokens (enum and bounded integer, no free text)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory) -> ServerProcess:
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "--alias", TINY_ALIAS, "--api-key", TINY_KEY]
    process = ServerProcess(
        [*args, "-np", "4", "-c", "8192", "-t", "2"], tmp_path_factory.mktemp("tiny") / "server.log"
    )
    yield process
    process.stop()
