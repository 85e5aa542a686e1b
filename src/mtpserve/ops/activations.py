"""The gated FFN activations: SwiGLU (Llama, Qwen) and GeGLU with tanh-approximated GELU (Gemma).

`swiglu` and `geglu` run on the C kernels with llama.cpp's CPU numerics (SiLU's exp is the vector
algorithm llama.cpp uses; GELU is looked up by the f16 rounding of the input), bit-identical to it; the
`*_reference` functions are the PyTorch twins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from .device import gpu_path
from .linear import as_rows, kernel_supports, linear, linear_many, linear_reference


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _elementwise(lib_fn="mtp_swiglu", reference=swiglu_reference, gate=gate, up=up)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up with llama.cpp's CPU GELU: a table over the f16 rounding of the input (so within
    f16 precision of `geglu_reference`). The GPU path computes the same table entries on the fly."""
    if gpu_path(gate):
        return geglu_f16_table(gate, up)
    return _elementwise(lib_fn="mtp_geglu", reference=geglu_reference, gate=gate, up=up)


def geglu_f16_table(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """llama.cpp's CPU GELU in torch: GELU of the f16-rounded input, rounded to f16; 0 at or below -10 and
    the identity at or above 10 (the C kernel's table, without the table)."""
    gate, up = gate.float(), up.float()
    table = F.gelu(gate.half().float(), approximate="tanh").half().float()
    gelu = torch.where(gate <= -10.0, torch.zeros_like(gate), torch.where(gate >= 10.0, gate, table))
    return gelu * up


def _elementwise(lib_fn: str, reference, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    lib = cpu_kernels.load()
    if lib is None or gpu_path(gate):
        return reference(gate, up)
    gate, up = gate.float().contiguous(), up.float().contiguous()
    out = torch.empty_like(gate)
    getattr(lib, lib_fn)(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def swiglu_ffn_reference(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    """The SwiGLU feed-forward network, down(silu(gate(x)) * up(x)), in plain PyTorch."""
    return linear_reference(swiglu_reference(linear_reference(x, gate), linear_reference(x, up)), down)


def swiglu_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, seq_len: int | None = None) -> torch.Tensor:
    """The SwiGLU FFN in one kernel call: bit-identical to `linear(swiglu(gate(x), up(x)), down)` on the
    kernels (it runs the same ones), without the three round trips through Python. `seq_len` as in `linear`."""
    lib = cpu_kernels.load()
    if lib is None or gpu_path(x) or not all(kernel_supports(w) for w in (gate, up, down)):
        return linear(swiglu(*linear_many(x, (gate, up), seq_len)), down, seq_len=seq_len)
    lead, x2 = x.shape[:-1], as_rows(x)
    M, E = x2.shape
    out = torch.empty(M, down.shape[0])
    rc = lib.mtp_swiglu_ffn(
        x2.data_ptr(),
        M,
        seq_len or max(M, 1),
        E,
        int(gate.ggml_type),
        gate.data.data_ptr(),
        int(up.ggml_type),
        up.data.data_ptr(),
        gate.shape[0],
        int(down.ggml_type),
        down.data.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"mtp_swiglu_ffn failed ({rc}) for {down.name}")
    return out.view(*lead, -1)
