"""models.draft_head: the MTP draft's scorer, whole or shortlisted by a Q4_0 copy, held to the head itself."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from mtpserve.models import draft_head
from mtpserve.models.draft_head import SHORTLIST, DraftHead, shortlist_pays
from mtpserve.models.loader import load
from mtpserve.ops.linear import linear
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.quantize import quantize
from mtpserve.quant.types import GGMLType

from ..conftest import shared_path, tinyqwen_path

TEXT_CHARS = 6000


@cache
def _hidden_states() -> tuple[object, torch.Tensor]:
    """tinyqwen35 Q4_K_M (its head Q6_K, as the 27B's) and its MTP block's output over a stretch of this
    project's docs: what a draft step scores."""
    from mtpserve.tokenizer import Tokenizer

    path = tinyqwen_path("Q4_K_M")
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    text = (shared_path("spec") / "mtp-speculative-decoding.md").read_text()[:TEXT_CHARS]
    ids = tokenizer.encode(text)[:512]
    state = model.new_state(1024, mtp=True)
    hidden = model.forward(torch.tensor(ids), state)
    _, h_mtp = model.mtp_step(hidden[:-1], torch.tensor(ids[1:]), state, with_logits=False)
    return model, h_mtp


def test_the_whole_head_ranks_as_its_product() -> None:
    model, h = _hidden_states()
    head = DraftHead(model.mtp_head)
    for row in h[:16]:
        values, ids = head.top(row[None], 10)
        top = linear(row[None], model.mtp_head)[0].topk(10)
        assert torch.equal(ids, top.indices) and torch.equal(values, top.values)


def test_a_shortlisting_head_ranks_as_the_whole_head_where_its_copy_alone_would_not() -> None:
    """Over 500 draft positions the copy's top 64 hold the head's top 10, so the shortlisted top-10 are the head's
    (ids and logits); the copy's own argmax differs at some of them, which the rescoring is there for."""
    model, h = _hidden_states()
    whole, short = DraftHead(model.mtp_head), DraftHead.shortlisting(model.mtp_head)
    assert short.coarse is not None and short.coarse.ggml_type == GGMLType.Q4_0
    copy_differs = 0
    for row in h:
        values, ids = short.top(row[None], 10)
        want_values, want_ids = whole.top(row[None], 10)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(values, want_values)
        copy_differs += int(linear(row[None], short.coarse)[0].argmax() != want_ids[0])
    assert len(h) >= 400 and copy_differs >= 5


def test_a_shortlisting_heads_candidates_after_bans_are_its_rows_ranked_with_the_bans() -> None:
    """`scores` and `candidates` with a ban row (as a drawn draft's chain ranks its candidates): a shortlisting
    head's k best are its shortlisted rows' exact logits ranked, the shortlist taken past the bans (64 unbanned
    rows); a whole head's, its row's with the bans."""
    model, h = _hidden_states()
    ban = torch.zeros(model.config.n_vocab)
    ban[::3] = float("-inf")  # every third token, as the chain tests ban them
    exact = linear(h[:8], model.mtp_head).float()
    for head in (DraftHead(model.mtp_head), DraftHead.shortlisting(model.mtp_head)):
        for row, want_row in zip(h[:8], exact, strict=True):
            logits, ids = head.scores(row[None], 40, ban)
            seen = torch.full_like(want_row, float("-inf"))
            seen[slice(None) if ids is None else ids] = want_row if ids is None else want_row[ids]
            values, tokens = draft_head.candidates(logits, ids, 40, ban)
            want = (seen + ban).topk(40)
            assert torch.equal(tokens, want.indices) and bool(want.values.isfinite().all())
            torch.testing.assert_close(values, want.values)
            assert ids is None or (len(ids) == SHORTLIST and bool(ban[ids].eq(0).all()))


def test_a_head_narrower_than_the_shortlist_ranks_all_its_rows() -> None:
    """--spec-draft-vocab 40 with --spec-draft-head q4_0: 40 rows, fewer than SHORTLIST, all ranked by the head."""
    model, h = _hidden_states()
    head = model.mtp_head.first_rows(40)
    values, ids = DraftHead.shortlisting(head).top(h[:1], 10)
    top = linear(h[:1], head)[0].topk(10)
    assert torch.equal(ids, top.indices) and torch.equal(values, top.values)


def test_the_copy_is_llama_cpps_q4_0_of_the_head_made_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _hidden_states()
    head = model.mtp_head
    monkeypatch.setattr(draft_head, "QUANTIZE_ROWS", 1000)  # 4096 rows: five chunks, the last short
    short = DraftHead.shortlisting(head)
    assert short.coarse is not None and short.coarse.shape == head.shape
    assert torch.equal(short.coarse.data, quantize(head.dequantize(), GGMLType.Q4_0))
    assert short.nbytes_read() == short.coarse.nbytes + SHORTLIST * head.data.shape[1] < head.nbytes


@pytest.mark.parametrize(
    ("ggml_type", "row_length", "pays"),
    [
        (GGMLType.Q6_K, 5120, True),  # the 27B's output layer: 31% fewer bytes
        (GGMLType.Q8_0, 576, True),
        (GGMLType.F16, 640, True),
        (GGMLType.Q4_K, 5120, False),  # as many bytes as Q4_0
        (GGMLType.Q5_K, 5120, False),  # 18% fewer: not worth a shortlist's second pass
        (GGMLType.F16, 100, False),  # rows that do not fill 32-value blocks
    ],
)
def test_the_copy_is_made_where_it_reads_a_quarter_fewer_bytes(ggml_type: GGMLType, row_length: int, pays: bool):
    from mtpserve.quant.types import block_geometry

    block, size = block_geometry(ggml_type)
    data = torch.zeros(4, -(-row_length // block) * size, dtype=torch.uint8)
    assert shortlist_pays(QTensor(data, ggml_type, (4, row_length), "output.weight")) is pays
