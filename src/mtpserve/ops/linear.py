"""y = x W^T with W kept in its GGUF block format, with llama.cpp's CPU numerics.

llama.cpp does not multiply float activations by dequantized weights: it first rounds each activation
row to the weight type's "vec_dot type" and takes integer dot products per block
(../shared/spec/gguf-quant-formats.md §5):

* Q4_0, Q5_0, Q8_0, IQ4_NL weights: x -> Q8_0 (32-blocks, scale d rounded to f16);
* Q4_1, Q5_1: x -> Q8_1, whose block also carries s = f16(d * sum(q)); the weight's min m multiplies
  that rounded s, not the exact block sum;
* K-quants and IQ4_XS: x -> Q8_K (256-blocks, f32 scale);
* F16 / BF16 weights: x rounded to f16 / bf16.

Real trained models are sensitive to these 8-bit roundings (SmolLM2 logits move by ~0.2 nats), so
matching llama.cpp's tokens needs the same activation rounding. `linear_reference` reproduces it in plain
PyTorch (dequantize, quantize the activations, float matmul): the test oracle. `linear` is the fast path,
chosen once: the CPU kernel library when it builds, else the reference.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from functools import cache

import torch

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from ..quant.types import GGMLType
from .activation_rounding import (
    Q8_0_ACTIVATIONS,
    Q8_1_ACTIVATIONS,
    Q8_K_ACTIVATIONS,
    quantize_activations_q8_0,
    quantize_activations_q8_1,
    quantize_activations_q8_k,
)
from .collective import GatheredQTensor, ReducedQTensor
from .device import gpu_path
from .linear_gpu import QuantizedRows, linear_gpu, linear_many_gpu, merge_rows
from .quant_gemv import q8_1_product


def linear_reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for weight [N, K], with llama.cpp's activation rounding (a tensor-parallel share's
    product completed over the ranks, as `linear` does)."""
    if isinstance(weight, (ReducedQTensor, GatheredQTensor)):
        y = exchanged(weight, linear_reference(x, weight.local()))
        return y if bias is None else y + bias
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).float()
    t = weight.ggml_type
    if t in Q8_0_ACTIVATIONS:
        q, _, d16 = quantize_activations_q8_0(x2)
        y = (q * d16[..., None]).reshape(x2.shape) @ weight.dequantize().T
    elif t in Q8_1_ACTIVATIONS:
        y = _linear_q8_1(x2, weight)
    elif t in Q8_K_ACTIVATIONS:
        q, d = quantize_activations_q8_k(x2)
        y = (q * d[..., None]).reshape(x2.shape) @ weight.dequantize().T
    elif t == GGMLType.F16:
        y = x2.half().float() @ weight.dequantize().T
    elif t == GGMLType.BF16:
        y = x2.bfloat16().float() @ weight.dequantize().T
    else:
        y = x2 @ weight.dequantize().T
    y = y.reshape(*lead, -1)
    return y if bias is None else y + bias


def _linear_q8_1(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """Q4_1/Q5_1 weights (w = d_w * q_w + m_w per 32-block) against Q8_1 activations:
    y = sum_b d_w * d_x16 * (q_w . q_x) + m_w * f16(d_x * sum(q_x))."""
    return q8_1_product(*quantize_activations_q8_1(x), weight)


@cache
def _kernel_type(ggml_type: GGMLType) -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.mtp_matmul_supported(int(ggml_type)))


SPLIT = (ReducedQTensor, GatheredQTensor)  # tensor-parallel shares: products the ranks complete


