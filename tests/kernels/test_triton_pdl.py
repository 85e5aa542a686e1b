"""Programmatic dependent launch (kernels/triton/pdl.py): off by default, only where the device has it, and the
contract each decode kernel's PTX must keep (tests/support/gpu_compile.py --pdl compiles every decode launch as its
wrapper makes it with PDL on and checks it). Whether it pays is measured on a lent GPU (bench/gpu.py --pdl, with
the PDL graph's logits held to the plain graph's bit for bit; bench/gpu_smoke.py's PDL graph case)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mtpserve.kernels.triton import pdl
from tests.kernels.test_gpu_compile import LENT_TRITON, compile_kernels, lent_triton
from tests.support.compiler import require_compiler
from tests.support.gpu_compile import pdl_problems

PDL = {"PDL": True, "launch_pdl": True}


def test_off_by_default_and_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.ENABLED is False
    assert pdl.launch_options(torch.zeros(1)) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.zeros(1)) == {}  # a CPU tensor: the interpreter has no dependent launch


@pytest.mark.parametrize(
    ("capability", "interpreted", "expected"),
    [((9, 0), False, PDL), ((10, 0), False, PDL), ((8, 9), False, {}), ((7, 5), False, {}), ((9, 0), True, {})],
)
def test_only_sm90_and_later_compiled(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], interpreted: bool, expected: dict
) -> None:
    """sm_90+ only (griddepcontrol is Hopper's), as the device's branches see it (MTPSERVE_CUDA_CAPABILITY=7.5
    lowers it), never under the interpreter."""
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "cuda_capability", lambda device: capability)
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda_tensor = SimpleNamespace(is_cuda=True, device="cuda:0")
    assert pdl.launch_options(cuda_tensor) == expected  # type: ignore[arg-type]
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_options(cuda_tensor) == {}  # type: ignore[arg-type]


WAIT, TRIGGER = "griddepcontrol.wait ;", "griddepcontrol.launch_dependents ;"
PARAM, LOAD = "ld.param.b64 %rd1, [p];", "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];"


def test_the_contract_check_finds_what_breaks_it() -> None:
    """What gpu_compile --pdl reads off each PTX: one wait and one trigger, and before the wait no global store and
    no global load beyond the weights' allowance; parameter loads are free."""
    assert pdl_problems("\n".join([PARAM, WAIT, TRIGGER, LOAD, "st.global.b32 [%rd2], %r1;"])) == []
    assert pdl_problems("\n".join([PARAM, LOAD, LOAD, WAIT, TRIGGER]), weight_loads=2) == []
    assert pdl_problems("\n".join([PARAM, LOAD, LOAD, LOAD, WAIT, TRIGGER]), weight_loads=2) == [
        "3 global loads before griddepcontrol.wait (the weights' allow 2)"
    ]
    assert pdl_problems("\n".join(["st.global.b32 [%rd2], %r1;", WAIT, TRIGGER])) == [
        "1 global stores before griddepcontrol.wait"
    ]
    assert pdl_problems("\n".join(["red.global.add.f32 [%rd2], %f1;", WAIT, TRIGGER])) == [
        "1 global stores before griddepcontrol.wait"
    ]
    assert pdl_problems("\n".join([PARAM, LOAD])) == ["0 griddepcontrol.wait and 0 launch_dependents (want one each)"]
    assert pdl_problems("\n".join([WAIT, WAIT, TRIGGER])) == [
        "2 griddepcontrol.wait and 1 launch_dependents (want one each)"
    ]


# the decode kernels gpu_compile --pdl compiles (every decode launch as its wrapper makes it)
DECODE_KERNELS = ("gemv_q8", "rowwise_norm", "rope_kv", "attn_split", "attn_combine", "gated_delta", "gdn_glue")


def test_decode_kernels_keep_the_contract_on_sm90() -> None:
    """One decode launch of each kernel, as its wrapper makes it with PDL on, compiled for sm_90: it carries PDL
    (a wrapper that forgot launch_options fails) and its PTX keeps the contract."""
    require_compiler()
    compile_kernels("--pdl", "--quick", kernels=DECODE_KERNELS)


@pytest.mark.slow
def test_every_decode_launch_keeps_the_contract_with_both_tritons() -> None:
    """Every decode configuration (every GEMV type and row count, each attention kernel, the K split and its sum,
    the prefetching GEMV with its first weights before the wait) for sm_90, with our Triton and the lent image's
    (about 60 s each on 2 cores)."""
    require_compiler()
    kernels = (*DECODE_KERNELS, "gemv_q8_sum")
    ours = compile_kernels("--pdl", "--arch", "90", timeout=900, kernels=kernels)
    assert "prefetch" in ours
    import triton

    if triton.__version__ != LENT_TRITON:
        lent = compile_kernels("--pdl", "--arch", "90", pythonpath=str(lent_triton()), timeout=900, kernels=kernels)
        assert lent.startswith(f"triton {LENT_TRITON},")
