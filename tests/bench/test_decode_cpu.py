"""bench/decode_cpu.py runs each engine as its server would: mtpserve with torch's OpenMP threads waiting passively
(as `mtpserve`'s command line sets them), llama-bench in the environment the script was started in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
CODE = (
    "import json, os, sys; sys.path.insert(0, sys.argv[1]); import decode_cpu; "
    "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), decode_cpu.PEER_ENV.get('OMP_WAIT_POLICY')]))"
)


def _policies(**env: str) -> list[str | None]:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-c", CODE, str(BENCH)], env=base | env, capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_mtpserve_waits_passively_and_the_peer_keeps_the_users_environment():
    assert _policies() == ["PASSIVE", None]


def test_a_policy_the_user_set_holds_for_both():
    assert _policies(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "ACTIVE"]
