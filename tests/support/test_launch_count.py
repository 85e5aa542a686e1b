"""tests/support/launch_count.py counts what CUDA would launch: views and allocations nothing, composite ops by
their parts, Triton kernels by name without running them."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.launch_count import count_launches

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="counting Triton launches needs TRITON_INTERPRET=1"
)


def test_views_and_allocations_launch_nothing() -> None:
    x = torch.randn(4, 8)
    with torch.inference_mode(), count_launches() as count:
        x.view(8, 4)[1:].unsqueeze(0).transpose(1, 2)
        x.reshape(32)  # contiguous: a view
        x.to(torch.float32)  # already float32: no copy
        torch.empty(16)
    assert count.total == 0, count.kernels


def test_kernels_are_counted_by_name_and_composites_by_their_parts() -> None:
    x = torch.randn(4, 8)
    with torch.inference_mode(), count_launches() as count:
        y = x + 1
        x.t().reshape(32)  # strided: reshape copies
        x.to(torch.float16)
        torch.zeros(3)  # one fill
        torch.empty(0).add_(1)  # no elements: no launch
    assert count.kernels == {"aten.add": 1, "aten.clone": 1, "aten._to_copy": 1, "aten.zeros": 1}, count.kernels
    assert torch.equal(y, x + 1)  # the ops still ran


def test_triton_launches_are_recorded_and_skipped() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _ones_kernel(out_ptr, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), 1.0, tl.float32))

    out = torch.zeros(16)
    with count_launches() as count:
        with count.scope("mine"):
            _ones_kernel[(1,)](out, BLOCK=16)
        _ones_kernel[(1,)](out, BLOCK=16)
    assert count.kernels == {"triton._ones_kernel": 2} and count.triton == 2
    assert count.by_scope == {"mine": {"triton._ones_kernel": 1}, "other": {"triton._ones_kernel": 1}}
    assert not out.any()  # skipped: the kernel never wrote
