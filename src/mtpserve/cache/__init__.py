"""Per-sequence state the engine owns: attention KV caches and Gated DeltaNet recurrent state."""

from .kv import KVCache, append_and_attend
from .recurrent import RecurrentState

__all__ = ["KVCache", "RecurrentState", "append_and_attend"]
