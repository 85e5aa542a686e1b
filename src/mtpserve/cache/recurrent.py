"""One Gated DeltaNet layer's state for one sequence: the conv state (last d_conv-1 raw inputs) and the
SSM state, both float32 as in llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass

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
