"""Rotary position embeddings: NeoX (half-split) or normal (adjacent) pairs, partial rotation
(`n_rot < head_dim`), linear frequency scaling, and the interleaved multi-section variant (IMROPE) of
qwen35.

Angles follow llama.cpp's rope cache: theta of pair i is `p * s^i` accumulated by one float32
multiplication per pair, s = base^(-2/n_rot). `rope_cos_sin`/`apply_rope` run on the C kernels (libm's
cosf/sinf/powf and one fused multiply-add per output, bit-identical to llama.cpp's CPU rope);
`rope_cos_sin_reference`/`apply_rope_reference` are the PyTorch twins, equal to within an ulp.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..kernels import cpu as cpu_kernels
from ..quant.planar import block_rows
from ..quant.types import GGMLType
from .device import canonical_device, gpu_path
from .quant_gemv import triton_for_rows, triton_kernels
from .rowwise import rms_norm_quantize_reference


def imrope_streams(sections: Sequence[int], n_pairs: int) -> list[int]:
    """Which of the 4 position streams (t, h, w, e) each rotated pair uses under IMROPE."""
    total = sum(sections)
    streams = []
    for i in range(n_pairs):
        sector = i % total
        if sector % 3 == 1 and sector < 3 * sections[1]:
            streams.append(1)
        elif sector % 3 == 2 and sector < 3 * sections[2]:
            streams.append(2)
        elif sector % 3 == 0 and sector < 3 * sections[0]:
            streams.append(0)
        else:
            streams.append(3)
    return streams


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """[T] token positions -> [T, 4] multi-section positions of plain text: t = h = w = p, e = 0."""
    p = positions.to(torch.float32)
    return torch.stack((p, p, p, torch.zeros_like(p)), dim=-1)


def _thetas(start: torch.Tensor, theta_scale: float, n_pairs: int) -> torch.Tensor:
    """[T] -> [T, n_pairs]: column i is ((start * s) * s ...) with i float32 multiplications (a loop:
    torch.cumprod accumulates float32 in float64)."""
    columns = [start.to(torch.float32)]
    scale = torch.tensor(theta_scale, dtype=torch.float32)
    for _ in range(n_pairs - 1):
        columns.append(columns[-1] * scale)
    return torch.stack(columns, dim=-1)


def rope_cos_sin_reference(
    positions: torch.Tensor,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    sections: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [T, n_rot // 2], for positions [T] (or [T, 4] streams when `sections` is given)."""
    n_pairs = n_rot // 2
    theta_scale = float(np.float32(float(np.float32(base)) ** (-2.0 / float(np.float32(n_rot)))))
    if sections is None:
        theta = _thetas(positions.to(torch.float32), theta_scale, n_pairs)
    else:
        streams = positions if positions.dim() == 2 else text_positions(positions)
        per_stream = torch.stack([_thetas(streams[:, k], theta_scale, n_pairs) for k in range(4)])  # [4, T, n_pairs]
        theta = per_stream[imrope_streams(sections, n_pairs), :, torch.arange(n_pairs)].T
    theta = theta * freq_scale
    return torch.cos(theta), torch.sin(theta)


