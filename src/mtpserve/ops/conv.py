"""Causal depthwise conv1d over time with a carried state (the short conv of Gated DeltaNet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] raw inputs, weight [C, K], state [C, K-1] (the K-1 previous inputs, zeros at start).

    Returns (y [T, C], new_state [C, K-1]) with y[t, c] = sum_i weight[c, i] * X[c, t - (K-1) + i] where
    X is the state followed by x; weight[c, K-1] multiplies the current input.
    """
    n_channels, width = weight.shape
    xs = torch.cat((state, x.T), dim=1)  # [C, K-1+T]
    y = F.conv1d(xs.unsqueeze(0), weight.unsqueeze(1), groups=n_channels)[0]  # [C, T]
    return y.T, xs[:, xs.shape[1] - (width - 1) :].clone()
