"""What scores an MTP draft: the LM head itself, or a shortlisting head (`--spec-draft-head q4_0`).

A draft step reads the whole output layer for one argmax: on the 27B that is 1.04 GB (Q6_K, 248,320 rows) a step,
two steps a cycle, a tenth of an MTP cycle's bytes. A shortlisting head reads a Q4_0 copy instead (0.72 GB),
keeps its top SHORTLIST rows, and ranks those with the head's own rows, so its top-k is the head's whenever the
head's top-k lie in the copy's top SHORTLIST. A 4-bit copy alone would not do: its argmax is the head's at only
88-93% of positions on the fixtures' models, while the head's argmax came 14th at worst in the copy's order
(bench/draft_head.py, docs/performance.md). Verification still scores over the whole head, so the tokens are
the same either way; only a draft may differ, and only when the copy misses the head's top-k. A draft drawn at a
temperature (models.graphs.MTPDrawGraph) draws from the request's chain over the shortlisted rows' own logits: the
ratio rule reads the distribution it was drawn from, so the tokens kept stay the target's distribution exactly,
and that distribution differs from the whole head's only where the copy misses some of the chain's candidates
(its bans, such as ignore_eos's, are applied before the shortlist, so the shortlisted rows are unbanned).
The top-k of a long row takes ops.sampling_chain's two stages (torch's top-k of one long row is slow on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.linear import linear
from ..ops.sampling_chain import top_candidates
from ..quant.qtensor import QTensor
from ..quant.quantize import quantize
from ..quant.types import GGMLType, block_geometry

SHORTLIST = 64  # candidates the copy hands the head: 4.5x the worst place bench/draft_head.py measured (14th)
SHORTLIST_TYPE = GGMLType.Q4_0
QUANTIZE_ROWS = 8192  # rows quantized at a time: bounds the float32 temporaries (~30 copies of a chunk)


@dataclass(frozen=True)
class DraftHead:
    """The exact head, and (shortlisting) its low-bit copy, on the head's device."""

    exact: QTensor
    coarse: QTensor | None = None
    shortlist: int = SHORTLIST

    @classmethod
    def shortlisting(cls, head: QTensor, ggml_type: GGMLType = SHORTLIST_TYPE) -> DraftHead:
        """`head` with a `ggml_type` copy of it made now, on its device, a chunk of rows at a time."""
        n = head.shape[0]
        runs = [(start, min(start + QUANTIZE_ROWS, n)) for start in range(0, n, QUANTIZE_ROWS)]
        chunks = [quantize(head.select_rows([run]).dequantize(), ggml_type) for run in runs]
        coarse = QTensor(torch.cat(chunks), ggml_type, head.shape, f"{head.name} as {ggml_type.name}")
        return cls(head, coarse)

    @property
    def device(self) -> torch.device:
        return self.exact.data.device

    @property
    def n_vocab(self) -> int:
        return self.exact.shape[0]

    def scores(
        self, hidden: torch.Tensor, k: int, ban: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's logits float32 for hidden [1, n_embd] wherever its k best may lie: its whole row [V] (ids
        None), or the exact logits [S] of the copy's top S = max(k, shortlist) rows with their token ids [S], the
        rows `ban` (0 or -inf a token) bans left out of the shortlist. No host round trip (it runs inside captured
        steps)."""
        hidden = hidden.to(self.device)
        if self.coarse is None:
            return linear(hidden, self.exact)[0].float(), None
        coarse = linear(hidden, self.coarse)[0]
        coarse = coarse if ban is None else coarse + ban
        _, ids = top_candidates(coarse, min(max(k, self.shortlist), self.n_vocab))
        rows = QTensor(self.exact.data[ids], self.exact.ggml_type, (len(ids), self.exact.shape[1]), self.exact.name)
        return linear(hidden, rows)[0].float(), ids

    def top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best-scoring tokens for hidden [1, n_embd]: (logits [k] float32, token ids [k]), best first."""
        return candidates(*self.scores(hidden, k), k)

    def nbytes_read(self) -> int:
        """Bytes a draft step reads from the head: all of it, or the copy and the shortlisted rows."""
        if self.coarse is None:
            return self.exact.nbytes
        return self.coarse.nbytes + self.shortlist * self.exact.data.shape[1]


def candidates(
    logits: torch.Tensor, ids: torch.Tensor | None, k: int, ban: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest of a head's `scores` (logits, their token ids or None for a whole row), after `ban` (a row of
    the vocabulary's width, 0 or -inf) where given, highest first: (logits [k], token ids [k])."""
    if ban is not None:
        logits = logits + (ban if ids is None else ban[ids])
    values, where = top_candidates(logits, k)
    return values, where if ids is None else ids[where]


def copy_row_bytes(row_length: int, ggml_type: GGMLType = SHORTLIST_TYPE) -> int | None:
    """Bytes of a row of the copy (None: a row of this length does not fill its blocks)."""
    block, size = block_geometry(ggml_type)
    return None if row_length % block else row_length // block * size


def copy_pays(head_row_bytes: float, row_length: int) -> bool:
    """Whether the copy reads a quarter fewer bytes than the head (Q6_K: 31% fewer, Q8_0: 47%, F16: 72%) and its
    rows fit its blocks: where `--spec-draft-head auto` makes it (engine.drafters) and the placement counts it."""
    copy = copy_row_bytes(row_length)
    return copy is not None and copy <= 0.75 * head_row_bytes


def shortlist_pays(head: QTensor) -> bool:
    return copy_pays(head.data.shape[1], head.shape[-1])
