"""schemathesis's drawn requests, the same ones every run (derandomized), for the fuzz tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings


def for_drawn_cases(operation: Any, mode: Any, examples: int, check: Callable[[Any], None]) -> None:
    """check(case) on `examples` cases schemathesis draws for `operation` in `mode` (valid or invalid bodies)."""

    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case: Any) -> None:
        check(case)

    run()
