"""A coding agent's request pattern on one slot (`-np 1`): how many prompt tokens each server evaluates, against
the minimum that no cache could avoid, and the time to the first token of the main conversation's turns.

    .venv/bin/python bench/agent_trace.py [--llama-server PATH] [--model GGUF] [--turns 6] [--max-tokens 48]
                                          [--thinking off|on|both] [--json PATH]

An agent's main conversation grows turn by turn over a long system prompt (~2,500 tokens: its instructions and
tool docs), and between the turns it sends side requests through the same server: a title for the conversation
(its own short system prompt and the first user message), a sub-agent (the main system prompt, another task) and,
every other turn, a permission or summary check (a tiny system prompt of its own). With one slot each side request
takes the slot's cache from the main conversation; a host-memory prompt cache (mtpserve's and llama-server's
`--cache-ram`) keeps the evicted state and restores it at the next main turn.

The servers, started here one after another (2 cores: never at the same time), each afresh for every thinking mode,
all with `-m MODEL -np 1 -c 16384 -t 2`: `mtpserve` (its defaults, so the prompt cache is on), `mtpserve
--cache-ram 0` (the cache off) and, with `--llama-server`, llama.cpp's llama-server (its defaults, and
`--override-kv ARCH.context_length=int:16384` where the model was trained on less: llama-server would cap the slot
there, tinyqwen35's 4096 being outgrown at the sixth turn, while mtpserve does not). Each is sent
the same deterministic pattern (texts sliced from this Python's standard-library sources, `--seed`), 15 requests
for 6 turns: streamed /v1/chat/completions, temperature 0, `chat_template_kwargs.enable_thinking` per mode, each
main turn carrying the server's own earlier replies (content and reasoning_content, as an agent sends them back).

Per request: the prompt's token ids (the server's /apply-template of the same body, then its /tokenize), the
evaluated and reused prompt tokens (`timings.prompt_n` and `timings.cache_n` of the stream's last chunk, their
sum checked against the prompt's length), the time to the first streamed content or reasoning (client side) and
the total time. From the token ids:

- minimum: the prompt's length less its longest common prefix with any earlier prompt of the run (what no cache
  can avoid evaluating), summed over the requests;
- a main turn's new tokens: its length less its common prefix with the previous main turn's prompt (the first
  main turn: all of it).

One markdown table per thinking mode goes to stdout (one row per server), a line per request to stderr, and with
`--json PATH` every request's record (the token ids included).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mtpserve.engine.slots import common_prefix
from mtpserve.gguf.reader import open_gguf
from mtpserve.tuning.runner import managed_server, mtpserve_command
from mtpserve.tuning.workload import stream_chunks

MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
CTX = 16384
SERVER_FLAGS = ["-np", "1", "-c", str(CTX), "-t", "2"]
CHARS_PER_TOKEN = 3.4  # standard-library source and docs, Qwen-style BPE: close enough to size the texts
SYSTEM_TOKENS = 2500

# Pure-Python standard-library modules: the system prompt's tool docs and every "file" the agent reads.
TOOLS = [
    ("run_command", "subprocess.run"),
    ("copy_tree", "shutil.copytree"),
    ("walk", "os.walk"),
    ("glob", "glob.glob"),
    ("diff", "difflib.unified_diff"),
    ("dedent", "textwrap.dedent"),
    ("split_args", "shlex.split"),
    ("read_json", "json.loads"),
]
FILES = [
    "argparse",
    "calendar",
    "configparser",
    "csv",
    "dataclasses",
    "difflib",
    "fractions",
    "heapq",
    "ipaddress",
    "json.decoder",
    "pprint",
    "queue",
    "sched",
    "string",
    "tempfile",
    "tokenize",
]
TASKS = [
    "find every caller of `{name}` and say which of them pass a non-default argument",
    "check whether `{name}` handles an empty input, and write the failing test if it does not",
    "list the exceptions `{name}` can raise and where each comes from",
    "explain what `{name}` returns and suggest a clearer docstring",
    "find a simpler way to write `{name}` without changing its behaviour",
]
TITLE_SYSTEM = "Write a 5-word title for this conversation. Reply with the title only."
PERMISSION_SYSTEM = "You approve an agent's shell commands. Answer `allow` or `deny`, then one short reason."
SUMMARY_SYSTEM = "Summarize in one sentence what the assistant just did."
COMMANDS = [
    "python -m pytest -q tests/{name}",
    "rm -rf build/ dist/ && python -m build",
    "git diff --stat HEAD~1 -- src/{name}.py",
    "sed -i 's/old/new/' src/{name}.py",
]


# --- the pattern ------------------------------------------------------------------------------------------------


def _source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def _excerpt(rng: random.Random, tokens: int) -> tuple[str, str, int, int]:
    """About `tokens` tokens of a standard-library module, whole lines: (module, text, first line, last line)."""
    module = rng.choice(FILES)
    lines = _source(module).splitlines()
    start = rng.randrange(max(1, len(lines) - 400))
    text, end = "", start
    while end < len(lines) and len(text) < tokens * CHARS_PER_TOKEN:
        text += lines[end] + "\n"
        end += 1
    return module, text, start + 1, end


def _name_in(text: str) -> str:
    """A def or class name in the excerpt (the subject of a task), or the first identifier."""
    for line in text.splitlines():
        word = line.strip().split("(")[0].split(":")[0].split()
        if len(word) == 2 and word[0] in ("def", "class"):
            return word[1]
    return next((w for w in text.replace("(", " ").split() if w.isidentifier()), "main")


def system_prompt() -> str:
    """The main conversation's (and sub-agents') system prompt: instructions, tool docs, a style reference."""
    parts = [
        "You are a coding agent working in a Python repository. You read files, run commands and edit code "
        "with the tools below, one call at a time, and you explain each change in a sentence. Keep changes "
        "small, run the tests after each edit, and never touch files outside the repository.\n\n# Tools\n",
    ]
    for tool, target in TOOLS:
        module, _, attr = target.rpartition(".")
        doc = (inspect.getdoc(getattr(importlib.import_module(module), attr)) or "")[:700]
        doc = doc[: doc.rfind("\n\n")] if "\n\n" in doc and len(doc) == 700 else doc  # whole paragraphs
        parts.append(f"\n## {tool}\nWraps `{target}`; its documentation:\n\n{doc}\n")
    parts.append("\n# Style reference: follow the conventions of this module\n\n```python\n")
    text = "".join(parts)
    text += _source("textwrap")[: max(0, int(SYSTEM_TOKENS * CHARS_PER_TOKEN) - len(text))]
    return text + "\n```\n"


@dataclass
class Step:
    """One request of the pattern, before it is sent: the main turns' messages are filled in as replies come."""

    kind: str  # main, title, subagent, check
    turn: int
    messages: list[dict[str, Any]]


