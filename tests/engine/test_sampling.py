"""Sampling: the chain samples from the distribution each filter's definition gives (chi-square on a
fixed logit vector), penalties and biases act as llama.cpp's, seeds reproduce."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from mtpserve.engine.sampling import (
    Mt19937Uniform,
    Sampler,
    SamplingParams,
    _top_n,
    post_sampling_probabilities,
    top_probabilities,
)

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0, -6.0])
N_DRAWS = 20_000


def expected(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The distribution by the filters' definitions, written out independently of the sampler."""
    keep = np.ones(len(logits), dtype=bool)
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    p1 = np.exp(logits - logits[keep].max()) * keep
    p1 /= p1.sum()  # probabilities at temperature 1 among the survivors
    if top_p < 1.0:
        cumulative = np.cumsum(p1[order])
        n = int(np.argmax(cumulative >= top_p)) + 1
        keep[order[n:]] = False
    if min_p > 0.0:
        keep &= p1 >= min_p * p1.max()
    p = np.exp((logits - logits.max()) / temperature) * keep
    return p / p.sum()


def chi2_critical(df: int, z: float = 3.29) -> float:
    """The 0.9995 quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
        dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
        dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.15),
        dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama-server's defaults
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "defaults"],
)
def test_samples_follow_the_filtered_distribution(params):
    sampler = Sampler(SamplingParams(seed=1234, **params))
    counts = np.bincount([sampler.sample(LOGITS) for _ in range(N_DRAWS)], minlength=len(LOGITS))
    want = expected(LOGITS.numpy().astype(np.float64), **params)
    assert np.all(counts[want == 0] == 0), "a filtered-out token was sampled"
    live = want > 0
    # Chi-square with the least likely tokens pooled until every bin expects at least 5 draws.
    order = np.argsort(-want)
    observed, predicted = list(counts[order[live[order]]]), list(N_DRAWS * want[order[live[order]]])
    while len(predicted) > 1 and predicted[-1] < 5:
        observed[-2:] = [observed[-2] + observed[-1]]
        predicted[-2:] = [predicted[-2] + predicted[-1]]
    observed, predicted = np.array(observed), np.array(predicted)
    stat = float(((observed - predicted) ** 2 / predicted).sum())
    df = len(observed) - 1
    assert df == 0 or stat < chi2_critical(df), (stat, chi2_critical(df), counts, want)
    assert sampler.probabilities(LOGITS).keys() == set(np.nonzero(live)[0].tolist())


def test_greedy_takes_the_argmax_after_bias_and_penalties():
    assert Sampler(SamplingParams(temperature=0.0)).sample(LOGITS) == 0
    biased = Sampler(SamplingParams(temperature=0.0, logit_bias={0: -math.inf}))
    assert biased.sample(LOGITS) == 1
    # repeat_penalty divides positive logits of recent tokens (2.0 / 2 = 1.0 < 1.5): token 1 wins.
    penalized = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=4), history=[0, 9])
    assert penalized.sample(LOGITS) == 1
    # ...and only within the last repeat_last_n tokens: token 0 has left the window.
    forgotten = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=2), history=[0, 9, 8])
    assert forgotten.sample(LOGITS) == 0


def test_presence_and_frequency_penalties():
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.3, frequency_penalty=0.2), history=[0, 0, 1])
    ids, values = s.candidates(LOGITS)
    # token 0: 2.0 - 2 * 0.2 - 0.3 = 1.3; token 1: 1.5 - 0.2 - 0.3 = 1.0; token 2 keeps 1.2 < 1.3.
    assert ids.tolist() == [0] and values.tolist() == pytest.approx([1.3])


def test_a_seed_reproduces_the_draws():
    def draws(seed: int) -> list[int]:
        return [Sampler(SamplingParams(seed=seed)).sample(LOGITS) for _ in range(1)] + [
            s.sample(LOGITS) for s in [Sampler(SamplingParams(seed=seed))] for _ in range(50)
        ]

    assert draws(5) == draws(5) and draws(5) != draws(6)


def test_top_probabilities_are_the_raw_softmax():
    top, _ = top_probabilities(LOGITS, 3)
    probs = torch.softmax(LOGITS, 0)
    assert [i for i, _ in top] == [0, 1, 2]
    assert [p for _, p in top] == pytest.approx(probs[:3].tolist())
    _, p_sampled = top_probabilities(LOGITS, 1, token=2)
    assert p_sampled == pytest.approx(float(probs[2]))


@pytest.mark.parametrize(
    "params", [dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), dict(temperature=1.3, top_k=4)]
)
def test_post_sampling_probabilities_are_the_filtered_distribution(params):
    """llama-server's post_sampling_probs: the n most likely of the distribution the draw comes from (the
    filters' definition, written out in `expected`), and the drawn token's probability there."""
    sampler = Sampler(SamplingParams(**params, seed=3))
    dist = expected(LOGITS.numpy().astype(np.float64), **params)
    top, p_token = post_sampling_probabilities(sampler, LOGITS, 3, token=1)
    order = np.argsort(-dist, kind="stable")[:3]
    assert [i for i, _ in top] == order.tolist()
    assert [p for _, p in top] == pytest.approx(dist[order].tolist())
    assert p_token == pytest.approx(float(dist[1]))
    _, p_removed = post_sampling_probabilities(sampler, LOGITS, 3, token=11)  # cut by the filters
    assert p_removed == 0.0


def test_draws_are_llama_cpps_mt19937_through_libstdcpp_uniform_real_distribution():
    """The first draws of std::mt19937(seed) read by std::uniform_real_distribution<double>(0, 1), printed by a
    C++ program built with g++ (libstdc++, as llama.cpp's Linux builds): the same seed draws the same numbers."""
    libstdcpp = {
        42: [0.79654298428784598, 0.18343478789336848, 0.77969099761266125, 0.59685016158005655],
        4242: [0.80856906956176955, 0.24104133666036989, 0.45280400731461307, 0.33380064770730894],
        0: [0.59284461651668263, 0.84426574425659828, 0.85794561998982988, 0.84725173738433124],
    }
    for seed, expected_draws in libstdcpp.items():
        rng = Mt19937Uniform(seed)
        assert [rng.random() for _ in expected_draws] == expected_draws


def test_draws_looked_ahead_are_taken_in_order():
    """`ahead` shows the next draws without taking them; `random` and `skip` then take them in order."""
    looked, plain = Mt19937Uniform(5), Mt19937Uniform(5)
    expected = [plain.random() for _ in range(5)]
    assert looked.ahead(3) == expected[:3]
    looked.skip(1)
    assert looked.ahead(1) == looked.ahead(1) == [expected[1]]
    assert [looked.random() for _ in range(4)] == expected[1:]


@pytest.mark.parametrize("seed", [0, 1, 42, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**32 + 5])
def test_the_generator_starts_from_init_genrand(seed: int):
    """The state std::mt19937(seed) starts from, by its recurrence (init_genrand, the 32-bit seed): numpy's legacy
    seeding, which `Mt19937Uniform` takes, makes the same 624 words."""
    key = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + i) & 0xFFFFFFFF)
    state = Mt19937Uniform(seed).bits.state["state"]
    assert state["key"].tolist() == key and state["pos"] == 624


