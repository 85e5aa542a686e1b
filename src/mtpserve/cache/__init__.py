"""Per-sequence state the engine owns: attention KV caches and Gated DeltaNet recurrent state."""

from .kv import CellTable, KVCache, KVPool, append_and_attend
from .recurrent import KeptSteps, RecurrentState

__all__ = ["CellTable", "KVCache", "KVPool", "KeptSteps", "RecurrentState", "append_and_attend"]
