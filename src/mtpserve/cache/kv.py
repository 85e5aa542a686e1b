"""One attention layer's K/V cache for one sequence, stored as f32/f16/bf16 or block-quantized
(q8_0, q4_0) rows, as llama.cpp stores them (K after norm and RoPE, V raw; blocks of 32 along the head
dimension, so a block never crosses a head)."""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Any

import torch

from ..ops.attention import (
    attention,
    attention_gpu,
    decode_attention_gpu,
    prompt_attention_dtype,
    residual_attention_cpu,
    round_q8_0,
)
from ..ops.decode_program import AttentionBlock, ptr
from ..ops.device import gpu_device, gpu_path
from ..ops.linear import WeightGroup, kernel_supports
from ..ops.norm import rms_norm
from ..ops.rope import apply_rope, norm_rope_store
from ..quant.dequant import dequantize
from ..quant.planar import block_rows, dequantize_planar, from_planar, to_planar
from ..quant.qtensor import QTensor
from ..quant.quantize import QUANTIZERS
from ..quant.types import GGMLType, block_geometry, parse_cache_type

DECODE_MAX_QUERIES = 16  # GPU path: up to this many query rows read the cache as stored (decode kernel)
_FLOAT_TYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


LAZY_BYTES = 64 << 20  # host stores at least this large are committed page by page as they are written


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros; in host memory, a large store is an anonymous mapping, which reads as zeros and takes memory
    page by page as it is written. A 262144-token cache so costs what the context holds, not its capacity, and
    the memory-mapped weights keep the rest as page cache (llama.cpp clears its cache buffers: all committed)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping


