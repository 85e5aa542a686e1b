"""Turning a model into results: the slot scheduler (`Engine`), sampling, memory planning, perplexity."""

from .engine import Engine, RequestStream
from .planner import EngineConfig, InsufficientMemory, MemoryPlan, plan_for_file
from .request import ContextSizeExceeded, EngineError, FinishEvent, Request, Timings, TokenEvent
from .sampling import SamplingParams

__all__ = [
    "ContextSizeExceeded",
    "Engine",
    "EngineConfig",
    "EngineError",
    "FinishEvent",
    "InsufficientMemory",
    "MemoryPlan",
    "Request",
    "RequestStream",
    "SamplingParams",
    "Timings",
    "TokenEvent",
    "plan_for_file",
]