@pytest.mark.parametrize(
    "bias",
    [
        {},
        {0: -math.inf},  # the best token banned (ignore_eos bans end-of-generation tokens)
        {3: -math.inf, 7: -1.0},  # others lowered: the best stays
        {9: 5.0},  # a raise: the biased copy decides
        {0: -0.4},  # the best lowered into a tie with the next
    ],
)
def test_greedy_without_a_copy_takes_the_token_of_the_biased_copy(bias):
    """Greedy skips the biased copy of the logits where biases only lower tokens; its twin is the argmax of the
    copy, every token of a shuffled vector tried as the best."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = LOGITS[torch.randperm(len(LOGITS), generator=generator)]
        sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=bias))
        biased = logits.clone()
        for token, value in bias.items():
            biased[token] += value
        ids, values = sampler.candidates(logits)
        assert int(ids[0]) == int(biased.argmax()) and float(values[0]) == float(biased.max())


@functools.cache
def _rows() -> dict[str, np.ndarray]:
    """Vocabulary-sized rows of the shapes the chunked top-k meets: a model's, ties, a grammar's mask, a flat row."""
    rng = np.random.default_rng(7)
    model = rng.standard_normal(248_320).astype(np.float32)
    model[:4096] += 8.0
    ties = np.round(rng.standard_normal(49_152) * 2).astype(np.float32)  # a few values, each many times
    masked = np.full(248_320, -np.inf, dtype=np.float32)
    masked[rng.choice(248_320, 25, replace=False)] = rng.standard_normal(25)  # fewer allowed tokens than top_k
    sparse = np.full(248_320, -np.inf, dtype=np.float32)
    sparse[rng.choice(248_320, 3000, replace=False)] = rng.standard_normal(3000)
    flat = np.zeros(262_144, dtype=np.float32)
    flat[123_456] = 1.0
    small = rng.standard_normal(4096).astype(np.float32)  # tinyqwen35's vocabulary: groups of 4
    return {"model": model, "ties": ties, "masked": masked, "sparse": sparse, "flat": flat, "small": small}


@pytest.mark.parametrize("name", ["model", "ties", "masked", "sparse", "flat", "small"])
@pytest.mark.parametrize("n", [1, 40, 300])
def test_top_n_is_the_sorted_vocabularys_prefix(name, n):
    """The chunked top-k against its plain twin: the first n ids of the whole row sorted by logit, equal logits
    by id."""
    row = _rows()[name]
    assert _top_n(row, n).tolist() == np.argsort(-row, kind="stable")[:n].tolist()


@pytest.mark.parametrize("params", [dict(), dict(top_k=0, top_p=0.9), dict(top_k=100, min_p=0.0, typical_p=0.9)])
def test_the_chain_over_a_large_vocabulary_keeps_the_definitions_survivors(params):
    """At Qwen3.5's 248,320 tokens (the chunked path), the survivors and their probabilities are the filters'
    definition's, penalties included."""
    row = _rows()["model"][:248_320].copy()
    history = list(range(4000, 4100))
    full = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5)
    sampler = Sampler(SamplingParams(**{**full, **params}), history=history)
    got = sampler.probabilities(torch.from_numpy(row))
    penalized = row.astype(np.float64)
    window = history[-64:]
    for token in set(window):
        value = penalized[token]
        penalized[token] = (value * 1.3 if value <= 0 else value / 1.3) - 0.5
    if "typical_p" in params:  # `expected` does not write out typical sampling: hold only the first filter's set
        assert set(got) <= set(np.argsort(-penalized, kind="stable")[:100].tolist())
        return
    keys = ("temperature", "top_k", "top_p", "min_p")
    want = expected(penalized, **{k: v for k, v in {**full, **params}.items() if k in keys})
    assert set(got) == set(np.nonzero(want)[0].tolist())
    assert [got[t] for t in sorted(got)] == pytest.approx([want[t] for t in sorted(got)], rel=1e-4)


