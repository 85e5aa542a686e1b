"""Typed reads of GGUF metadata: a missing or mistyped key is a `GGUFError` that names the key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .reader import GGUFError

_REQUIRED: Any = object()


class Metadata:
    """Read-only view of a GGUF file's key/values with checked conversions.

    `source` is what error messages name (the file path). Integers accept any GGUF integer type, floats
    any number; list getters accept a GGUF array or a single scalar (llama.cpp allows both for per-layer
    values such as `head_count`).
    """

    def __init__(self, values: Mapping[str, Any], source: str | Path) -> None:
        self.values = values
        self.source = source

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def _missing(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise GGUFError(self.source, f"required metadata key '{key}' is missing")
        return default

    def _bad(self, key: str, value: Any, expected: str) -> GGUFError:
        shown = f"array of {len(value)}" if isinstance(value, (list, np.ndarray)) else type(value).__name__
        return GGUFError(self.source, f"metadata key '{key}' should be {expected}, got {shown}")

    def get_int(self, key: str, default: Any = _REQUIRED) -> int:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self._bad(key, value, "an integer")
        return int(value)

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self._bad(key, value, "a number")
        return float(value)

    def get_bool(self, key: str, default: Any = _REQUIRED) -> bool:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if not isinstance(value, (bool, np.bool_)):
            raise self._bad(key, value, "a bool")
        return bool(value)

    def get_str(self, key: str, default: Any = _REQUIRED) -> str:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def get_int_list(self, key: str, default: Any = _REQUIRED) -> list[int]:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
            return [int(v) for v in value]
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return [int(value)]
        raise self._bad(key, value, "an integer or an array of integers")

    def get_bool_list(self, key: str, default: Any = _REQUIRED) -> list[bool]:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if isinstance(value, np.ndarray) and value.dtype == np.bool_:
            return [bool(v) for v in value]
        raise self._bad(key, value, "an array of bools")

    def get_str_list(self, key: str, default: Any = _REQUIRED) -> list[str]:
        if key not in self.values:
            return self._missing(key, default)
        value = self.values[key]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise self._bad(key, value, "an array of strings")

    def get_uniform_int(self, key: str, n_layers: int, default: Any = _REQUIRED) -> int:
        """A per-layer integer (scalar or array) that must be the same for every layer."""
        values = self.get_int_list(key, default if default is _REQUIRED else [default])
        if len(values) not in (1, n_layers):
            raise GGUFError(self.source, f"metadata key '{key}' has {len(values)} entries for {n_layers} layers")
        if len(set(values)) != 1:
            raise GGUFError(self.source, f"metadata key '{key}' varies per layer ({values}); not supported")
        return values[0]
