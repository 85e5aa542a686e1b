"""The real agent clients end to end: Claude Code, Codex, opencode (chat and Responses providers) and openai-agents
(chat and Responses models), pinned in this folder and installed by `make test-agents`, each run one short task
against `mtpserve serve` on tinyqwen35 with the deployment's flags (draft-mtp n_max 2, --api-key, --alias):
read hello.txt with a tool, send its content back, answer. Between them stands the steering proxy
(steering.py: the fixture model cannot decide to call a tool, so the requests tell it to). Each client is
configured only by what docs/serving.md tells a user to write: the blocks are read from that page. A client
passes when it reports success, ran the tool, and the file's content reached the server in the next request."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import AGENTS, ALIAS, client_bin, docs_block, installed
from .steering import Plan, SteeringProxy

pytestmark = pytest.mark.agents

TASK = "Read hello.txt and tell me what it says."
SECRET = "the secret word is mtpserve-roundtrip-7f3a"
MARKER = "mtpserve-roundtrip-7f3a"
CLIENT_TIMEOUT = 300  # seconds; Claude Code's own stream watchdog is 300 s


@pytest.fixture
def workdir(tmp_path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text(SECRET + "\n")
    return work


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**env, "PWD": str(cwd)}  # opencode takes its project folder from $PWD
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT, stdin=subprocess.DEVNULL
    )
    print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")  # shown when the test fails
    return result


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def check_round_trip(proxy: SteeringProxy) -> None:
    rules = [s.steered for s in proxy.seen]
    assert "call" in rules, f"the client never offered the tool {proxy.plan.tool!r}: {rules}"
    assert proxy.tool_output_returned(MARKER), "the tool's output never came back to the server"


def test_claude_code(agent_server, client_env, workdir):
    claude = client_bin("claude")
    plan = Plan(tool="Read", argument="file_path", value=str(workdir / "hello.txt"))
    with SteeringProxy(agent_server.url, plan) as proxy:
        setup = docs_block("claude-code", proxy.url)
        # the user's shell lines as written, then Claude Code with its Agent tool on (--tools: its full default
        # set is a ~41k-token prompt, slower for the tiny model on a CPU than Claude Code's 300 s watchdog)
        command = f'{setup}\nexec "$0" -p "$1" --output-format stream-json --verbose --tools Agent,Bash,Read'
        result = run(["bash", "-c", command, str(claude), TASK], workdir, client_env)
    assert result.returncode == 0
    seen = events(result.stdout)
    final = seen[-1]
    assert final["type"] == "result" and final["subtype"] == "success" and not final["is_error"], final
    uses = [b for e in seen if e["type"] == "assistant" for b in e["message"]["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["Read"]
    results = [b for e in seen if e["type"] == "user" for b in e["message"]["content"] if b["type"] == "tool_result"]
    assert MARKER in json.dumps(results) and final["result"] == plan.answer
    check_round_trip(proxy)


def test_codex(agent_server, client_env, workdir):
    codex = client_bin("codex")
    plan = Plan(tool="exec_command", argument="cmd", value="cat hello.txt")
    home = Path(client_env["HOME"]) / ".codex"
    home.mkdir()
    with SteeringProxy(agent_server.url, plan) as proxy:
        config = docs_block("codex", proxy.url)
        assert tomllib.loads(config)["model_providers"]["mtpserve"]["wire_api"] == "responses"
        (home / "config.toml").write_text(config)
        result = run([str(codex), "exec", "--json", "--skip-git-repo-check", TASK], workdir, client_env)
    assert result.returncode == 0
    seen = events(result.stdout)
    assert seen[-1]["type"] == "turn.completed", seen[-1]
    done = [e["item"] for e in seen if e["type"] == "item.completed"]
    commands = [i for i in done if i["type"] == "command_execution"]
    assert len(commands) == 1 and commands[0]["exit_code"] == 0 and MARKER in commands[0]["aggregated_output"]
    assert [i["text"] for i in done if i["type"] == "agent_message"] == [plan.answer]
    check_round_trip(proxy)


@pytest.mark.parametrize("provider", ["mtpserve", "mtpserve-responses"], ids=["chat", "responses"])
def test_opencode(agent_server, client_env, workdir, provider):
    opencode = client_bin("opencode")
    plan = Plan(tool="read", argument="filePath", value=str(workdir / "hello.txt"))
    with SteeringProxy(agent_server.url, plan) as proxy:
        (workdir / "opencode.json").write_text(docs_block("opencode", proxy.url))
        model = f"{provider}/{ALIAS}"
        result = run([str(opencode), "run", "--format", "json", "-m", model, TASK], workdir, client_env)
    assert result.returncode == 0
    seen = events(result.stdout)
    assert not [e for e in seen if e["type"] == "error"]
    tools = [e["part"] for e in seen if e["type"] == "tool_use"]
    assert [(t["tool"], t["state"]["status"]) for t in tools] == [("read", "completed")]
    assert MARKER in tools[0]["state"]["output"]
    assert "".join(e["part"]["text"] for e in seen if e["type"] == "text") == plan.answer
    check_round_trip(proxy)


AGENT_TASK = """
import json, sys
from agents import Agent, Runner, function_tool

@function_tool
def read_file(path: str) -> str:
    \"\"\"Read a text file.\"\"\"
    with open(path) as f:
        return f.read()

model = {"chat": chat_model, "responses": responses_model}[sys.argv[1]]
agent = Agent(name="reader", instructions="Answer with the tools you have.", tools=[read_file], model=model)
result = Runner.run_sync(agent, sys.argv[2])
print(json.dumps({"final": result.final_output, "items": [type(i).__name__ for i in result.new_items]}))
"""


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents(agent_server, client_env, workdir, api):
    packages = installed(AGENTS / "python" / "agents").parent
    plan = Plan(tool="read_file", argument="path", value="hello.txt")
    with SteeringProxy(agent_server.url, plan) as proxy:
        (workdir / "task.py").write_text(docs_block("openai-agents", proxy.url) + AGENT_TASK)
        # its own packages only (-S: not the project's venv, whose openai may differ), on this Python
        env = {**client_env, "PYTHONPATH": str(packages)}
        result = run([sys.executable, "-S", "task.py", api, TASK], workdir, env)
    assert result.returncode == 0
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer == {"final": plan.answer, "items": ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]}
    check_round_trip(proxy)
