"""Commands start at once: the command line imports only the command it runs, and commands that never run a model
(`tokenize`) never import PyTorch, the server or Ray (each in a fresh interpreter, where nothing is imported yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mtpserve.cli import COMMANDS, build_parser

from ..conftest import tinyqwen_path
from ..support.vocabs import reference

HEAVY = ("torch", "fastapi", "ray", "xgrammar")


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def test_importing_the_command_line_imports_no_heavy_library():
    loaded = json.loads(
        _fresh(f"import json, sys, mtpserve.cli; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    )
    assert loaded == []


def test_tokenize_runs_without_torch():
    case = reference("tinyqwen35-mtp-F16")["greedy"]["completions"][0]
    code = (
        "import contextlib, io, json, sys\n"
        "from mtpserve.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main(['tokenize', '-m', {str(tinyqwen_path('F16'))!r}, {case['prompt']!r}])\n"
        f"print(json.dumps([rc, json.loads(out.getvalue()), [m for m in {HEAVY!r} if m in sys.modules]]))"
    )
    rc, ids, loaded = json.loads(_fresh(code))
    assert rc == 0 and ids == case["prompt_token_ids"] and loaded == []


def test_the_full_parser_still_lists_every_command():
    help_text = build_parser().format_help()
    assert all(name in help_text for name in COMMANDS)


def test_inspect_runs_without_torch_and_reports_what_the_loaded_model_holds():
    """`inspect` reads the config from metadata alone (models/configs/): no PyTorch, and the layers it reports are
    the ones the model built from the same file has."""
    from mtpserve.models.loader import load

    path = str(tinyqwen_path("Q4_K_M"))
    code = (
        "import contextlib, io, json, sys\n"
        "from mtpserve.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main(['inspect', '--json', '-m', {path!r}])\n"
        f"print(json.dumps([rc, json.loads(out.getvalue()), [m for m in {HEAVY!r} if m in sys.modules]]))"
    )
    rc, report, loaded = json.loads(_fresh(code))
    model = load(path)
    assert rc == 0 and loaded == []
    assert report["architecture"] == model.config.architecture == "qwen35"
    assert report["n_layer"] == model.config.n_layer and report["n_vocab"] == model.config.n_vocab
    assert report["mtp_layers"] == list(model.config.mtp_layers())


def test_the_command_line_makes_openmp_wait_passively_unless_told_otherwise():
    """On the CPU path (no CUDA device visible), set before torch loads libgomp (which reads it once): the command
    line imports no torch of its own."""
    code = (
        "import json, os, sys, mtpserve.cli; print(json.dumps([os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"CUDA_VISIBLE_DEVICES": ""}
    unset = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(unset.stdout) == ["PASSIVE", False]
    told = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(told.stdout) == ["ACTIVE", False]