def exchanged(weight: ReducedQTensor | GatheredQTensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's product with its share of `weight`, completed: the ranks' partial sums added, or their rows of
    the output gathered (ops.collective)."""
    if isinstance(weight, ReducedQTensor):
        return weight.group.all_reduce(y)
    return weight.group.all_gather(y, weight.widths)


def kernel_supports(weight: QTensor, split: bool = False) -> bool:
    """Whether the C kernel library is loaded and multiplies this weight: its type, stored whole (not split by
    a tensor-parallel share whose product the ranks complete; with `split`, also such a one, which `linear`
    multiplies and completes). Fused kernels that would add to a product ask without `split`."""
    return _kernel_type(weight.ggml_type) and (split or not isinstance(weight, SPLIT))


def keep_packed_tiles(weight: QTensor) -> QTensor:
    """llama.cpp's weight repacking, for a matrix on the CPU: the kernels pack its GEMM tiles on the first tiled
    call (several sequences decoding together, a verification, a prompt) and keep them while its bytes live,
    within a limit (`cpu_kernels.tile_limit`); the results are those of tiles packed per call. Returns `weight`."""
    data = weight.data
    if data.device.type != "cpu" or len(weight.shape) != 2 or not data.numel():
        return weight
    key = (data.data_ptr(), int(weight.ggml_type), weight.shape[0], weight.shape[1])
    if cpu_kernels.keep_tiles(*key):
        weakref.finalize(data, cpu_kernels.forget_tiles, *key)  # the tiles go before the bytes they were made of
    return weight


class WeightGroup(tuple):
    """Weights that read the same input (q/k/v, gate/up, a DeltaNet layer's projections), as a tuple,
    with the ctypes arrays the kernel call needs built once. Models build their groups at load time;
    `linear_many` also takes a plain sequence (and then builds the arrays per call)."""

    def __new__(cls, weights: Sequence[QTensor]) -> WeightGroup:
        group = super().__new__(cls, weights)
        n = len(group)
        group.c_types = (ctypes.c_int * n)(*(int(w.ggml_type) for w in group))
        group.c_data = (ctypes.c_void_p * n)(*(w.data.data_ptr() for w in group))
        group.c_rows = (ctypes.c_int64 * n)(*(w.shape[0] for w in group))
        group.on_kernels = all(kernel_supports(w) for w in group)
        group._merged = None
        if all(w.data.is_cuda for w in group):  # before any graph capture: merging allocates
            group.merged()
        return group

    def merged(self) -> list[tuple[QTensor, list[int]]]:
        """The GPU path's launches for the group: same-type members concatenated by rows (`merge_rows`: the
        members then view the concatenation), once."""
        if self._merged is None:
            self._merged = merge_rows(self)
            self.c_data = (ctypes.c_void_p * len(self))(*(w.data.data_ptr() for w in self))  # the new views
        return self._merged


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as a contiguous float32 [rows, K] (x itself when it already is one: decode calls this per block)."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()


def linear_many(
    x: torch.Tensor | QuantizedRows, weights: Sequence[QTensor], seq_len: int | None = None
) -> list[torch.Tensor]:
    """[linear(x, w, seq_len=seq_len) for w in weights], in one kernel call: one activation rounding and
    one parallel region for all of them (on the GPU path: ops.linear_gpu, one launch per weight type of a group)."""
    if any(isinstance(w, SPLIT) for w in weights):
        return [linear(x, w, seq_len=seq_len) for w in weights]
    if isinstance(x, QuantizedRows) or gpu_path(x):
        return linear_many_gpu(x, weights)
    lib = cpu_kernels.load()
    group = weights if isinstance(weights, WeightGroup) else WeightGroup(weights)
    if lib is None or not group.on_kernels:
        return [linear(x, w) for w in group]
    lead, x2 = x.shape[:-1], as_rows(x)
    M, K = x2.shape
    outs = [torch.empty(M, w.shape[0]) for w in group]
    ys = (ctypes.c_void_p * len(group))(*(y.data_ptr() for y in outs))
    rc = lib.mtp_matmul_many(
        len(group),
        group.c_types,
        group.c_data,
        group.c_rows,
        K,
        x2.data_ptr(),
        M,
        seq_len or max(M, 1),
        ys,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"mtp_matmul_many failed ({rc}) for {[w.name for w in group]}")
    return [y.view(*lead, y.shape[-1]) for y in outs]


def linear(
    x: torch.Tensor | QuantizedRows, weight: QTensor, bias: torch.Tensor | None = None, seq_len: int | None = None
) -> torch.Tensor:
    """`linear_reference`'s result from the C kernel library (same rounding rules, integer block dots);
    types the library lacks, or machines without it, take the reference.

    `seq_len`: the rows of x are sequences of seq_len tokens each (default: all rows one sequence).
    llama.cpp's float association depends on the batch size, so each sequence is rounded as if it were
    evaluated alone: batching sequences together changes no result.

    On the GPU path (ops.device): `linear_gpu`, the activations rounded as here once (or already, as the
    `QuantizedRows` a fused norm made), integer GEMVs for decode, summed in float32 in the kernels' order.

    A tensor-parallel share (ops.collective, --split-mode row): this rank's product, then the ranks' partial sums
    added (`ReducedQTensor`) or their rows of the output gathered (`GatheredQTensor`)."""
    if isinstance(weight, (ReducedQTensor, GatheredQTensor)):
        y = exchanged(weight, linear(x, weight.local(), seq_len=seq_len))
        return y if bias is None else y + bias
    if isinstance(x, QuantizedRows) or gpu_path(x):
        y = linear_gpu(x, weight)
        return y if bias is None else y + bias
    lib = cpu_kernels.load()
    if lib is None or not kernel_supports(weight):
        return linear_reference(x, weight, bias)
    lead, x2 = x.shape[:-1], as_rows(x)
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N)
    rc = lib.mtp_matmul(
        int(weight.ggml_type),
        weight.data.data_ptr(),
        N,
        K,
        x2.data_ptr(),
        M,
        seq_len or max(M, 1),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"mtp_matmul failed ({rc}) for {weight.name}")
    y = y.view(*lead, N)
    return y if bias is None else y + bias
