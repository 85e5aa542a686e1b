"""A weight matrix kept in its GGUF block format: raw bytes, type and logical shape."""

from __future__ import annotations

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
