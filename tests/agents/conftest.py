"""The agent clients' installation (tools/install_agents.sh), the server they talk to, and the configuration
blocks docs/serving.md tells a user to write."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mtpserve.default_models import cache_dir

from ..conftest import REPO, tinyqwen_path
from ..support.server_process import ServerProcess

AGENTS = cache_dir() / "agents"
API_KEY = "agent-test-key"
ALIAS = "qwen3.6-27b"  # the deployment's alias; docs/serving.md's blocks name it
DOCS = REPO / "docs" / "serving.md"
DOCS_URL = "http://127.0.0.1:8080"  # where the docs' blocks point: replaced by the steering proxy's address


def client_bin(name: str) -> Path:
    """An installed npm client's executable."""
    return installed(AGENTS / "node_modules" / ".bin" / name)


def installed(path: Path) -> Path:
    """`path`, or a skip (a failure under `make test-agents`) when it is absent."""
    if not path.exists():
        message = f"{path} is absent: `make test-agents` installs the agent clients (tools/install_agents.sh)"
        if os.environ.get("MTPSERVE_REQUIRE_AGENTS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def docs_block(name: str, url: str) -> str:
    """The fenced block after `<!-- agent-config: NAME -->` in docs/serving.md, pointed at `url`."""
    text = DOCS.read_text()
    found = re.search(rf"<!-- agent-config: {re.escape(name)} -->\s*```\w*\n(.*?)```", text, re.S)
    assert found, f"docs/serving.md has no block marked <!-- agent-config: {name} -->"
    return found.group(1).replace(DOCS_URL, url)


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    """The deployment's flags on the fixture model (-c 32768: Claude Code's prompt alone is ~7k tokens)."""
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]
    args += ["-c", "32768", "--api-key", API_KEY, "--alias", ALIAS]
    server = ServerProcess(args, tmp_path_factory.mktemp("agent-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def client_env(tmp_path) -> dict[str, str]:
    """A fresh home for the client (no user configuration, no history), the key docs/serving.md's blocks read."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        **os.environ,
        "HOME": str(home),
        "MTPSERVE_API_KEY": API_KEY,
        # opencode installs its provider packages (@ai-sdk/*) there: kept across runs
        "XDG_CACHE_HOME": str(AGENTS / "xdg-cache"),
    }