def side_requests(rng: random.Random, turn: int, system: str, first_user: str, last_reply: str) -> list[Step]:
    """What an agent sends between main turn `turn` and the next: a title (after the first turn), a sub-agent
    (the main system prompt, another task) and, every other turn, a permission or a summary check."""
    steps = []
    if turn == 0:
        steps.append(Step("title", turn, [_msg("system", TITLE_SYSTEM), _msg("user", first_user)]))
    module, text, first, last = _excerpt(rng, rng.randint(80, 170))
    task = rng.choice(TASKS).format(name=_name_in(text))
    user = f"You are a sub-agent. Your task: {task}.\n\n{module}.py, lines {first}-{last}:\n```python\n{text}```"
    steps.append(Step("subagent", turn, [_msg("system", system), _msg("user", user)]))
    if turn % 2 == 0:
        if turn % 4 == 0:
            command = rng.choice(COMMANDS).format(name=rng.choice(FILES).replace(".", "/"))
            check = [_msg("system", PERMISSION_SYSTEM), _msg("user", f"Command: `{command}`")]
        else:
            check = [_msg("system", SUMMARY_SYSTEM), _msg("user", f"The assistant said:\n{last_reply[:600]}")]
        steps.append(Step("check", turn, check))
    return steps


def main_user_message(rng: random.Random, turn: int) -> str:
    """A main turn's new user message, 150-300 tokens: the task (turn 0), then tool results."""
    module, text, first, last = _excerpt(rng, rng.randint(130, 270))
    if turn == 0:
        task = rng.choice(TASKS).format(name=_name_in(text))
        return f"Please {task}. Here is the code, {module}.py lines {first}-{last}:\n```python\n{text}```"
    return f"Tool result (read_file {module}.py, lines {first}-{last}):\n```python\n{text}```\nContinue."


def _msg(role: str, content: str, **extra: str) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


# --- measuring --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as sent to one server, and what it cost there."""

    server: str
    thinking: bool
    index: int
    kind: str
    turn: int
    n_prompt: int  # the prompt's tokens (the server's /apply-template + /tokenize)
    prompt_n: int  # evaluated (timings.prompt_n)
    cache_n: int  # reused (timings.cache_n)
    predicted_n: int
    ttft_ms: float  # client side: sent -> first content or reasoning delta
    total_ms: float
    lcp_earlier: int  # longest common prefix with any earlier prompt of the run
    lcp_previous_main: int | None  # main turns: common prefix with the previous main turn's prompt
    content: str = ""
    reasoning_content: str = ""
    prompt_tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def minimum(self) -> int:
        return self.n_prompt - self.lcp_earlier

    @property
    def new(self) -> int:
        """A main turn's tokens new since the previous main turn (its whole length for the first)."""
        return self.n_prompt - (self.lcp_previous_main or 0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "minimum": self.minimum, **({"new": self.new} if self.kind == "main" else {})}


