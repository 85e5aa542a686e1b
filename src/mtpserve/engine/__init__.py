"""Turning a model into results: the engine (one scheduler thread over slots), its parts, and the planning before
it runs. `engine.py` steps; `slots.py` decides what each slot keeps; `runner.py` runs forward passes (eager or
captured); `job.py` and `output.py` follow one request from its sampler to its text; `grammar.py` and
`reasoning_budget.py` constrain what it may say; `drafters.py` and `speculative.py` speculate; `client.py` is what
the server sees; `planner.py` and `placement.py` size and place before anything loads.

Its names load on first use (PEP 562): `mtpserve.engine.errors` and `.config` are read by commands that never run
a model (`mtpserve tokenize`), which should not wait for PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    **dict.fromkeys(
        ("EngineClient", "EngineCounters", "EngineInfo", "MemoryUsage", "RequestStream", "SlotInfo"), ".client"
    ),
    **dict.fromkeys(("EngineConfig", "SpecConfig"), ".config"),
    "Engine": ".engine",
    **dict.fromkeys(
        ("Cancelled", "ContextSizeExceeded", "EngineError", "InsufficientMemory", "InvalidRequest", "ServerError"),
        ".errors",
    ),
    **dict.fromkeys(("MemoryPlan", "plan_for_file"), ".planner"),
    **dict.fromkeys(("FinishEvent", "GrammarSpec", "ProgressEvent", "Request", "Timings", "TokenEvent"), ".request"),
    "SamplingParams": ".sampling",
}

if TYPE_CHECKING:
    from .client import EngineClient, EngineCounters, EngineInfo, MemoryUsage, RequestStream, SlotInfo
    from .config import EngineConfig, SpecConfig
    from .engine import Engine
    from .errors import Cancelled, ContextSizeExceeded, EngineError, InsufficientMemory, InvalidRequest, ServerError
    from .planner import MemoryPlan, plan_for_file
    from .request import FinishEvent, GrammarSpec, ProgressEvent, Request, Timings, TokenEvent
    from .sampling import SamplingParams

__all__ = [
    "Cancelled",
    "ContextSizeExceeded",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineCounters",
    "EngineError",
    "EngineInfo",
    "FinishEvent",
    "ProgressEvent",
    "GrammarSpec",
    "InsufficientMemory",
    "InvalidRequest",
    "MemoryPlan",
    "MemoryUsage",
    "Request",
    "RequestStream",
    "SamplingParams",
    "ServerError",
    "SlotInfo",
    "SpecConfig",
    "Timings",
    "TokenEvent",
    "plan_for_file",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