CHAINS = [
    dict(temperature=0.0),
    dict(temperature=0.0, logit_bias={5: 3.5, 9: -math.inf}, repeat_penalty=1.3),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=0.6, top_k=20, top_p=0.95, repeat_penalty=1.1, presence_penalty=0.4, frequency_penalty=0.2),
    dict(temperature=1.0, top_k=300, typical_p=0.9, logit_bias={100: 0.1, 101: -2.0}),
    dict(temperature=1.0, top_k=0, top_p=0.9),  # the whole vocabulary: the row comes over
]


@pytest.mark.parametrize("name", ["model", "ties", "masked", "sparse", "flat", "small"])
@pytest.mark.parametrize("params", CHAINS, ids=["greedy", "greedy-biased", "defaults", "qwen", "typical", "no-top-k"])
def test_a_row_ranked_on_its_device_gives_the_host_rows_tokens(name, params, monkeypatch):
    """The GPU path leaves logits on the device and ranks them there (torch: biases, penalties, top-k), copying only
    the candidates; its twin is the numpy path over the whole row. Run on CPU tensors by taking "cpu" off the host
    devices: the same candidates with the same float32 values, the same probabilities and the same seeded draws,
    on rows with ties at the n-th place (the row then comes over), masked rows and a flat one."""
    from mtpserve.engine import sampling

    row = torch.from_numpy(_rows()[name])
    history = [int(t) for t in np.argsort(-_rows()[name], kind="stable")[:50:3]] + [1, 2, 3]
    on_device = []
    for devices in (sampling.HOST_DEVICES, frozenset()):
        monkeypatch.setattr(sampling, "HOST_DEVICES", devices)
        sampler = Sampler(SamplingParams(seed=1234, **params), history=history)
        ids, values = sampler.candidates(row)
        draws = []
        for _ in range(20):
            draws.append(sampler.sample(row))
        on_device.append((ids.tolist(), values.numpy().tobytes(), sampler.probabilities(row), draws))
    assert on_device[1] == on_device[0]


