"""The gated FFN activations: SwiGLU (Llama, Qwen) and GeGLU with tanh-approximated GELU (Gemma).

`swiglu` and `geglu` run on the C kernels with llama.cpp's CPU numerics (SiLU's exp is the vector
algorithm llama.cpp uses; GELU is looked up by the f16 rounding of the input), bit-identical to it; the
`*_reference` functions are the PyTorch twins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from .decode_program import FFNBlock, ptr
from .device import gpu_path
from .linear import SPLIT, WeightGroup, as_rows, kernel_supports, linear, linear_many, linear_reference
from .linear_gpu import QuantizedRows, decode_format, linear_gpu, matmul_input
from .norm import rms_norm, rms_norm_for
from .rowwise import glu_quantize


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
    getattr(lib, lib_fn)(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
    return out


def swiglu_ffn_reference(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor) -> torch.Tensor:
    """The SwiGLU feed-forward network, down(silu(gate(x)) * up(x)), in plain PyTorch."""
    return linear_reference(swiglu_reference(linear_reference(x, gate), linear_reference(x, up)), down)


def gated_ffn_gpu(
    x: torch.Tensor | QuantizedRows,
    gate_up: Sequence[QTensor],
    down: QTensor,
    act: str,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) on the GPU path, plus `residual` when given: gate and up in one GEMV launch (a
    merged WeightGroup), the activation product and the down projection's input quantization in one more
    (ops.rowwise.glu_quantize), the down GEMV with the residual add in its epilogue; act "silu" (SwiGLU) or
    "gelu_f16" (Gemma's GeGLU as llama.cpp's CPU computes it)."""
    gate, up = linear_many(x, gate_up)
    rows = gate.shape[:-1].numel()
    fmt = decode_format(down, rows)
    y, q, d = glu_quantize(gate.reshape(rows, -1), up.reshape(rows, -1), act, fmt=fmt)
    h = matmul_input(y.reshape(*gate.shape), fmt, q, d)
    if residual is not None and not isinstance(down, SPLIT):
        return linear_gpu(h, down, add=residual)
    out = linear(h, down)
    return out if residual is None else residual + out


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) on the CPU, the sigmoid as llama.cpp's: 1 / (1 + expf(-gate)) with libm's expf (the C
    kernel; torch.sigmoid can differ in the last bit). `sigmoid_gate_reference` is the twin."""
    lib = cpu_kernels.load()
    if lib is None or gpu_path(x):
        return sigmoid_gate_reference(x, gate)
    x, gate = x.float().contiguous(), gate.float().contiguous()
    y = torch.empty_like(x)
    lib.mtp_sigmoid_gate(x.data_ptr(), gate.data_ptr(), y.data_ptr(), x.numel())
    return y


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def sigmoid_gate_for(x: torch.Tensor, gate: torch.Tensor, *, matmul: QTensor) -> torch.Tensor | QuantizedRows:
    """x * sigmoid(gate) as the input of a matmul by `matmul` (Qwen3.5's gated attention output): on the GPU path
    one launch that also quantizes decode rows for that weight's integer GEMV. gate has x's shape, or is [T, H, D]
    for x [T, H * D]: heads at their own stride (the gate halves of the query GEMV's output), read in place."""
    if not gpu_path(x):
        return sigmoid_gate(x, gate.reshape(x.shape))
    lead, k = x.shape[:-1], x.shape[-1]
    rows = lead.numel()
    fmt = decode_format(matmul, rows)
    shape = (rows, -1, gate.shape[-1]) if gate.dim() > x.dim() else (rows, k)
    y, q, d = glu_quantize(gate.reshape(shape), x.reshape(shape), "sigmoid", fmt=fmt)
    return matmul_input(y.reshape(*lead, k), fmt, q, d)


def geglu_ffn(
    x: torch.Tensor | QuantizedRows, gate_up: Sequence[QTensor], down: QTensor, seq_len: int | None = None
) -> torch.Tensor:
    """Gemma's GeGLU FFN, down(gelu(gate(x)) * up(x)): the C kernels' GELU on the CPU, `gated_ffn_gpu` on the GPU
    path."""
    if isinstance(x, QuantizedRows) or gpu_path(x):
        return gated_ffn_gpu(x, gate_up, down, "gelu_f16")
    return linear(geglu(*linear_many(x, gate_up, seq_len)), down, seq_len=seq_len)


class ResidualGatedFFN:
    """A pre-norm residual gated FFN, x + ffn(rms_norm(x) * norm_weight), ffn(h) = down(act(gate(h)) * up(h)) with
    act SiLU (SwiGLU: Llama, Qwen) or tanh-GELU (GeGLU: Gemma, whose FFN output is also rms-normed by `post_norm`
    before the add). One C call on the CPU (`mtp_residual_glu_ffn`), the composition of the ops elsewhere.

    Built once per layer with the call's constant arguments prepared: in a small model's decode step the Python
    around a kernel call (checks, conversions) costs as much as the call's arithmetic."""

    def __init__(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up: WeightGroup,
        down: QTensor,
        *,
        gelu: bool = False,
        post_norm: torch.Tensor | None = None,
    ) -> None:
        self.norm_weight, self.eps, self.gate_up, self.down = norm_weight, eps, gate_up, down
        self.gelu, self.post_norm = gelu, post_norm
        gate, up = gate_up
        self._c_args: tuple | None = None  # all but the rows, the output and the thread count
        if cpu_kernels.load() is not None and gate_up.on_kernels and kernel_supports(down):
            self._c_args = (
                norm_weight.data_ptr(), eps, int(gelu), int(gate.ggml_type), gate.data.data_ptr(),
                int(up.ggml_type), up.data.data_ptr(), gate.shape[0], int(down.ggml_type), down.data.data_ptr(),
                None if post_norm is None else post_norm.data_ptr(),
            )  # fmt: skip

    def __call__(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if self._c_args is None or gpu_path(x):
            return self.composed(x, seq_len)
        x2 = as_rows(x)
        M, E = x2.shape
        y = torch.empty(M, E)
        rc = cpu_kernels.load().mtp_residual_glu_ffn(
            x2.data_ptr(), M, seq_len or max(M, 1), E, *self._c_args, y.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"mtp_residual_glu_ffn failed ({rc}) for {self.down.name}")
        return y if x2 is x else y.view(x.shape)

    def decode_block(self) -> FFNBlock | None:
        """This block in a CPU decode program (ops.decode_program), or None where the kernels lack its weights."""
        if self._c_args is None:
            return None
        gate, up = self.gate_up
        return FFNBlock(
            norm_w=self.norm_weight.data_ptr(), eps=self.eps, gelu=int(self.gelu), t_gate=int(gate.ggml_type),
            t_up=int(up.ggml_type), t_down=int(self.down.ggml_type), w_gate=gate.data.data_ptr(),
            w_up=up.data.data_ptr(), w_down=self.down.data.data_ptr(), F=gate.shape[0], post_w=ptr(self.post_norm),
        )  # fmt: skip

    def composed(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """The same block op by op (the GPU path, weights the kernels lack; the C call's test twin)."""
        h = rms_norm_for(x, self.norm_weight, self.eps, matmul=self.gate_up[0])
        if self.post_norm is None and (isinstance(h, QuantizedRows) or gpu_path(x)):  # the add in the down GEMV
            return gated_ffn_gpu(h, self.gate_up, self.down, "gelu_f16" if self.gelu else "silu", residual=x)
        if self.gelu:
            out = geglu_ffn(h, self.gate_up, self.down, seq_len)
        else:
            out = swiglu_ffn(h, *self.gate_up, self.down, seq_len, gate_up=self.gate_up)
        return x + (out if self.post_norm is None else rms_norm(out, self.post_norm, self.eps))


def swiglu_ffn(
    x: torch.Tensor | QuantizedRows,
    gate: QTensor,
    up: QTensor,
    down: QTensor,
    seq_len: int | None = None,
    *,
    gate_up: Sequence[QTensor] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SwiGLU FFN in one kernel call: bit-identical to `linear(swiglu(gate(x), up(x)), down)` on the
    kernels (it runs the same ones), without the three round trips through Python. `seq_len` as in `linear`.
    `gate_up`: (gate, up) as the model's WeightGroup, which the GPU path multiplies in one launch. With
    `residual`: residual + the FFN (on the GPU path added inside the down projection's launch)."""
    if isinstance(x, QuantizedRows) or gpu_path(x):
        return gated_ffn_gpu(x, gate_up or (gate, up), down, "silu", residual=residual)
    out = _swiglu_ffn_cpu(x, gate, up, down, seq_len)
    return out if residual is None else residual + out


def _swiglu_ffn_cpu(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, seq_len: int | None) -> torch.Tensor:
    lib = cpu_kernels.load()
    if lib is None or not all(kernel_supports(w) for w in (gate, up, down)):
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
