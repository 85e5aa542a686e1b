"""A weight matrix kept in its GGUF block format: raw bytes, type and logical shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..gguf import TensorInfo
from .dequant import dequantize
from .types import GGMLType, block_geometry


@dataclass(frozen=True)
class QTensor:
    """`data` holds the stored bytes as uint8 [rows, bytes_per_row] (a view of the memory map on CPU);
    `shape` is the torch-order shape (rows, row_length) of the values it encodes."""

    data: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, ...]
    name: str

    @classmethod
    def from_gguf(cls, tensor: TensorInfo) -> QTensor:
        rows = tensor.n_elements // tensor.ne[0]
        data = torch.from_numpy(tensor.raw()).view(rows, -1)
        return cls(data, tensor.ggml_type, tensor.shape, tensor.name)

    def to(self, device: torch.device | str) -> QTensor:
        """The same blocks on `device` (itself when already there)."""
        device = torch.device(device)
        if self.data.device == device:
            return self
        return QTensor(self.data.to(device), self.ggml_type, self.shape, self.name)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.ggml_type, self.shape, dtype=dtype, name=self.name)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize only the rows `index` (an embedding lookup): [len(index), row_length]."""
        return dequantize(self.data[index], self.ggml_type, (len(index), self.shape[-1]), dtype=dtype, name=self.name)

    def block_geometry(self) -> tuple[int, int]:
        return block_geometry(self.ggml_type)

    def first_rows(self, n: int) -> QTensor:
        """A view of rows 0..n-1 (a trimmed vocabulary: BPE vocabularies put frequent tokens first)."""
        n = min(n, self.shape[0])
        return QTensor(self.data[:n], self.ggml_type, (n, *self.shape[1:]), f"{self.name}[:{n}]")

    def select_rows(self, runs: Sequence[tuple[int, int]]) -> QTensor:
        """Rows [a, b) of each run, in order (a tensor-parallel rank's heads): a view where the runs are one
        contiguous range (a model held whole: q | k | v runs end to end), else a copy."""
        runs = merged_runs(runs)
        if len(runs) == 1:
            a, b = runs[0]
            return QTensor(self.data[a:b], self.ggml_type, (b - a, *self.shape[1:]), f"{self.name}[{a}:{b}]")
        data = torch.cat([self.data[a:b] for a, b in runs])
        return QTensor(data, self.ggml_type, (data.shape[0], *self.shape[1:]), f"{self.name}[rows {list(runs)}]")

    def select_columns(self, runs: Sequence[tuple[int, int]]) -> QTensor:
        """Columns [a, b) of each run, in order, as a copy; every bound must fall on a block boundary (a block's
        values share its scales). `columns_split` says whether they do."""
        block, block_bytes = self.block_geometry()
        if not columns_split(self.ggml_type, runs):
            raise ValueError(f"'{self.name}' ({self.ggml_type.name}): columns {list(runs)} cut its {block}-wide blocks")
        parts = [self.data[:, a // block * block_bytes : b // block * block_bytes] for a, b in runs]
        data = torch.cat(parts, dim=1).contiguous()
        width = sum(b - a for a, b in runs)
        return QTensor(data, self.ggml_type, (self.shape[0], width), f"{self.name}[cols {list(runs)}]")


def merged_runs(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs in order, each joined to the one before where it starts at its end."""
    merged: list[tuple[int, int]] = []
    for a, b in runs:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def columns_split(ggml_type: GGMLType, runs: Sequence[tuple[int, int]]) -> bool:
    """Whether column runs [a, b) start and end on block boundaries of `ggml_type`."""
    block = block_geometry(ggml_type)[0]
    return all(a % block == 0 and b % block == 0 for a, b in runs)