@pytest.mark.parametrize("names", [("model", "masked", "sparse"), ("ties", "ties"), ("small", "small")])
@pytest.mark.parametrize("n", [1, 40, 300])
@pytest.mark.parametrize("bias", [{}, {7: -math.inf, 11: 2.5}], ids=["none", "biased"])
def test_rows_ranked_together_are_each_rows_own_ranking(names, n, bias):
    """A verification's rows ranked in one pass and one copy (`rows_ranked_on_device`) against its twin, each row
    ranked alone (`ranked_on_device`): the same ids and values, with the row's biases (at n = 1 the first of tied
    best logits), and the same ties declined (the ties row's at 40 and 300)."""
    from mtpserve.engine.sampling import DeviceBias, ranked_on_device, rows_ranked_on_device

    rows = torch.stack([torch.from_numpy(_rows()[name]) for name in names])
    rows[1:] += torch.randn(rows[1:].shape, generator=torch.Generator().manual_seed(n)) * 0.01  # rows differ
    device_bias = DeviceBias.of(bias, rows.device)
    together = rows_ranked_on_device(rows, n, device_bias)
    alone = [ranked_on_device(row, n, device_bias, {}, 1.0, 0.0, 0.0) for row in rows]
    as_lists = [None if r is None else (r[0].tolist(), r[1].tobytes()) for r in together]
    assert as_lists == [None if r is None else (r[0].tolist(), r[1].tobytes()) for r in alone]
    assert any(r is not None for r in together)


@pytest.mark.parametrize(
    "params",
    [
        dict(),
        dict(temperature=0.6, top_k=20, min_p=0.0),
        dict(typical_p=0.9, min_keep=3, logit_bias={5: 1.5}),
        dict(temperature=0.0),
        dict(temperature=0.0, logit_bias={5: 30.0, 9: -math.inf}),
    ],
    ids=["defaults", "qwen", "typical", "greedy", "greedy-biased"],
)
def test_a_row_ranked_with_its_verification_samples_as_alone(params, monkeypatch):
    """A row's ranking from `Sampler.rows_ranked` gives the distribution and the seeded draws the row gives alone;
    chains whose rows differ (penalties), those that need whole rows and host rows are not ranked together."""
    from mtpserve.engine import sampling

    rows = torch.from_numpy(np.stack([_rows()["model"], _rows()["model"][::-1].copy()]))
    monkeypatch.setattr(sampling, "HOST_DEVICES", frozenset())  # the CPU's rows take the device path
    ranked = Sampler(SamplingParams(**params)).rows_ranked(rows)
    assert ranked is not None and len(ranked) == 2
    for row, one in zip(rows, ranked):
        alone, together = Sampler(SamplingParams(seed=3, **params)), Sampler(SamplingParams(seed=3, **params))
        assert together.probabilities(row, one) == alone.probabilities(row)
        assert [together.sample(row, one) for _ in range(20)] == [alone.sample(row) for _ in range(20)]
    for declined in (
        dict(temperature=0.0, repeat_penalty=1.1),
        dict(repeat_penalty=1.1),
        dict(top_k=0),
        dict(top_k=2000),
    ):
        assert Sampler(SamplingParams(**declined)).rows_ranked(rows) is None
    monkeypatch.setattr(sampling, "HOST_DEVICES", frozenset({"cpu"}))
    assert Sampler(SamplingParams(**params)).rows_ranked(rows) is None


def test_the_device_ranking_leaves_only_unambiguous_rankings_to_itself():
    """`ranked_on_device` declines (None) exactly when the (n+1)-th logit ties the n-th, where the host's whole row
    decides by id; otherwise its n are the host's, equal logits inside ordered by id."""
    from mtpserve.engine.sampling import DeviceBias, ranked_on_device

    row = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, -math.inf, 0.5])
    assert ranked_on_device(row, 2, None, {}, 1.0, 0.0, 0.0)[0].tolist() == [1, 3]  # tied inside: by id
    assert ranked_on_device(row, 3, None, {}, 1.0, 0.0, 0.0) is None  # 2.0 at ids 2 and 4 straddle the cut
    assert ranked_on_device(row, 4, None, {}, 1.0, 0.0, 0.0)[0].tolist() == [1, 3, 2, 4]
    raise_3 = DeviceBias.of({3: 1.0}, row.device)
    assert ranked_on_device(row, 1, raise_3, {}, 1.0, 0.0, 0.0)[0].tolist() == [3]  # the bias decides
    ban_1 = DeviceBias.of({1: -math.inf}, row.device)
    assert ranked_on_device(row, 1, ban_1, {}, 1.0, 0.0, 0.0)[0].tolist() == [3]  # the best banned: the copy decides
    assert ranked_on_device(row, 1, None, {}, 1.0, 0.0, 0.0)[0].tolist() == [1]  # a tie for the best: the first
    ids, values = ranked_on_device(row, 5, None, {1: 2}, 2.0, 0.25, 0.0)  # id 1: 3 / 2 - 2 * 0.25 = 1.0
    assert ids.tolist() == [3, 2, 4, 0, 1] and values.tolist() == [3.0, 2.0, 2.0, 1.0, 1.0]
