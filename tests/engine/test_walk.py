"""The engine's shape, measured: one speculative step walks down through its rooms (engine -> speculative ->
drafters / runner / job -> model) and back up, and no room is called back by a room it called."""

from __future__ import annotations

import sys
from types import FrameType

from mtpserve.engine import Engine, EngineConfig, Request, SamplingParams, SpecConfig
from mtpserve.engine.job import Phase
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import tinyqwen_path


def _room(frame: FrameType | None) -> str | None:
    """engine/<module>, tokenizer, or "model" for everything below the engine (models, cache, ops, kernels)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    if not name.startswith("mtpserve."):
        return None
    parts = name.split(".")
    return "/".join(parts[1:3]) if parts[1] == "engine" else parts[1] if parts[1] == "tokenizer" else "model"


def _calls_between_rooms(engine: Engine, request: Request) -> list[dict[tuple[str, str], int]]:
    """caller room -> callee room: calls, for each step of the request while it generates."""
    steps: list[dict[tuple[str, str], int]] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event != "call" or (callee := _room(frame)) is None:
            return
        caller = frame.f_back
        while caller is not None and _room(caller) is None:
            caller = caller.f_back
        if (room := _room(caller)) is not None and room != callee:
            steps[-1][(room, callee)] = steps[-1].get((room, callee), 0) + 1

    step = Engine._step

    def traced(self: Engine) -> None:
        if not self.slots.in_phase(Phase.GENERATE):
            return step(self)
        steps.append({})
        sys.setprofile(profile)
        try:
            step(self)
        finally:
            sys.setprofile(None)

    Engine._step = traced  # type: ignore[method-assign]
    try:
        engine.submit(request).result()
    finally:
        Engine._step = step  # type: ignore[method-assign]
    return steps


def test_a_speculative_step_goes_down_and_back_up():
    path = tinyqwen_path("Q4_K_M")
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    config = EngineConfig(ctx_size=1024, spec=SpecConfig("draft-mtp", n_max=2))
    prompt = tokenizer.encode("def fibonacci(n):")
    with Engine(model, tokenizer, config, plan_for_file(path, config)) as engine:
        steps = _calls_between_rooms(engine, Request(prompt, SamplingParams(temperature=0.0), n_predict=6))
    assert len(steps) >= 2
    for calls in steps:
        assert not [edge for edge in calls if edge[::-1] in calls]  # nothing calls back up
        assert calls[("engine/engine", "engine/speculative")] == 1  # the engine hands the step over once
        below = {callee for (caller, callee) in calls if caller == "engine/engine"}
        assert "model" not in below and "engine/runner" not in below  # the model is its parts' business
        assert calls.get(("engine/engine", "engine/drafters"), 0) <= 1  # at most the drafter's finish hook
        assert {"engine/drafters", "engine/runner"} <= {b for (a, b) in calls if a == "engine/speculative"}
