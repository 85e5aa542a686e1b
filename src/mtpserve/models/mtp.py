"""What speculative decoding reads from a model with an MTP block (Qwen3.5/3.6's NextN layer, which predicts the
token after next from a token's embedding and the trunk's hidden state before it): `MTPModel`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..ops.decode_program import DrawnChain
from ..quant.qtensor import QTensor
from .base import CausalLM, ModelState


@runtime_checkable
class MTPModel(Protocol):
    @property
    def mtp_kv_index(self) -> int | None:
        """Where `new_state(mtp=True)` keeps the MTP block's KV cache in `state.kv` (None: no MTP block)."""
        ...

    @property
    def mtp_head(self) -> QTensor:
        """The LM head the MTP block scores its drafts with."""
        ...

    @property
    def mtp_table(self) -> QTensor:
        """The token table the MTP block embeds with."""
        ...

    def mtp_embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def mtp_step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        state: ModelState,
        with_logits: bool = True,
        positions: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """MTP rows for tokens [T] at the next positions of the MTP cache: (logits [T, V] or None, h_mtp [T, E])."""
        ...

    def mtp_draft(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        state: ModelState,
        n_steps: int,
        head: QTensor,
        top_k: int,
        p_min: float,
        draws: DrawnChain | None = None,
    ) -> list[tuple[int, float]] | None:
        """Chained greedy drafts in one call, (token, its softmax over the top_k) a step, stopping after the first
        below p_min; None where it cannot serve (then `mtp_step` a step at a time). With `draws`, each token drawn
        from the request's chain instead."""
        ...

    def mtp_draft_row(
        self, hidden: torch.Tensor, tokens: list[int], state: ModelState, head: QTensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """One draft step in one call: (the head's row [V], the block's output [1, E], the argmax's softmax over the
        top_k); None where it cannot serve."""
        ...


def mtp_model(model: CausalLM) -> MTPModel | None:
    """`model` as an MTPModel when it has an MTP block, else None."""
    return model if isinstance(model, MTPModel) and model.mtp_kv_index is not None else None


def mtp_cache_index(model: CausalLM) -> int | None:
    """Where the MTP block's KV cache sits in a state's `kv` (None: the model has no MTP block)."""
    mtp = mtp_model(model)
    return mtp.mtp_kv_index if mtp is not None else None


def mtp_graphable(model: CausalLM) -> bool:
    """Whether the MTP block and the LM head run on one device (their graphs need that; a layer split puts both on
    its last GPU unless --tensor-split gives the head a GPU of its own)."""
    index = mtp_cache_index(model)
    return index is not None and model.device_of(index) == model.output.data.device and not model.tensor_parallel
