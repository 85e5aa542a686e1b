"""One Gated DeltaNet layer's state for one sequence: the conv state (last d_conv-1 raw inputs) and the
SSM state, both float32 as in llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch


@dataclass
class RecurrentState:
    conv: torch.Tensor  # [conv_dim, d_conv - 1]
    ssm: torch.Tensor  # [Hv, dk, dv]

    @classmethod
    def zeros(
        cls, conv_dim: int, d_conv: int, n_v_heads: int, head_dim: int, device: torch.device | str = "cpu"
    ) -> RecurrentState:
        return cls(
            torch.zeros(conv_dim, d_conv - 1, device=device), torch.zeros(n_v_heads, head_dim, head_dim, device=device)
        )

    def snapshot(self) -> RecurrentState:
        return RecurrentState(self.conv.clone(), self.ssm.clone())

    def restore(self, snapshot: RecurrentState) -> None:
        self.conv.copy_(snapshot.conv)
        self.ssm.copy_(snapshot.ssm)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.ssm.numel() * 4


class KeptSteps(Sequence[RecurrentState]):
    """A sequence's states after each token of a pass, kept for a rollback, as the pass wrote them: two [T, ...]
    buffers, a RecurrentState made only for the step a rollback reads (a verification whose drafts were all kept
    reads none; making T of them a layer a pass was ~8% of tinyqwen35's CPU decode at a temperature)."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv, self.ssm = conv, ssm

    def __len__(self) -> int:
        return len(self.conv)

    @overload
    def __getitem__(self, t: int) -> RecurrentState: ...
    @overload
    def __getitem__(self, t: slice) -> list[RecurrentState]: ...
    def __getitem__(self, t: int | slice) -> RecurrentState | list[RecurrentState]:
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(len(self)))]
        return RecurrentState(self.conv[t], self.ssm[t])
