"""Turning a model into results: the engine (one scheduler thread over slots), its parts, and the planning before
it runs. `engine.py` steps; `slots.py` decides what each slot keeps; `runner.py` runs forward passes (eager or
captured); `job.py` and `output.py` follow one request from its sampler to its text; `grammar.py` and
`reasoning_budget.py` constrain what it may say; `drafters.py` and `speculative.py` speculate; `client.py` is what
the server sees; `planner.py` and `placement.py` size and place before anything loads."""

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
