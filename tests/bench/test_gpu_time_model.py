"""bench/gpu_time_model.py's arithmetic, against sums done by hand from its stated assumptions (80% of HBM, 1.5 us
a kernel, the deployment's shapes), with the host time given rather than measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_time_model as tm  # noqa: E402

# a draft step reads the output layer's Q4_0 copy (248,320 rows of 5120 / 32 x 18 bytes) and 64 of its 4200-byte rows
SHORTLISTED = 248_320 * 5120 // 32 * 18 + 64 * 4200
WEIGHTS = tm.Bytes(trunk=15_821_244_416, mtp_block=263_313_408, output_layer=1_042_944_000, draft_head=SHORTLISTED)
WHOLE_HEAD = tm.Bytes(15_821_244_416, 263_313_408, 1_042_944_000, draft_head=1_042_944_000)


def test_the_deployments_bytes_come_from_its_tensors():
    assert tm.Bytes.of_deployment() == WEIGHTS  # the file is 16,799,719,424 bytes with the embedding's 715 MB
    assert tm.Bytes.of_deployment(shortlist=False) == WHOLE_HEAD


def test_query_rows_take_each_archs_row_blocks():
    # 6 query heads a KV head: sm_90's int8 kernel takes a decode's 6 rows in a 16-row block, the mma16 kernel more
    # than 16 in programs of 24 (18 rows: one pass; 24: one; 36: two), sm_75's mma kernel a warp each 8 rows, 4
    # warps a pass (36 rows: two); the float kernel 8-row then 16-row blocks (18 rows: 16 + 4)
    assert [tm.attention_passes(t, "sm_90") for t in (1, 2, 3, 4, 6)] == [1, 1, 1, 1, 2]
    assert [tm.attention_passes(t, "sm_75") for t in (1, 2, 3, 4, 6)] == [1, 1, 1, 1, 2]
    assert [tm.attention_passes(t, "sm_75", "float") for t in (1, 2, 3, 4, 6)] == [1, 1, 2, 2, 3]


def test_each_step_takes_its_own_launches_bounds():
    assert tm.pass_bounds(0.4, 3, "sm_75") == [0.4]
    assert tm.pass_bounds(0.4, 6, "sm_75") == [0.4, 0.4]
    assert tm.pass_bounds(0.4, 3, "sm_90") == [0.4]
    assert tm.pass_bounds({1: [0.6], 3: [0.4, 0.7]}, 1, "sm_75") == [0.6]
    assert tm.pass_bounds({1: [0.6], 3: [0.4, 0.7]}, 3, "sm_75") == [0.4, 0.7]  # a 16-row block and a 4-row one
    assert tm.pass_bounds({1: [0.6], 3: [0.4, 0.7]}, 2, "sm_75") == [0.4]  # no rows of its own: the slowest, a pass


def _predicted(**kw) -> dict:
    rows = tm.predict(host_ms_per_token=0.2, host_ms_per_mtp_cycle=0.9, **{"weights": WEIGHTS, **kw})
    return {(p["device"], p["context"], p["spec"]): p for p in rows}


def test_one_token_on_two_2080ti_by_hand():
    p = _predicted()[("2x2080Ti", 4096, "none")]
    stream = 0.616e9 * 0.8  # bytes a ms
    kv = 16 * 2 * 4 * 256 * 34 / 32 * 4096  # 142.6 MB
    states = 48 * 48 * 128 * 128 * 4 * 2  # read and written
    handover = 5120 * 4 / 6e6 + 0.010  # one boundary between the cards
    copy = 0.020 + 0.010  # the row ranked on the device, its candidates copied
    expected = {
        "weights": 15_821_244_416 / stream,  # 32.10 ms
        "attention": kv / stream,  # decode attention's sm_75 issue bound (1.15 TB/s) clears 80% of 616 GB/s
        "launches": 693 * 1.5e-3,
        "host": 0.2 + copy,
        "other": states / stream + handover,
    }
    assert p["ms"] == pytest.approx(expected, rel=1e-3)
    assert p["tok_s"] == pytest.approx(1e3 / sum(expected.values()), abs=0.05)  # rounded to 0.1


def test_an_mtp_cycle_on_an_h200_by_hand():
    p = _predicted()[("H200", 131072, "draft-mtp")]
    stream = 4.8e9 * 0.8
    kv = 16 * 2 * 4 * 256 * 34 / 32 * 131072
    weights = 15_821_244_416 + 2 * (263_313_408 + SHORTLISTED) + 263_313_408  # verify, two drafts, a catch-up
    # the int8 kernel's verification reads the cache once; its 4.78 TB/s bound is past 80% of HBM, which caps it
    attention = kv / stream + 2 * (kv / 16) / stream + (kv / 16) / stream
    tokens = 1 + 2 * 0.63
    assert p["ms"]["weights"] == pytest.approx(weights / stream / tokens, rel=1e-3)
    assert p["ms"]["attention"] == pytest.approx(attention / tokens, rel=1e-3)
    assert p["ms"]["launches"] == pytest.approx((693 + 2 * 36 + 20) * 1.5e-3 / tokens, rel=1e-3)
    copies = 3 * (0.020 + 0.010)  # the verification's 3 rows together, a draft row in each of two: ranked, copied
    assert p["ms"]["host"] == pytest.approx((0.9 + copies) / tokens, rel=1e-3)


def test_a_drawn_mtp_cycle_on_an_h200_by_hand():
    """Drafts drawn at a temperature (`predicted_sampled`): each draft step reads what a greedy one reads (the
    shortlisting head), in 35 kernels; the host time is the one given; the verification and attention are
    greedy's."""
    p = tm.predict(host_ms_per_token=0.3, host_ms_per_mtp_cycle=1.1, weights=WEIGHTS, drawn=True)
    p = next(r for r in p if (r["device"], r["context"], r["spec"]) == ("H200", 4096, "draft-mtp"))
    greedy = _predicted()[("H200", 4096, "draft-mtp")]
    stream = 4.8e9 * 0.8
    tokens = 1 + 2 * 0.63
    weights = 15_821_244_416 + 2 * (263_313_408 + SHORTLISTED) + 263_313_408
    assert p["ms"]["weights"] == pytest.approx(weights / stream / tokens, rel=1e-3)
    assert p["ms"]["launches"] == pytest.approx((693 + 2 * 35 + 20) * 1.5e-3 / tokens, rel=1e-3)
    assert p["ms"]["host"] == pytest.approx((1.1 + 3 * 0.030) / tokens, rel=1e-3)
    assert p["ms"]["attention"] == greedy["ms"]["attention"] and p["ms"]["other"] == greedy["ms"]["other"]


