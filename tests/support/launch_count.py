"""Count the GPU kernels a piece of GPU-path code would launch, on a machine without a GPU (bench/gpu_static.py).

Run the code under the GPU path's emulation (TRITON_INTERPRET=1 set before triton is imported,
`mtpserve.ops.device.emulate_gpu(matmul="triton")`) inside `count_launches()`. What it counts, per kernel name:

* every aten op that would launch a kernel on CUDA, seen by a TorchDispatchMode; a composite op that reaches
  it (`reshape`, `to`, `contiguous` under inference mode) is decomposed there and its parts counted, as CUDA
  runs them (`reshape` as a `view`, or a `clone` of a strided tensor). Ops that launch nothing are not counted: those in
  NON_LAUNCHING (views, metadata, allocations without a fill), any other op PyTorch marks as a view
  (`OpOverload.is_view`: a safety net, listed in `unlisted_views`), and any op whose outputs are all empty
  (CUDA launches nothing for no elements);
* every Triton launch (`kernel[grid](...)`), RECORDED AND SKIPPED: the interpreter's `InterpretedFunction.run`
  is replaced by one that counts the kernel by name and returns, so the kernel never runs (its outputs stay
  uninitialised memory: fine for counting, as nothing in a decode step branches on values) and the aten ops the
  interpreter's own machinery would issue never happen;
* calls into the C kernel library (mtpserve.kernels.cpu), kept apart in `host_kernel_calls`: on the GPU path
  there should be none (one would be CPU work inside a CUDA step).

Ops that read a value back to the host (`_local_scalar_dense`: `.item()`, `int(t)`) are counted and also
listed in `host_reads`: a captured CUDA graph cannot contain them.

`LaunchCount.scope(name)` attributes what runs inside it to `name` (bench/gpu_static.py: per layer kind).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops (overload packets) that launch no CUDA kernel: views and reshapes of the same storage, metadata,
# and allocations (the caching allocator hands out memory; `empty` does not touch it).
NON_LAUNCHING: frozenset[str] = frozenset(
    {
        # views: a new tensor header over the same memory
        "_reshape_alias",
        "_unsafe_view",
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "expand",
        "lift_fresh",
        "narrow",
        "permute",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "squeeze_",
        "t",
        "transpose",
        "transpose_",
        "unbind",
        "unfold",
        "unsqueeze",
        "unsqueeze_",
        "view",
        "view_as_complex",
        "view_as_real",
        # metadata: answered from the tensor header
        "dim",
        "is_contiguous",
        "is_same_size",
        "numel",
        "result_type",
        "size",
        "stride",
        "sym_numel",
        "sym_size",
        "sym_storage_offset",
        "sym_stride",
        # allocations without a fill, and re-pointing a tensor at memory
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "set_",
    }
)
HOST_READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})  # a device-to-host copy and a sync


@dataclass
class LaunchCount:
    """What ran inside `count_launches()`: kernels by name ("aten.mm", "triton._q4k_gemv_kernel"), by scope."""

    kernels: Counter[str] = field(default_factory=Counter)
    by_scope: dict[str, Counter[str]] = field(default_factory=dict)
    host_kernel_calls: Counter[str] = field(default_factory=Counter)
    host_reads: Counter[str] = field(default_factory=Counter)
    unlisted_views: set[str] = field(default_factory=set)
    _scopes: list[str] = field(default_factory=lambda: ["other"])

    @property
    def total(self) -> int:
        return sum(self.kernels.values())

    @property
    def triton(self) -> int:
        return sum(n for name, n in self.kernels.items() if name.startswith("triton."))

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def record(self, name: str) -> None:
        self.kernels[name] += 1
        self.by_scope.setdefault(self._scopes[-1], Counter())[name] += 1


def launches_kernel(func: torch._ops.OpOverload, out: object, count: LaunchCount) -> bool:
    """Whether aten op `func`, which returned `out`, launches a CUDA kernel (see the module docstring)."""
    name = func.overloadpacket.__name__
    if name in NON_LAUNCHING:
        return False
    if func.is_view:
        count.unlisted_views.add(name)
        return False
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return not outs or any(t.numel() for t in outs)


class _AtenCounter(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # a composite op (reshape, to, contiguous): count the ops it is made of, as CUDA runs them
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if launches_kernel(func, out, self.count):
            name = func.overloadpacket.__name__
            self.count.record(f"aten.{name}")
            if name in HOST_READS:
                self.count.host_reads[name] += 1
        return out


class _HostLibrary:
    """The C kernel library, with every kernel call recorded (the capability queries are not kernels)."""

    def __init__(self, lib: object, count: LaunchCount) -> None:
        self._lib, self._count = lib, count

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._lib, name)
        if not name.startswith("mtp_") or name.endswith("_supported"):
            return attr

        def call(*args: object) -> object:
            self._count.host_kernel_calls[name] += 1
            return attr(*args)

        return call


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Within the block, count kernel launches instead of running the Triton kernels (module docstring).
    Needs TRITON_INTERPRET=1 set before triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from mtpserve.kernels import cpu as cpu_kernels

    count = LaunchCount()

    def run(fn: InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        if not warmup:
            count.record(f"triton.{fn.fn.__name__}")

    lib = cpu_kernels.load()
    host = None if lib is None else _HostLibrary(lib, count)
    with (
        mock.patch.object(InterpretedFunction, "run", run),
        mock.patch.object(cpu_kernels, "load", lambda: host),
        _AtenCounter(count),
    ):
        yield count