def prompt_tokens(client: httpx.Client, url: str, body: dict[str, Any]) -> list[int]:
    """The token ids the server would evaluate for this chat body: its template, then its tokenizer."""
    rendered = client.post(f"{url}/apply-template", json=body)
    rendered.raise_for_status()
    content = rendered.json()["prompt"]
    tokenized = client.post(f"{url}/tokenize", json={"content": content, "add_special": True, "parse_special": True})
    tokenized.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in tokenized.json()["tokens"]]


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat completion: the reply (content, reasoning_content), the last `timings`, the client times."""
    content, reasoning, timings = [], [], {}
    t0 = time.perf_counter()
    first: float | None = None
    for chunk in stream_chunks(client, url, body):
        timings = chunk.get("timings", timings)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                first = first or time.perf_counter()
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
    total = time.perf_counter() - t0
    if not timings:
        raise RuntimeError("the stream carried no timings")
    return {
        "content": "".join(content),
        "reasoning_content": "".join(reasoning),
        "timings": timings,
        "ttft_ms": 1000 * ((first or time.perf_counter()) - t0),
        "total_ms": 1000 * total,
    }


def run_pattern(
    url: str,
    thinking: bool,
    turns: int = 6,
    max_tokens: int = 48,
    seed: int = 0,
    server: str = "",
    progress: Callable[[str], None] | None = None,
) -> list[Record]:
    """Send the agent's pattern to the server at `url` (one slot, freshly started: the first request is
    expected to find nothing cached) and measure every request."""
    rng = random.Random(seed)
    system = system_prompt()
    messages = [_msg("system", system)]
    records: list[Record] = []
    earlier: list[list[int]] = []
    previous_main: list[int] | None = None
    first_user = ""
    # A connection per request: llama-server may close a kept-alive connection just after a stream has ended, and
    # a request sent on it then finds no answer.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=httpx.Timeout(3600, connect=10), limits=limits) as client:

        def send(step: Step) -> dict[str, Any]:
            nonlocal previous_main
            body = {
                "messages": step.messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "chat_template_kwargs": {"enable_thinking": thinking},
            }
            tokens = prompt_tokens(client, url, body)
            reply = stream_chat(client, url, body)
            t = reply["timings"]
            record = Record(
                server=server,
                thinking=thinking,
                index=len(records),
                kind=step.kind,
                turn=step.turn,
                n_prompt=len(tokens),
                prompt_n=int(t.get("prompt_n", 0)),
                cache_n=int(t.get("cache_n", 0)),
                predicted_n=int(t.get("predicted_n", 0)),
                ttft_ms=reply["ttft_ms"],
                total_ms=reply["total_ms"],
                lcp_earlier=max((common_prefix(tokens, e) for e in earlier), default=0),
                lcp_previous_main=None,
                content=reply["content"],
                reasoning_content=reply["reasoning_content"],
                prompt_tokens=tokens,
            )
            if step.kind == "main":
                record.lcp_previous_main = common_prefix(tokens, previous_main) if previous_main else 0
                previous_main = tokens
            earlier.append(tokens)
            records.append(record)
            if progress:
                progress(progress_line(record))
            return reply

        last_reply = ""
        for turn in range(turns):
            user = main_user_message(rng, turn)
            first_user = first_user or user
            messages.append(_msg("user", user))
            reply = send(Step("main", turn, list(messages)))
            extra = {"reasoning_content": reply["reasoning_content"]} if reply["reasoning_content"] else {}
            messages.append(_msg("assistant", reply["content"], **extra))
            last_reply = reply["content"] or reply["reasoning_content"]
            if turn < turns - 1:
                for step in side_requests(rng, turn, system, first_user, last_reply):
                    send(step)
    return records


def progress_line(r: Record) -> str:
    mismatch = "" if r.prompt_n + r.cache_n == r.n_prompt else f" (!= prompt_n+cache_n {r.prompt_n + r.cache_n})"
    new = f" new {r.new:5d}" if r.kind == "main" else " " * 10
    return (
        f"{r.server or 'server'} thinking={'on' if r.thinking else 'off'} #{r.index + 1:2d} {r.kind:8} turn {r.turn}: "
        f"prompt {r.n_prompt:5d}{mismatch} minimum {r.minimum:5d}{new} evaluated {r.prompt_n:5d} "
        f"cache_n {r.cache_n:5d} ttft {r.ttft_ms:7.0f} ms total {r.total_ms:7.0f} ms"
    )


@dataclass
class Summary:
    requests: int
    prompt_tokens: int
    minimum: int
    evaluated: int
    main_new: int
    main_evaluated: int
    main_ttft_ms: float  # median over the main turns

    @property
    def ratio(self) -> float:
        return self.evaluated / self.minimum if self.minimum else 0.0

    @property
    def main_ratio(self) -> float:
        return self.main_evaluated / self.main_new if self.main_new else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "main_ratio": self.main_ratio}


def summarize(records: list[Record]) -> Summary:
    main = [r for r in records if r.kind == "main"]
    return Summary(
        requests=len(records),
        prompt_tokens=sum(r.n_prompt for r in records),
        minimum=sum(r.minimum for r in records),
        evaluated=sum(r.prompt_n for r in records),
        main_new=sum(r.new for r in main),
        main_evaluated=sum(r.prompt_n for r in main),
        main_ttft_ms=statistics.median(r.ttft_ms for r in main) if main else 0.0,
    )


def table(rows: list[tuple[str, Summary | None]]) -> str:
    head = (
        "| server | requests | prompt tokens | minimum | evaluated | evaluated/minimum | main new | main evaluated "
        "| ratio | main TTFT ms (median) | TTFT vs mtpserve |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    base = next((s.main_ttft_ms for _, s in rows if s), 0.0)
    for name, s in rows:
        if s is None:
            lines.append(f"| {name} | failed |" + " |" * 9)
            continue
        vs = f"{s.main_ttft_ms / base:.2f}" if base else "-"
        lines.append(
            f"| {name} | {s.requests} | {s.prompt_tokens} | {s.minimum} | {s.evaluated} | {s.ratio:.2f} | "
            f"{s.main_new} | {s.main_evaluated} | {s.main_ratio:.2f} | {s.main_ttft_ms:.0f} | {vs} |"
        )
    return "\n".join(lines)


# --- the servers ------------------------------------------------------------------------------------------------


def servers(model: str, llama_server: str | None) -> list[tuple[str, list[str]]]:
    out = [
        ("mtpserve", mtpserve_command(model, SERVER_FLAGS)),
        ("mtpserve --cache-ram 0", mtpserve_command(model, [*SERVER_FLAGS, "--cache-ram", "0"])),
    ]
    if llama_server:
        out.append(("llama-server", [llama_server, "-m", model, *SERVER_FLAGS, "--jinja", "--no-webui", *uncap(model)]))
    return out


def uncap(model: str) -> list[str]:
    """llama-server caps a slot's context at the model's trained context (4096 for tinyqwen35, which the main
    conversation outgrows at its sixth turn), mtpserve does not: the same -c for both, by raising the trained
    context llama-server reads (a plain RoPE model computes the same either way)."""
    gguf = open_gguf(model)
    key = f"{gguf.architecture}.context_length"
    trained = gguf.metadata.get(key)
    return ["--override-kv", f"{key}=int:{CTX}"] if isinstance(trained, int) and trained < CTX else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=str(MODEL), help="the GGUF every server loads")
    ap.add_argument("--llama-server", help="a llama-server binary, measured after mtpserve")
    ap.add_argument("--turns", type=int, default=6, help="main conversation turns (default 6)")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request (default 48)")
    ap.add_argument("--thinking", choices=["off", "on", "both"], default="both")
    ap.add_argument("--seed", type=int, default=0, help="the pattern's texts (default 0)")
    ap.add_argument("--json", type=Path, help="write every request's record here")
    ap.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary folder)")
    args = ap.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="agent_trace-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.thinking]
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    setup = f"{args.turns} turns, max_tokens {args.max_tokens}"
    say(f"{Path(args.model).name}, {' '.join(SERVER_FLAGS)}: {setup}; the servers' logs in {log_dir}")
    runs, failed = [], False
    for thinking in modes:
        rows: list[tuple[str, Summary | None]] = []
        for name, command in servers(args.model, args.llama_server):
            log = log_dir / f"{name.replace(' ', '').replace('-', '_')}-thinking_{'on' if thinking else 'off'}.log"
            try:
                with managed_server(command, log) as url:
                    records = run_pattern(url, thinking, args.turns, args.max_tokens, args.seed, name, say)
            except (RuntimeError, TimeoutError, httpx.HTTPError, ValueError, KeyError) as e:
                say(f"{name} thinking={'on' if thinking else 'off'}: failed: {e}")
                rows.append((name, None))
                failed = True
                continue
            summary = summarize(records)
            rows.append((name, summary))
            runs.append(
                {
                    "server": name,
                    "command": command,
                    "thinking": thinking,
                    "summary": summary.as_dict(),
                    "records": [r.as_dict() for r in records],
                }
            )
        print(f"\n### thinking {'on' if thinking else 'off'}\n\n{table(rows)}", flush=True)
    if args.json:
        meta = {"model": args.model, "turns": args.turns, "max_tokens": args.max_tokens, "seed": args.seed}
        args.json.write_text(json.dumps({**meta, "runs": runs}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