def test_the_sampled_predictions_come_with_their_host_time():
    """`model` adds `predicted_sampled` (issue 38's two devices) where a sampled host time is given, not without."""
    assert "predicted_sampled" not in tm.model({}, host=(0.2, 0.9))
    keys = ("decode_step", "verify_step", "mtp_draft", "mtp_catch_up", "mtp_draw")
    counts = {f"kernels_per_{key}": n for key, n in zip(keys, (693, 693, 36, 20, 80))}
    r = tm.model(counts, host=(0.2, 0.9), sampled_host=(0.3, 1.1))
    assert r["host_ms_per_mtp_cycle_sampled"] == 1.1 and r["sampled_chain"]["temperature"] == 0.8
    assert {p["device"] for p in r["predicted_sampled"]} == {"H200", "2x2080Ti"}
    drawn = tm.predict(host_ms_per_token=0.3, host_ms_per_mtp_cycle=1.1, drawn=True, kernels=tm.Kernels(draw=80))
    assert r["predicted_sampled"] == [p for p in drawn if p["device"] in ("H200", "2x2080Ti")]


def test_an_earlier_runs_host_times_price_new_counts_alone(tmp_path, monkeypatch):
    """`--host-from`: the host times of an earlier JSON, no measurement, so a change of kernels is priced alone."""
    monkeypatch.setattr(tm, "measure_host", lambda **_: pytest.fail("measured the host"))
    earlier = tm.model({}, host=(0.2, 0.9), sampled_host=(0.3, 1.1))
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    keys = ("decode_step", "verify_step", "mtp_draft", "mtp_catch_up")
    static = {f"kernels_per_{key}": n for key, n in zip(keys, (600, 600, 36, 20))}
    (tmp_path / "static.json").write_text(json.dumps(static))
    out = tmp_path / "out.json"
    argv = ["--static", str(tmp_path / "static.json"), "--host-from", str(tmp_path / "earlier.json")]
    assert tm.main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == tm.model(static, host=(0.2, 0.9), sampled_host=(0.3, 1.1))
    assert json.loads(out.read_text())["predicted"] != earlier["predicted"]  # 600 kernels a step, not 693


