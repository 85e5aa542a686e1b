"""Where the engine replicas publish what the gateway reports (/slots, /props, /metrics): a small named Ray actor.

A Serve handle reaches one replica per call, chosen by the router, so the gateway cannot ask each replica in turn;
each replica instead puts its state here every PUBLISH_PERIOD seconds, and the gateway reads all of it at once. A
replica that stops publishing (it died) drops out after STALE_AFTER seconds.
"""

from __future__ import annotations

import time
from typing import Any

import ray

PUBLISH_PERIOD = 0.25  # seconds between a replica's reports
STALE_AFTER = 3.0  # seconds without a report before a replica is no longer listed


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}

    def put(self, replica: str, report: dict[str, Any]) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def drop(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The live replicas' latest reports, by replica id."""
        now = time.monotonic()
        return {r: report for r, (at, report) in sorted(self._reports.items()) if now - at < STALE_AFTER}


def board(app_name: str) -> ray.actor.ActorHandle:
    """The application's board, created by whoever asks first. Detached (a replica that created it may die); the
    launcher kills it when the application stops."""
    return StatsBoard.options(
        name=f"mtpserve-stats-{app_name}", namespace="mtpserve", get_if_exists=True, lifetime="detached"
    ).remote()