def rope_cos_sin(
    positions: torch.Tensor,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    sections: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = cpu_kernels.load()
    if lib is None:
        return rope_cos_sin_reference(positions, n_rot, base, freq_scale, sections)
    n_pairs = n_rot // 2
    if sections is None:
        start, stream = positions.to(torch.float32).contiguous(), None
    else:
        start = (positions if positions.dim() == 2 else text_positions(positions)).to(torch.float32).contiguous()
        stream = torch.tensor(imrope_streams(sections, n_pairs), dtype=torch.int32)
    T = positions.shape[0]
    cos, sin = torch.empty(T, n_pairs), torch.empty(T, n_pairs)
    lib.mtp_rope_cache(
        start.data_ptr(),
        None if stream is None else stream.data_ptr(),
        T,
        n_rot,
        base,
        freq_scale,
        cos.data_ptr(),
        sin.data_ptr(),
    )
    return cos, sin


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate the first n_rot = 2 * cos.shape[-1] dims of x [T, H, D]; cos/sin [T, n_rot // 2]."""
    n_rot = 2 * cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        rotated = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    lib = cpu_kernels.load()
    if lib is None or gpu_path(x):
        return apply_rope_reference(x, cos, sin, neox)
    out = x.float().contiguous().clone()
    T, H, D = out.shape
    lib.mtp_rope_apply(out.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H, D, 2 * cos.shape[-1], int(neox))
    return out


def norm_rope_store_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cells: torch.Tensor,
    positions: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    k_type: int,
    v_type: int,
    cell_positions: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    neox: bool = True,
    planar: bool = False,
) -> torch.Tensor:
    """The twin of the Triton kernel (mtpserve.kernels.triton.rope_kv.norm_rope_store): q [T, H, D] and k [T, Hkv, D]
    normalized per head (the GPU path's RMSNorm; None: not normalized) and rotated; k and v stored at `cells` of the
    caches as their types store them (`block_rows`: q8_0 reordered planar with `planar`), `positions` into
    `cell_positions` there. Returns q, float32."""
    q = q.float() if q_norm is None else rms_norm_quantize_reference(q, q_norm, eps)[1]  # per head: the last dim
    k = k.float() if k_norm is None else rms_norm_quantize_reference(k, k_norm, eps)[1]
    q, k = apply_rope_reference(q, cos, sin, neox), apply_rope_reference(k, cos, sin, neox)
    for store, ggml_type, values in ((k_store, k_type, k), (v_store, v_type, v.float())):
        if store.dtype == torch.uint8:
            values = block_rows(values, GGMLType(int(ggml_type)), planar)
        store.index_copy_(0, cells, values.reshape(len(cells), *store.shape[1:]).to(store.dtype))
    cell_positions.index_copy_(0, cells, positions.to(cell_positions.dtype))
    return q


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cells: torch.Tensor,
    positions: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    k_type: int,
    v_type: int,
    cell_positions: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    neox: bool = True,
    planar: bool = False,
) -> torch.Tensor:
    """An attention layer's input on the GPU path in one launch: `norm_rope_store_reference`'s result by the Triton
    kernel where it runs (a CUDA tensor, or the interpreter) and takes both cache types, else by the twin."""
    args = (q, k, v, cos, sin, cells, positions, k_store, v_store, int(k_type), int(v_type), cell_positions)
    kernels = triton_kernels()
    takes = kernels is not None and {int(k_type), int(v_type)} <= set(map(int, kernels.ROPE_KV_TYPES))
    if takes and triton_for_rows(q, q.shape[0]):
        return kernels.norm_rope_store(*args, q_norm=q_norm, k_norm=k_norm, eps=eps, neox=neox, planar=planar)
    return norm_rope_store_reference(*args, q_norm=q_norm, k_norm=k_norm, eps=eps, neox=neox, planar=planar)


class RopeTable:
    """cos/sin of text positions 0, 1, 2, ... computed once and grown on demand: a position's angles do
    not depend on the batch it comes in, so the table gives exactly what `rope_cos_sin` would.

    Captured CUDA graphs read the table by address (`gather` in a static step). Once `reserve` or `gather` has
    run, a growth therefore keeps the tables it replaces alive (`retired`): a graph captured before reads the
    same values from the same memory, within the positions reserved for it. Reserving the largest context up
    front (`reserve` at a state's creation) leaves nothing to grow."""

    def __init__(
        self,
        n_rot: int,
        base: float,
        freq_scale: float = 1.0,
        sections: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.args = (n_rot, base, freq_scale, sections)
        self.device = canonical_device(device)
        self.cos = self.sin = torch.empty(0, n_rot // 2, device=self.device)
        self.copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # the table on other devices
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # replaced tables a captured step may read
        self.pinned = False  # a captured step may hold the table's addresses

    def span(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, n_rot // 2] of positions start..start + count - 1 (views into the table, on the
        table's device: computed on the CPU, moved once per growth)."""
        end = start + count
        if end > len(self.cos):
            size = max(end, 2 * len(self.cos), 256)
            cos, sin = rope_cos_sin(torch.arange(size), *self.args)
            if self.pinned:
                self.retired += [(self.cos, self.sin), *self.copies.values()]
            self.cos, self.sin = cos.to(self.device), sin.to(self.device)
            self.copies = {}
        return self.cos[start:end], self.sin[start:end]

    def reserve(self, count: int, device: torch.device | None = None) -> None:
        """Grow the table to `count` positions now (a captured step gathers from it and must not grow it), and
        with `device` keep a copy there (a captured step of a layer split's other GPU gathers from that)."""
        if count > len(self.cos):
            self.span(0, count)
        self.pinned = True
        if device is not None and canonical_device(device) != self.device:
            device = canonical_device(device)
            held = self.copies.get(device)
            if held is None or len(held[0]) != len(self.cos):
                self.copies[device] = (self.cos.to(device), self.sin.to(device))

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of arbitrary positions given as a device tensor (within the reserved table), from the copy on
        the positions' device."""
        self.pinned = True
        cos, sin = (self.cos, self.sin) if positions.device == self.device else self.copies[positions.device]
        return cos[positions], sin[positions]