def test_measured_bounds_and_counts_replace_the_fallbacks():
    slow = _predicted(attention_tbps={"sm_90": 0.5}, kernels=tm.Kernels(1000, 1000, 50, 40))
    base = _predicted()
    key = ("H200", 131072, "none")
    # the fallback 4.78 TB/s is the HBM's 80% (3.84) at most
    assert slow[key]["ms"]["attention"] == pytest.approx(base[key]["ms"]["attention"] * 3.84 / 0.5, rel=1e-3)
    assert slow[key]["ms"]["launches"] == pytest.approx(1000 * 1.5e-3, rel=1e-3)
    assert slow[("2x2080Ti", 131072, "none")]["ms"] == base[("2x2080Ti", 131072, "none")]["ms"] | {"launches": 1.5}


def test_attention_bounds_read_from_gpu_statics_rows():
    rows = [
        {
            "kernel": "attn_split",
            "name": "attn_split K=Q8_0 V=Q8_0 D=256 T=1",
            "arch": "sm_90",
            "issue_bound_tbps": 1.1,
        },
        {
            "kernel": "attn_split",
            "name": "attn_split K=Q8_0 V=Q8_0 D=256 T=3",
            "arch": "sm_90",
            "issue_bound_tbps": 1.0,
        },
        {"kernel": "attn_split", "name": "attn_split K=F16 V=F16 D=256 T=1", "arch": "sm_90", "issue_bound_tbps": 2.4},
        {"kernel": "attn_split", "name": "attn_split K=Q8_0 V=Q8_0 D=64 T=1", "arch": "sm_75", "issue_bound_tbps": 0.3},
    ]
    assert tm.attention_bounds({"kernels": rows}) == {"sm_90": {1: [1.1], 3: [1.0]}}
    split = [
        {**rows[1], "name": "attn_split K=Q8_0 V=Q8_0 D=256 T=3 BLOCK_M=16", "note": ""},
        {**rows[1], "name": "attn_split K=Q8_0 V=Q8_0 D=256 T=3 BLOCK_M=4", "issue_bound_tbps": 1.7, "note": ""},
        {**rows[1], "name": "attn_split K=Q8_0 V=Q8_0 D=256 T=3 BLOCK_M=32", "issue_bound_tbps": 0.5,
         "note": "block_m=32: a bench choice, not the default"},
    ]  # fmt: skip
    assert tm.attention_bounds({"kernels": split}) == {"sm_90": {3: [1.0, 1.7]}}  # by block, largest first
    int8 = [{**rows[1], "name": "attn_split K=Q8_0 V=Q8_0 planar int8 D=256 T=3 BLOCK_M=32", "issue_bound_tbps": 4.7}]
    mma16 = [{**rows[1], "name": "attn_split K=Q8_0 V=Q8_0 planar mma16 D=256 T=3 BLOCK_M=24", "issue_bound_tbps": 5.9}]
    both = {"kernels": split + int8 + [{**rows[1], "arch": "sm_75", "issue_bound_tbps": 0.4}]}
    assert tm.attention_bounds(both) == {"sm_90": {3: [1.0, 1.7]}, "sm_75": {3: [0.4]}}  # no mma16 row: the float's
    both["kernels"] += mma16
    assert tm.attention_bounds(both) == {"sm_90": {3: [5.9]}, "sm_75": {3: [0.4]}}  # the kernel each step takes


