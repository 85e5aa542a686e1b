"""Per-sequence state the engine owns: attention KV caches and Gated DeltaNet recurrent state."""

from .kv import KVCache
from .recurrent import RecurrentState

__all__ = ["KVCache", "RecurrentState"]