class _Rows:
    """A [capacity, n_heads, dim] store in one GGML type; reads come back as float32. On the GPU path a q8_0 store is
    `planar` (each head row's scales, then its quants: mtpserve.quant.planar), which its kernels read 16 bytes at a
    time; `portable` / `from_portable` convert rows to and from GGUF blocks for files."""

    def __init__(
        self, capacity: int, n_heads: int, dim: int, ggml_type: GGMLType, device: torch.device | str = "cpu"
    ) -> None:
        self.n_heads, self.dim, self.type = n_heads, dim, ggml_type
        self.planar = ggml_type == GGMLType.Q8_0 and gpu_device(device)
        if ggml_type in _FLOAT_TYPES:
            self.data = zeros((capacity, n_heads, dim), _FLOAT_TYPES[ggml_type], device)
        elif ggml_type in QUANTIZERS:
            block_size, type_size = block_geometry(ggml_type)
            if dim % block_size:
                raise ValueError(f"head dim {dim} is not a multiple of the {ggml_type.name} block size {block_size}")
            self.data = zeros((capacity, n_heads * dim // block_size * type_size), torch.uint8, device)
        else:
            raise ValueError(f"cache type {ggml_type.name} is not supported (use f32, f16, bf16, q8_0 or q4_0)")

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Values [T, n_heads, dim] as this store holds them: float rows as they are, blocks as uint8 rows."""
        return values if self.type in _FLOAT_TYPES else block_rows(values, self.type, self.planar)

    def portable(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as GGUF blocks (what a file holds, whatever the device)."""
        return from_planar(rows, self.n_heads) if self.planar else rows

    def from_portable(self, rows: torch.Tensor) -> torch.Tensor:
        """`portable`'s inverse."""
        return to_planar(rows, self.n_heads) if self.planar else rows

    def write(self, index: torch.Tensor | slice, values: torch.Tensor) -> None:
        values = self.encode(values)
        if isinstance(index, slice):
            self.data[index].copy_(values.view(self.data[index].shape))  # converts to the storage dtype
        else:
            self.data[index] = values.to(self.data.dtype)

    def read(self, index: torch.Tensor | slice, dtype: torch.dtype | None = None) -> torch.Tensor:
        """f16 rows as stored (attention reads f16 directly), every other type as float32; or all as `dtype`
        (blocks dequantized in float32 and rounded once, straight into it)."""
        rows = self.data[index]
        if self.type in _FLOAT_TYPES:
            return rows.to(dtype or (rows.dtype if self.type == GGMLType.F16 else torch.float32))
        if self.planar:
            return dequantize_planar(rows, (rows.shape[0], self.n_heads, self.dim), dtype=dtype or torch.float32)
        return dequantize(rows, self.type, (rows.shape[0], self.n_heads, self.dim), dtype=dtype or torch.float32)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class KVPool:
    """--kv-unified: one attention layer's K/V cells, shared by several sequences (each a `KVCache` over it)."""

    def __init__(
        self,
        n_cells: int,
        n_kv_heads: int,
        k_dim: int,
        v_dim: int,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_cells, self.device = n_cells, torch.device(device)
        self.k = _Rows(n_cells, n_kv_heads, k_dim, parse_cache_type(cache_type_k), self.device)
        self.v = _Rows(n_cells, n_kv_heads, v_dim, parse_cache_type(cache_type_v), self.device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class CellTable:
    """Which cells of the pools hold one sequence's positions (--kv-unified): the blocks of `block` cells it was
    given, in position order, so position p sits in cell blocks[p // block] * block + p % block. All of the
    sequence's attention layers share it (their pools are laid out alike); whoever owns the pools hands the
    blocks out (engine.slots). `rows_on(device)` maps every position to its cell (-1 past the blocks held) as a
    tensor that is updated in place, so a captured step can index by it."""

    def __init__(self, capacity: int, block: int) -> None:
        self.capacity, self.block = capacity, block
        self.blocks: list[int] = []
        self._rows: dict[torch.device, torch.Tensor] = {}

    @property
    def n_cells(self) -> int:
        """Positions the blocks held cover."""
        return len(self.blocks) * self.block

    def add_block(self, block: int) -> None:
        start = self.n_cells
        self.blocks.append(block)
        for rows in self._rows.values():
            rows[start : start + self.block] = torch.arange(block * self.block, (block + 1) * self.block)

    def trim(self, n_blocks: int) -> list[int]:
        """Keep the first `n_blocks` blocks; the others are returned."""
        freed, self.blocks = self.blocks[n_blocks:], self.blocks[:n_blocks]
        for rows in self._rows.values():
            rows[self.n_cells :] = -1
        return freed

    def rows_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._rows:
            rows = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
            for i, block in enumerate(self.blocks):
                rows[i * self.block : (i + 1) * self.block] = torch.arange(block * self.block, (block + 1) * self.block)
            self._rows[device] = rows
        return self._rows[device]


class KVCache:
    """Cells hold the K/V of one position each: cell i holds position i up to `capacity`. With `ring`, a
    sliding-window cache reuses cells once their position has left the `window`, so it needs only
    window + (largest batch) cells for any context length. Over a shared `pool` (--kv-unified) a position's cell
    is the one `table` gives, and `positions` covers every cell of the pool (-1 for cells that are not this
    sequence's): attention over the pool then sees exactly this sequence's keys."""

    def __init__(
        self,
        capacity: int,
        n_kv_heads: int,
        k_dim: int,
        v_dim: int,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        *,
        window: int | None = None,
        ring: bool = False,
        device: torch.device | str = "cpu",
        pool: KVPool | None = None,
        table: CellTable | None = None,
    ) -> None:
        if ring and window is None:
            raise ValueError("a ring KV cache needs a sliding window")
        if (pool is None) != (table is None) or (pool is not None and ring):
            raise ValueError("a cache over a shared pool needs its cell table, and cannot be a ring")
        self.capacity, self.window, self.ring = capacity, window, ring
        self.pool, self.table = pool, table
        if pool is not None:
            self.device, self.k, self.v = pool.device, pool.k, pool.v
        else:
            self.device = torch.device(device)
            self.k = _Rows(capacity, n_kv_heads, k_dim, parse_cache_type(cache_type_k), self.device)
            self.v = _Rows(capacity, n_kv_heads, v_dim, parse_cache_type(cache_type_v), self.device)
        n_cells = pool.n_cells if pool is not None else capacity
        self.positions = torch.full((n_cells,), -1, dtype=torch.long, device=self.device)  # -1: empty, or not ours
        self.length = 0  # positions 0..length-1 have been written
        self.refill_at = 0  # a ring's cells a rollback emptied are written again once length reaches this

    def _cells(self, start: int, end: int) -> torch.Tensor | slice:
        """The cells of positions start..end-1, in position order."""
        if self.table is not None:
            if end > self.table.n_cells:
                raise ValueError(f"no KV cells reserved for position {end - 1} ({self.table.n_cells} held)")
            return self.table.rows_on(self.device)[start:end]
        if self.ring:
            return torch.arange(start, end, device=self.device) % self.capacity
        return slice(start, end)

    def _check_room(self, n: int) -> None:
        """Raise unless positions length..length+n-1 can be written."""
        end = self.length + n
        if not self.ring and end > self.capacity:
            raise ValueError(f"KV cache is full: {end} positions > capacity {self.capacity}")
        if self.ring and n > self.capacity - self.window + 1:
            raise ValueError(f"batch of {n} tokens does not fit a ring of {self.capacity} cells (window {self.window})")
        if self.table is not None and end > self.table.n_cells:
            raise ValueError(f"no KV cells reserved for position {end - 1} ({self.table.n_cells} held)")

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V [T, Hkv, D] of positions length..length+T-1."""
        n = k.shape[0]
        start, end = self.length, self.length + n
        self._check_room(n)
        cells = self._cells(start, end)
        self.k.write(cells, k)
        self.v.write(cells, v)
        if isinstance(cells, slice):
            self.positions[cells].copy_(torch.arange(start, end))
        else:
            self.positions[cells] = torch.arange(start, end, device=self.device)
        self.length = end

    def read(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K [S, Hkv, D], V [S, Hkv, Dv], positions [S]) of every filled cell (f16 caches as float16,
        others as float32; or both as `dtype`)."""
        cells = (self.positions >= 0).nonzero().squeeze(1) if self.ring else self._cells(0, self.length)
        return self.k.read(cells, dtype), self.v.read(cells, dtype), self.positions[cells]

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of queries q [T, H, D] at q_pos over every cached position (causal, windowed).

        As llama.cpp, the query is first rounded to the K cache's dot type: block-quantized keys are
        multiplied by a Q8_0-rounded query, bf16 keys by a bf16 one (f16 keys: inside the kernel).

        On the GPU path (ops.device) the query stays float: a few rows (decode, verification) are read from the
        cache as stored by the Triton decode kernel, prompts go through dequantized rows and fused attention."""
        if gpu_path(q):
            if q.shape[0] <= DECODE_MAX_QUERIES:
                return self._attend_stored(q, q_pos, scale, slice(0, self.length) if self._ordered else slice(None))
            # Straight to the attention's half type: at 262144 cells a float32 copy of K and V would be 2 GB.
            keys, values, key_pos = self.read(prompt_attention_dtype(q.device))
            return attention_gpu(q, keys, values, q_pos, key_pos, scale, window=self.window, in_order=not self.ring)
        keys, values, key_pos = self.read()
        if self.k.type in QUANTIZERS:
            q = round_q8_0(q)
        elif self.k.type == GGMLType.BF16:
            q = q.bfloat16().float()
        return attention(q, keys, values, q_pos, key_pos, scale, window=self.window)

    def residual_attention(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        qkv: WeightGroup,
        wo: QTensor,
        n_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scale: float,
        **variant: Any,
    ) -> torch.Tensor | None:
        """x + the attention block of x's next T positions (norm, q/k/v, q/k norms, RoPE, `append`, `attend`, output
        projection; `variant`: `residual_attention_cpu`'s keywords) in one C call, where a few tokens of one sequence
        meet an f16/f32 cache on the CPU whose cell i holds position i (decode: each op alone costs more in Python
        than in arithmetic); None elsewhere, for the caller to go op by op. A ring qualifies until it wraps."""
        T = x.shape[0]
        in_order = self._ordered or (self.ring and self.length + T <= self.capacity)
        if T > 8 or not in_order or not self._fused_block_fits(qkv, wo) or x.dtype != torch.float32:
            return None
        self._check_room(T)
        store = (self.k.data, self.v.data, self.positions, self.length)
        y = residual_attention_cpu(
            x.contiguous(), norm_weight, eps, qkv, wo, n_heads, cos, sin, *store, scale, self.window, **variant
        )
        self.length += T
        return y

    def decode_block(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        qkv: WeightGroup,
        wo: QTensor,
        n_heads: int,
        scale: float,
        *,
        rope: int = 0,
        neox: bool,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        q_gated: bool = False,
        q_scale: float = 1.0,
        post_norm: torch.Tensor | None = None,
    ) -> AttentionBlock | None:
        """`residual_attention` for a step's tokens in a CPU decode program (ops.decode_program) over this cache,
        their RoPE rows from the program's table `rope`; None where the one call cannot serve this cache. A ring
        takes part while it has no empty cells among its passed positions (`DecodeProgram.ready`)."""
        if not (self._ordered or self.ring) or not self._fused_block_fits(qkv, wo):
            return None
        return AttentionBlock(
            norm_w=norm_weight.data_ptr(), eps=eps, qkv_types=ctypes.addressof(qkv.c_types),
            qkv_W=ctypes.addressof(qkv.c_data), H=n_heads, Hkv=self.k.n_heads, D=self.k.data.shape[-1],
            q_gated=int(q_gated), neox=int(neox), rope=rope, kv_f16=int(self.k.data.dtype == torch.float16),
            q_norm=ptr(q_norm), k_norm=ptr(k_norm), q_scale=q_scale, scale=scale, k_cache=self.k.data.data_ptr(),
            v_cache=self.v.data.data_ptr(), cell_pos=self.positions.data_ptr(), window=self.window or 0,
            t_out=int(wo.ggml_type), w_out=wo.data.data_ptr(), post_norm=ptr(post_norm),
            ring=self.capacity if self.ring else 0,
        )  # fmt: skip

    def _fused_block_fits(self, qkv: WeightGroup, wo: QTensor) -> bool:
        """Whether the one-call attention block (`residual_attention_cpu`) reads this cache and these weights."""
        float_cache = self.k.type == self.v.type and self.k.type in (GGMLType.F16, GGMLType.F32)
        return float_cache and not gpu_path(self.k.data) and qkv.on_kernels and kernel_supports(wo)

    def write_at(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V [T, Hkv, D] of `positions` (a device tensor) into their cells, without reading any value
        on the host (a CUDA graph replays this at whatever position the tensor holds). `length` is the caller's
        to advance."""
        cells = self._cells_at(positions)
        for rows, values in ((self.k, k), (self.v, v)):
            values = rows.encode(values)
            rows.data.index_copy_(0, cells, values.reshape(len(positions), *rows.data.shape[1:]).to(rows.data.dtype))
        self.positions.index_copy_(0, cells, positions)

    def _cells_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The cells of `positions` (a device tensor), computed on the device."""
        if self.table is not None:
            return self.table.rows_on(self.device)[positions]
        return positions % self.capacity if self.ring else positions

    def write_roped(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        static: bool,
        neox: bool = True,
    ) -> torch.Tensor:
        """The GPU path's attention input in one launch (ops.rope.norm_rope_store): q [T, H, D] and k [T, Hkv, D]
        normalized per head and rotated, k and v written into the cells of `positions` (a device tensor) -> q,
        float32.
        `static`: as `write_at` (the caller advances `length`); otherwise as `append` (positions length..)."""
        if not static:
            self._check_room(k.shape[0])
        q = norm_rope_store(
            q,
            k,
            v,
            cos,
            sin,
            self._cells_at(positions),
            positions,
            self.k.data,
            self.v.data,
            self.k.type,
            self.v.type,
            self.positions,
            q_norm=q_norm,
            k_norm=k_norm,
            eps=eps,
            neox=neox,
            planar=self._planar,
        )
        if not static:
            self.length += k.shape[0]
        return q

    def attend_static(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` for the GPU path's captured steps: every cell of the cache, the empty ones masked by position
        -1, so the kernel's shape does not change from token to token."""
        return self._attend_stored(q, q_pos, scale, slice(None))

    def _attend_stored(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float, cells: slice) -> torch.Tensor:
        """The GPU decode kernel over `cells` of the cache as stored (empty cells masked by position -1)."""
        return decode_attention_gpu(
            q,
            self.k.data[cells],
            self.v.data[cells],
            self.k.type,
            self.v.type,
            q_pos,
            self.positions[cells],
            n_kv_heads=self.k.n_heads,
            scale=scale,
            window=self.window,
            ordered=self._ordered,
            planar=self._planar,
        )

    @property
    def _planar(self) -> bool:
        """Whether a q8_0 K or V of this cache is stored planar (the GPU path's layout)."""
        return self.k.planar or self.v.planar

    @property
    def _ordered(self) -> bool:
        """Whether cell i holds position i (or nothing)."""
        return not self.ring and self.table is None

    def can_truncate(self, length: int) -> bool:
        """Whether `truncate(length)` leaves a usable cache: a ring may have overwritten positions the
        next token at `length` still attends to."""
        if length > self.length:
            return False
        if not self.ring or length == 0:
            return True
        needed = torch.arange(max(0, length - (self.window or length)), length, device=self.device)
        return bool((self.positions[needed % self.capacity] == needed).all())

    def truncate(self, length: int) -> None:
        """Forget positions >= length (a rejected draft, or a prompt that diverges from the cache)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.positions[self.positions >= length] = -1
        if self.ring:  # the emptied cells are those of positions length.. again, or of the next `capacity` of them
            self.refill_at = max(self.refill_at, min(self.length, length + self.capacity))
        self.length = length

    @property
    def has_holes(self) -> bool:
        """Whether a ring has empty cells among those of positions it has passed: a rollback emptied the cells of the
        positions after it, and the positions written since have not yet filled them all (a new request that cut a
        slot back to 0 fills every cell within its first `capacity` positions)."""
        return self.ring and self.length < self.refill_at

    @property
    def nbytes(self) -> int:
        """Bytes of the cells it holds: all of its own, or its share of a pool."""
        own = self.k.nbytes + self.v.nbytes
        if self.table is None or self.pool is None:
            return own
        return own * min(self.table.n_cells, self.pool.n_cells) // self.pool.n_cells


def append_and_attend(
    caches: list[KVCache],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    static: bool = False,
) -> torch.Tensor:
    """Attention of a batch of sequences, each over its own cache: rows are split evenly between the
    caches (q [rows, H, D], k/v [rows, Hkv, D], positions [rows]); each cache first stores its K/V.
    `static` (a captured step): `write_at` and `attend_static`, which take the positions from the device tensor
    instead of the caches' Python-side lengths."""
    if len(caches) == 1:
        return _append_and_attend_one(caches[0], q, k, v, positions, scale, static)
    T = q.shape[0] // len(caches)
    out = []
    for s, kv in enumerate(caches):
        rows = slice(s * T, (s + 1) * T)
        out.append(_append_and_attend_one(kv, q[rows], k[rows], v[rows], positions[rows], scale, static))
    return torch.cat(out)


def rope_append_and_attend(
    caches: list[KVCache],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    static: bool = False,
    *,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    neox: bool = True,
) -> torch.Tensor:
    """`append_and_attend` of q and k before their per-head RMSNorm (`q_norm`, `k_norm`; None: none) and RoPE (cos,
    sin [rows, n_rot / 2]). On the GPU path the norms, the rotation and the cache write are one launch per cache
    (`KVCache.write_roped`); on the CPU, `rms_norm` and `apply_rope` as ever."""
    if not gpu_path(q):
        q = apply_rope(rms_norm(q, q_norm, eps), cos, sin, neox=neox)
        k = apply_rope(rms_norm(k, k_norm, eps), cos, sin, neox=neox)
        return append_and_attend(caches, q, k, v, positions, scale, static)
    T = q.shape[0] // len(caches)
    out = []
    for s, kv in enumerate(caches):
        rows = slice(s * T, (s + 1) * T)
        norms = {"q_norm": q_norm, "k_norm": k_norm, "eps": eps, "static": static, "neox": neox}
        qs = kv.write_roped(q[rows], k[rows], v[rows], positions[rows], cos[rows], sin[rows], **norms)
        out.append(kv.attend_static(qs, positions[rows], scale) if static else kv.attend(qs, positions[rows], scale))
    return out[0] if len(out) == 1 else torch.cat(out)


def _append_and_attend_one(
    kv: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, static: bool
) -> torch.Tensor:
    if static:
        kv.write_at(positions, k, v)
        return kv.attend_static(q, positions, scale)
    kv.append(k, v)
    return kv.attend(q, positions, scale)