def test_a_row_split_mtp_cycle_on_two_2080ti_by_hand():
    """Issue 40's tensor parallelism over PCIe: each card streams half of every matrix, holds half the KV heads and
    DeltaNet states, and the cards meet in two all-reduces a layer (15 us and 6 GB/s each, assumed) plus one for
    the vocabulary-split output layer's candidates wherever a row is ranked."""
    p = _predicted()[("2x2080Ti-row-pcie", 4096, "draft-mtp")]
    stream = 0.616e9 * 0.8
    kv = 16 * 2 * 4 * 256 * 34 / 32 * 4096
    states = 48 * 48 * 128 * 128 * 4
    tokens = 1 + 2 * 0.63

    def allreduce(n_tokens: int) -> float:
        return 15e-3 + n_tokens * 5120 * 4 / 6e6

    verify = 129 * allreduce(3)  # 64 layers x 2, and the output layer's
    drafts = 2 * 3 * allreduce(1)  # the MTP block's two and the output layer's, a draft step
    catch_up = 2 * allreduce(1)
    weights = (15_821_244_416 + 2 * (263_313_408 + 1_042_944_000) + 263_313_408) / 2
    attention = (kv + 3 * kv / 16) / 2 / stream  # a verification's one pass and the MTP layer's, HBM-bound
    assert p["ms"]["weights"] == pytest.approx(weights / stream / tokens, rel=1e-3)
    assert p["ms"]["attention"] == pytest.approx(attention / tokens, rel=1e-3)
    # read, written in place, and a copy after each verified token but the last: 4 states a verification, halved
    assert p["ms"]["other"] == pytest.approx((states * 4 / 2 / stream + verify + drafts + catch_up) / tokens, rel=1e-3)
    # sm_75's mma attention kernel: a verification's rows in one launch a layer, as sm_90's
    assert p["ms"]["launches"] == pytest.approx((693 + 129 + 2 * (36 + 3) + 20 + 2) * 1.5e-3 / tokens, rel=1e-3)
    layer = _predicted()[("2x2080Ti", 4096, "draft-mtp")]
    assert 1.5 < p["tok_s"] / layer["tok_s"] < 2.0


def test_the_draft_vocabulary_bench_predicts_through_the_model(monkeypatch):
    """bench/draft_vocab.py's prediction: the whole vocabulary at full acceptance is the model's own draft-mtp row,
    and a cut output layer at the same acceptance is faster on both devices."""
    import draft_vocab

    monkeypatch.setattr(tm, "measure_host", lambda: (0.2, 0.9))
    rows = draft_vocab.predicted({size: 1.0 for size in draft_vocab.QWEN_SIZES})
    whole = next(r for r in rows if r["draft_vocab"] == tm.VOCAB)
    own = _predicted(weights=WHOLE_HEAD)
    assert whole["tok_s"] == {d: own[(d, 4096, "draft-mtp")]["tok_s"] for d in tm.DEVICES}
    cut = next(r for r in rows if r["draft_vocab"] == 32768)
    assert all(cut["tok_s"][d] > whole["tok_s"][d] for d in ("H200", "2x2080Ti"))


def test_the_draft_head_bench_predicts_both_heads_through_the_model(monkeypatch):
    """bench/draft_head.py: the whole head's rows and the shortlisting head's are the model's with each head's
    bytes (gpu_static's bounds and counts), and the shortlisting head is the faster on both devices."""
    import json

    import draft_head

    monkeypatch.setattr(tm, "measure_host", lambda: (0.2, 0.9))
    rows = {(r["draft_head"], r["device"], r["context"]): r["tok_s"] for r in draft_head.predicted()}
    static = json.loads(draft_head.STATIC.read_text())
    for head, weights in (("full", WHOLE_HEAD), ("q4_0", WEIGHTS)):
        own = _predicted(weights=weights, attention_tbps=tm.attention_bounds(static), kernels=tm.kernel_counts(static))
        for device in ("H200", "2x2080Ti"):
            for context in tm.CONTEXTS:
                assert rows[(head, device, context)] == own[(device, context, "draft-mtp")]["tok_s"]
    assert all(rows[("q4_0", d, c)] > rows[("full", d, c)] for d in ("H200", "2x2080Ti") for c in tm.CONTEXTS)


def test_an_h100_is_the_h200_at_its_bandwidth():
    """The H100 SXM (`predicted_other`, not issue 38's pair): the H200's sm_90 kernels, counts and host time; its
    weights, states and (past the int8 kernel's bound) attention streamed at 3.35 TB/s rather than 4.8."""
    r = tm.model({}, host=(0.2, 0.9))
    assert {p["device"] for p in r["predicted"]} == {"H200", "2x2080Ti"}
    other = {(p["context"], p["spec"]): p for p in r["predicted_other"]}
    h200 = {(p["context"], p["spec"]): p for p in r["predicted"] if p["device"] == "H200"}
    assert {p["device"] for p in r["predicted_other"]} == {"H100"} and set(other) == set(h200)
    for key, p in other.items():
        assert p["ms"]["weights"] == pytest.approx(h200[key]["ms"]["weights"] * 4.8 / 3.35, rel=1e-3)
        assert p["ms"]["launches"] == h200[key]["ms"]["launches"] and p["ms"]["host"] == h200[key]["ms"]["host"]
        assert p["tok_s"] < h200[key]["tok_s"]
