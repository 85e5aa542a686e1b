"""Constrained decoding over HTTP with the official OpenAI client: response_format (Pydantic models through
`chat.completions.parse`), JSON schemas and GBNF grammars on the completion endpoints, forced tool calls with the
reasoning left free, several constrained requests at once. Every output is checked against its schema or grammar
by a validator that is not ours (Pydantic, a regular expression, Python's own parser)."""

from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from ..conftest import default_model
from ..support.server_process import ServerProcess
from .conftest import TINY_KEY


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "editor", "viewer"]
    scores: list[Annotated[float, Field(ge=0, le=100)]] = Field(max_length=3)
    address: Address


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


# Enums and bounded numbers: a string parameter is free text until the model writes </parameter> (Qwen's XML
# calls), which the 4M-parameter test model may never do; a real model's strings end (docs/constrained-decoding.md)
class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET", "JST"]
    hours: int = Field(ge=-12, le=12)


def _tool(name: str, args: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": args.model_json_schema()}}


WEATHER, TIME = _tool("get_weather", WeatherArgs), _tool("get_time", TimeArgs)
ASK = [{"role": "user", "content": "Describe a person called Ada who lives in London."}]


def _server(tmp_path_factory, model: str, *extra: str) -> ServerProcess:
    args = ["-m", model, "--alias", "any", "-np", "4", "-c", "8192", "-t", "2", *extra]
    return ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    process = _server(tmp_path_factory, str(default_model("smollm2")))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def qwen(tiny_server):
    return tiny_server


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=TINY_KEY, max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_parse_returns_the_pydantic_model(request, which, temperature):
    server = request.getfixturevalue(which)
    reply = _client(server).chat.completions.parse(
        model="any", messages=ASK, response_format=Person, max_tokens=400, temperature=temperature, seed=7
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message
    assert isinstance(choice.message.parsed, Person)
    if which == "qwen":  # thinking on: the reasoning stays free text, the answer is the JSON
        assert choice.message.model_extra.get("reasoning_content") is not None


@pytest.mark.parametrize("n", [4, pytest.param(50, marks=pytest.mark.slow)])
def test_seeded_requests_with_a_nested_schema_all_validate(smol, n):
    client = _client(smol)

    def ask(seed: int) -> Person | None:
        reply = client.chat.completions.parse(
            model="any", messages=ASK, response_format=Person, max_tokens=300, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.parsed

    with ThreadPoolExecutor(4) as pool:
        people = list(pool.map(ask, range(n)))
    assert all(isinstance(p, Person) for p in people)
    assert len({p.model_dump_json() for p in people}) > n // 2  # sampled, not one answer n times


def test_four_slots_with_four_schemas_at_once(smol):
    client = _client(smol)
    schemas = [
        Person,
        City,
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    ]

    def ask(schema) -> str:
        if isinstance(schema, type):
            fmt = {
                "type": "json_schema",
                "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema()},
            }
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        reply = client.chat.completions.create(
            model="any", messages=ASK, response_format=fmt, max_tokens=400, temperature=0.8, seed=1
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        person, city, flag, digits = pool.map(ask, schemas)
    Person.model_validate_json(person)
    City.model_validate_json(city)
    assert isinstance(json.loads(flag)["ok"], bool)
    values = json.loads(digits)
    assert 2 <= len(values) <= 4 and all(isinstance(v, int) and 0 <= v <= 9 for v in values)


def test_json_object_gives_an_object(smol):
    reply = _client(smol).chat.completions.create(
        model="any", messages=ASK, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    content = reply.choices[0].message.content
    assert content.lstrip().startswith("{")  # a prefix of an object even when the length runs out
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,3}
"""


@pytest.mark.parametrize("seed", range(4))
def test_gbnf_on_the_native_completion(smol, seed):
    with httpx.Client(base_url=smol.url, timeout=120) as http:
        body = {"prompt": "Is the sky blue? Answer: ", "grammar": 'root ::= ("yes" | "no")', "n_predict": 8}
        yes_no = http.post("/completion", json={**body, "temperature": 1.0, "seed": seed}).json()
        assert yes_no["content"] in ("yes", "no") and yes_no["stop_type"] == "eos"
        body = {"prompt": "A sum: ", "grammar": ARITHMETIC, "n_predict": 24, "temperature": 1.0, "seed": seed}
        expression = http.post("/completion", json=body).json()
        text = expression["content"]
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text
        if expression["stop_type"] == "eos":
            ast.parse(text, mode="eval")  # a whole expression: Python's parser agrees


def test_json_schema_on_the_openai_completions_endpoint(smol):
    schema = City.model_json_schema()
    reply = _client(smol).completions.create(
        model="any",
        prompt="The capital of France as JSON: ",
        max_tokens=80,
        temperature=0,
        extra_body={"json_schema": schema},
    )
    if reply.choices[0].finish_reason == "stop":
        City.model_validate_json(reply.choices[0].text)
    else:
        assert reply.choices[0].text.lstrip().startswith("{")


def _tool_arguments_valid(call) -> BaseModel:
    """The call's arguments validated by Pydantic against the model its tool's schema came from."""
    args = {"get_weather": WeatherArgs, "get_time": TimeArgs}[call.function.name]
    return args.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_with_thinking_on(qwen, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]
    kwargs = dict(
        model="any",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=400,
        temperature=0,
        parallel_tool_calls=False,  # the tiny model would call again and again
        extra_body={"reasoning_budget_tokens": 48},  # and think past any max_tokens
    )
    client = _client(qwen)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message
        calls = choice_.message.tool_calls
        reasoning = choice_.message.model_extra.get("reasoning_content")
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["tool_calls"]
        by_index: dict[int, dict] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                entry = by_index.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
        calls = [type("Call", (), {"function": type("F", (), e)})() for _, e in sorted(by_index.items())]
        reasoning = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
        )
    assert calls
    for call in calls:
        _tool_arguments_valid(call)
    if choice == "named":
        assert all(call.function.name == "get_weather" for call in calls)
    assert reasoning is not None  # thinking on: the reasoning came back as its own field


def test_auto_leaves_the_choice_to_the_model_and_holds_its_calls(qwen):
    reply = _client(qwen).chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice="auto",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
        extra_body={"reasoning_budget_tokens": 48},
    )
    choice = reply.choices[0]
    if choice.message.tool_calls:  # whatever the model chose, a call it made is well formed
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _tool_arguments_valid(choice.message.tool_calls[0])
    else:
        assert choice.message.content is not None


def test_a_named_function_that_is_not_a_tool_is_a_400(qwen):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        _client(qwen).chat.completions.create(
            model="any",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}},
            max_tokens=8,
        )
