"""A verification's acceptance for drafts drawn from the request's chain, all of its rows in one C call (blocks.c
mtp_verify_drawn): engine.rejection's rule in its order, each drafted row's distribution p the chain over its
candidates, each draft kept with probability min(1, p(d) / q(d)) or the row drawn from the normalised residual
max(0, p - q), and the row after the drafts drawn from p as engine.sampling's Sampler.sample draws. The uniforms are
the caller's, looked ahead in its streams (the draft stream's n_drafts + 1, the main stream's one); the call says
how many of the first it took.

Its twin is the engine's row-by-row path (Sampler.probabilities, rejection.accept_or_resample, Sampler.sample),
held to it token by token and uniform by uniform (tests/ops/test_verify_drawn.py). Their exponentials and sums may
round differently in the last bit, which moves a cut or a draw only at a boundary that close.

Rows on the host are ranked in the call (the chain's bans first); rows on a GPU are ranked there together and their
candidates copied in one (engine.sampling.rows_candidates_on_device), which the call reads. Each step of the engine
costs its Python calls, so the arguments are few: ~5 us of C and ~15 us around it, where the rows one by one took
~150 us of numpy on this VM (three chains, two ratio tests, three rankings' post-processing)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import torch

from ..kernels import cpu as cpu_kernels
from .decode_program import DraftDraws
from .sampling_chain import ChainParams, ChainShape

TIE = 3  # mtp_verify_drawn's code for a device's candidates tied at the chain's n-th place


def verify_drawn(
    shape: ChainShape,
    chain: ChainParams,
    drafts: list[int],
    qs: list[dict[int, float]],
    uniforms: list[float],
    rows: torch.Tensor | None = None,
    candidates: np.ndarray | None = None,
) -> tuple[list[int], int] | None:
    """(tokens kept, draft-stream uniforms taken) for host rows [len(drafts) + 1, V] (float32, contiguous) or a
    device's `candidates` [len(drafts) + 1, 2k] (the k highest values of each row, then their ids; k is n_top or
    n_top + 1). `uniforms`: the draft stream's len(drafts) + 1, then the main stream's (taken where every draft is
    kept). None without the C library, or where a device's candidates tie at the n_top-th place."""
    lib = cpu_kernels.load()
    if lib is None:
        return None
    width = max(map(len, qs), default=1)
    q = np.full((len(qs), 2 * width), -1.0)  # each q: its ids, then their probabilities
    for i, dist in enumerate(qs):
        q[i, : len(dist)], q[i, width : width + len(dist)] = list(dist), list(dist.values())
    out = np.empty(len(drafts) + 3, np.int64)
    rc = lib.mtp_verify_drawn(
        None if rows is None else rows.data_ptr(), 0 if rows is None else rows.shape[-1],
        None if candidates is None else candidates.ctypes.data, 0 if candidates is None else candidates.shape[-1] // 2,
        ctypes.byref(_chain_struct(shape, chain)[0]), np.array(drafts, np.int64).ctypes.data, len(drafts),
        q.ctypes.data, width, np.array(uniforms, np.float64).ctypes.data, out.ctypes.data,
    )  # fmt: skip
    if rc == TIE:
        return None
    if rc != 0:
        raise RuntimeError(f"mtp_verify_drawn failed ({rc})")
    n_kept, taken = out[-2:].tolist()
    return out[:n_kept].tolist(), taken


@lru_cache(maxsize=256)
def _chain_struct(shape: ChainShape, chain: ChainParams) -> tuple[DraftDraws, np.ndarray]:
    """The chain's parameters as the C chain reads them (its draws' fields unused here), made once a chain."""
    banned = np.array(chain.banned, np.int64)
    struct = DraftDraws(
        shape.n_top, shape.min_keep, chain.top_p_bound, chain.temperature, chain.log_min_p,
        None, None, None, None, banned.ctypes.data if len(banned) else None, len(banned),
    )  # fmt: skip
    return struct, banned  # the array lives as long as the struct pointing into it
