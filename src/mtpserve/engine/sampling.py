"""Token sampling with llama-server's parameters, defaults and chain order (common/sampling.cpp,
src/llama-sampler.cpp):

    logit_bias -> penalties -> top_k -> typical_p -> top_p -> min_p -> temperature -> dist

Every filter sees the logits left by the one before; top_p, typical_p and min_p measure probabilities at
temperature 1 (temperature is applied last, only to the survivors). Temperature <= 0 is greedy: the
highest logit after bias and penalties. The penalties count the last `repeat_last_n` tokens of the
prompt and the generation. The draw is llama.cpp's: one uniform double in [0, 1) scaled by the sum of
exp(logit - max) over the survivors, then the first candidate (in the chain's order) whose running sum
reaches it. The random stream is llama.cpp's too (std::mt19937 seeded with `seed`, read as libstdc++'s
uniform_real_distribution<double>), so a seed reproduces llama-server's draws: given the same probabilities,
a seeded request at a temperature picks llama-server's tokens.

A row on a GPU is not copied whole (a 248,320-token row is 1 MB: ~0.17 ms at the 6 GB/s that
bench/gpu_time_model.py assumes for a 2080 Ti's PCIe 3.0): biases, penalties and the argmax or top-k run there in
torch (`ranked_on_device`), the same float32 operations as the numpy path, and only the k candidates come over;
the rest of the chain and the draw run on the host as for a CPU row. A verification of drafts drawn from the chain
(engine.rejection) takes its rows' chains, ratio tests and draw in one C call (ops.verify_drawn), its rows ranked
together on their device (`rows_candidates_on_device`) or, on the host, in the call.
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops.sampling_chain import ChainParams, ChainShape, top_candidates
from .sampler_order import InfillVocab, StageParams, run_chain

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a fresh seed
HOST_DEVICES = frozenset({"cpu"})  # rows read by numpy; a row anywhere else is ranked on its device
DEVICE_TOP_MAX = 1024  # the most candidates ranked on a device (a larger top_k, or none, copies the row)
Ranked = tuple[np.ndarray, np.ndarray]  # (ids, logits after biases and penalties), the chain's order


def on_host(rows: torch.Tensor) -> bool:
    """Whether rows are read by numpy where they are (else they are ranked on their device)."""
    return rows.device.type in HOST_DEVICES


@dataclass
class SamplingParams:
    """llama-server's request fields and server defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_keep: int = 0
    seed: int = RANDOM_SEED
    logit_bias: dict[int, float] = field(default_factory=dict)  # -inf bans a token
    samplers: tuple[str, ...] | None = None  # the request's own stage order (sampler_order.py); None: the default

    @property
    def greedy(self) -> bool:
        """Temperature <= 0 in the default chain (in an own chain a temperature stage may come anywhere, or not)."""
        return self.temperature <= 0.0 and self.samplers is None

    @property
    def penalized(self) -> bool:
        """Whether any penalty is set (it changes logits once the window holds tokens)."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def stage_params(self) -> StageParams:
        return StageParams(self.top_k, self.top_p, self.min_p, self.typical_p, self.temperature, self.min_keep)


class Mt19937Uniform:
    """llama.cpp's random draws: std::mt19937 seeded with the request's seed, read through
    std::uniform_real_distribution<double>(0, 1) as libstdc++ computes it (generate_canonical: two 32-bit words,
    the first the low one). With the same seed and the same probabilities a request draws llama-server's tokens."""

    def __init__(self, seed: int) -> None:
        # numpy's legacy seeding of an integer is init_genrand, the state std::mt19937(seed) starts from (a third of
        # the time of the recurrence in Python, which cost each request ~0.3 ms: tests hold the two together)
        _, key, pos, *_ = np.random.RandomState(seed & 0xFFFFFFFF).get_state()
        self.bits = np.random.MT19937(0)
        self.bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
        self._ahead: list[float] = []  # draws looked at (`ahead`), not yet taken

    def random(self) -> float:
        return self._ahead.pop(0) if self._ahead else self._draw()

    def ahead(self, n: int) -> list[float]:
        """The next n draws without taking them: `random` or `skip` takes them in order."""
        while len(self._ahead) < n:
            self._ahead.append(self._draw())
        return self._ahead[:n]

    def skip(self, n: int) -> None:
        """Take n draws looked at with `ahead`."""
        del self._ahead[:n]

    def _draw(self) -> float:
        low, high = self.bits.random_raw(2).tolist()
        x = (low + high * 4294967296.0) / 18446744073709551616.0
        return x if x < 1.0 else math.nextafter(1.0, 0.0)


class Sampler:
    """One request's sampler: its penalty history and random stream."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = (), vocab: InfillVocab | None = None) -> None:
        self.params, self.vocab = params, vocab  # vocab: for an own chain's infill stage
        seed = params.seed
        if seed in (RANDOM_SEED, -1):
            seed = int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        self.rng = Mt19937Uniform(seed)
        n = params.repeat_last_n
        self.window: deque[int] = deque(maxlen=n if n > 0 else 0)
        self.counts: Counter[int] = Counter()
        self._device_bias: dict[tuple[torch.device, int], DeviceBias | None] = {}
        self._fixed: dict[int, tuple[ChainShape, ChainParams] | None] = {}
        for token in history:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Add a token (prompt or generated) to the penalty window."""
        if self.window.maxlen == 0:
            return
        if len(self.window) == self.window.maxlen:
            old = self.window[0]
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.window.append(token)
        self.counts[token] += 1

    @property
    def _penalizes(self) -> bool:
        """Whether the penalties change any logit now (they are set, and the window holds tokens)."""
        return self.params.penalized and bool(self.counts)

    def _biased(self, logits: torch.Tensor, penalties: bool = True) -> np.ndarray:
        """The logits after biases and (with `penalties`) penalties, as a float32 numpy row (a view where nothing
        changes them)."""
        p = self.params
        row = logits.float().numpy()
        penalize = penalties and self._penalizes
        if not p.logit_bias and not penalize:
            return row  # nothing to change: no copy (a fresh vocabulary-sized buffer a token)
        row = row.copy()
        for token, bias in p.logit_bias.items():
            if 0 <= token < len(row):
                row[token] += bias
        if penalize:
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            row[ids] = self._penalized(ids, row[ids])
        return row

    def _penalized(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """values (the logits of tokens `ids`) after the penalties for the window's counts."""
        p = self.params
        window = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
        order = np.argsort(ids)
        at = np.minimum(np.searchsorted(ids[order], window), len(ids) - 1)
        found = ids[order][at] == window  # the window's tokens among `ids` (all of them, or a top-k)
        counts = np.zeros(len(ids), dtype=np.float32)
        counts[order[at[found]]] = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))[found]
        seen = counts > 0
        repeated = np.where(values <= 0, values * np.float32(p.repeat_penalty), values / np.float32(p.repeat_penalty))
        penalized = repeated - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
        return np.where(seen, penalized, values).astype(np.float32)

    def _own_chain(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The request's own stage order over the whole row (sampler_order.py), biases first."""
        p = self.params
        row = self._biased(logits.to("cpu"), penalties=False)  # (a penalties stage applies them where it stands)
        penalize = self._penalized if self._penalizes else (lambda ids, values: values)
        assert p.samplers is not None
        return run_chain(np.arange(len(row)), row, p.samplers, p.stage_params(), penalize, self.vocab)

    def _unbiased_argmax(self, logits: torch.Tensor) -> int | None:
        """The greedy token without a biased copy of the logits, where that gives the same token: biases that only
        lower tokens (bans, `ignore_eos`) and no penalties cannot raise another token above the best unbiased one
        unless it is itself biased. None where the copy is needed."""
        p = self.params
        if self._penalizes or any(bias > 0 for bias in p.logit_bias.values()):
            return None
        best = _argmax(logits)
        return None if best in p.logit_bias else best

    def candidates(self, logits: torch.Tensor, ranked: Ranked | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, logits) of the tokens that survive the chain's filters, in the chain's order, with the
        temperature applied; a single token when greedy. `ranked`: the row's top-k, from `rows_ranked`."""
        ids, values = self._survivors(logits, ranked)
        return torch.from_numpy(ids), torch.from_numpy(values)

    def rows_ranked(self, rows: torch.Tensor) -> list[Ranked | None] | None:
        """Each row's top-k (`_ranked`; greedy: the best), for rows [R, V] left on a device that this chain reads
        alike (a verification's rows), ranked together there and copied in one (`rows_ranked_on_device`); None for
        a row whose k-th candidate ties the next. None for all where the rows are read on the host, or the chain's
        rows differ (penalties count the tokens kept before each) or need the whole row (a top-k of 0 or above
        DEVICE_TOP_MAX)."""
        p = self.params
        if rows.device.type in HOST_DEVICES or p.penalized or (p.top_k <= 0 and not p.greedy) or p.samplers:
            return None
        n = 1 if p.greedy else min(max(p.top_k, p.min_keep, 1), rows.shape[-1])
        return rows_ranked_on_device(rows, n, self._bias_on(rows)) if n <= DEVICE_TOP_MAX else None

    def fixed_chain(self, n_rows: int) -> tuple[ChainShape, ChainParams] | None:
        """The chain in fixed shapes over rows of `n_rows` (ops.sampling_chain, the C chain's), made once a width;
        None where a row needs this chain on the host: logit biases other than bans (-inf, as `ignore_eos` sets),
        penalties, typical-p, greedy, or a top-k of 0 (the whole vocabulary) or above DEVICE_TOP_MAX."""
        if n_rows not in self._fixed:
            p = self.params
            n_top = min(max(p.top_k, p.min_keep, 1), n_rows)
            bans = all(bias == float("-inf") for bias in p.logit_bias.values())
            fixed = bans and not (p.penalized or p.typical_p < 1.0 or p.greedy or p.top_k <= 0 or p.samplers)
            if not fixed or n_top > DEVICE_TOP_MAX or n_top + len(p.logit_bias) > n_rows:
                self._fixed[n_rows] = None
            else:
                banned = tuple(sorted(t for t in p.logit_bias if 0 <= t < n_rows))
                chain = ChainParams(p.top_p, p.min_p, p.temperature, banned)
                self._fixed[n_rows] = ChainShape(n_top, p.min_keep, bool(banned)), chain
        return self._fixed[n_rows]

    def rows_candidates(self, rows: torch.Tensor, n: int) -> np.ndarray | None:
        """The n + 1 highest of each of rows [R, V] left on a device, after the request's biases
        (`rows_candidates_on_device`); None where the vocabulary is too wide for their ids to come over as floats."""
        return None if rows.shape[-1] > 1 << 24 else rows_candidates_on_device(rows, n, self._bias_on(rows))

    def _bias_on(self, logits: torch.Tensor) -> DeviceBias | None:
        """The request's biases as tensors on the logits' device, made once."""
        key = (logits.device, logits.shape[-1])
        if key not in self._device_bias:
            bias = {t: b for t, b in self.params.logit_bias.items() if 0 <= t < logits.shape[-1]}
            self._device_bias[key] = DeviceBias.of(bias, logits.device)
        return self._device_bias[key]

    def _survivors(self, logits: torch.Tensor, ranked: Ranked | None = None) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        if p.samplers is not None:
            return self._own_chain(logits)
        if p.greedy:
            return ranked if ranked is not None else self._ranked(logits, 1)
        if ranked is not None:
            ids, values = ranked
        else:
            n = min(max(p.top_k, p.min_keep, 1), len(logits)) if p.top_k > 0 else len(logits)
            ids, values = self._ranked(logits, n)
        if p.typical_p < 1.0:
            values, ids = _typical(values, ids, p.typical_p, p.min_keep)
            order = np.argsort(-values, kind="stable")  # back to logit order for top_p
            values, ids = values[order], ids[order]
        if p.top_p < 1.0:
            values, ids = _top_p(values, ids, p.top_p, p.min_keep)
        if p.min_p > 0.0:
            values, ids = _min_p(values, ids, p.min_p, p.min_keep)
        return ids, values / np.float32(p.temperature)

    def _ranked(self, logits: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logits after biases and penalties) of the n highest, highest first, equal logits by id. A row on
        an accelerator is ranked there, and only the n come over (see `ranked_on_device`)."""
        if logits.device.type not in HOST_DEVICES:
            if n <= DEVICE_TOP_MAX and (ranked := self._ranked_on_device(logits, n)) is not None:
                return ranked
            logits = logits.to("cpu", torch.float32)  # a whole-vocabulary chain, or a tie at the n-th place
        if n == 1 and (best := self._unbiased_argmax(logits)) is not None:
            return np.array([best]), logits[best : best + 1].float().numpy()
        row = self._biased(logits)
        if n == 1:
            best = int(row.argmax())
            return np.array([best]), row[best : best + 1]
        ids = _top_n(row, n)
        return ids, row[ids]

    def _ranked_on_device(self, logits: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        p = self.params
        counts = self.counts if self._penalizes else {}
        bias = self._bias_on(logits)
        return ranked_on_device(logits, n, bias, counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)

    def sample(self, logits: torch.Tensor, ranked: Ranked | None = None) -> int:
        # greedy on the host: the best token without a ranked row (every Python step shows in a small model's decode)
        greedy = self.params.greedy and logits.device.type in HOST_DEVICES
        if greedy and (best := self._unbiased_argmax(logits)) is not None:
            self.rng.random()  # one draw per token, as below
            return best
        ids, values = self._survivors(logits, ranked)
        if len(ids) == 1:
            self.rng.random()  # one draw per token, as llama.cpp keeps its stream aligned
            return int(ids[0])
        cumulative = np.cumsum(np.exp(values - values.max()).astype(np.float64))
        target = float(cumulative[-1]) * self.rng.random()
        index = int(np.searchsorted(cumulative, target))
        return int(ids[min(index, len(ids) - 1)])

    def probabilities(self, logits: torch.Tensor, ranked: Ranked | None = None) -> dict[int, float]:
        """The distribution `sample` draws from (the ratio rule's p, post-sampling probabilities)."""
        ids, values = self.candidates(logits, ranked)
        probs = torch.softmax(values.double(), 0)
        return dict(zip(ids.tolist(), probs.tolist()))


def top_probabilities(logits: torch.Tensor, n: int, token: int | None = None) -> tuple[list[tuple[int, float]], float]:
    """The n most likely tokens of the raw softmax (llama-server's n_probs, post_sampling_probs false),
    and the probability of `token` (the one sampled) in the same distribution."""
    probs = torch.softmax(logits.float(), -1)
    values, ids = probs.topk(min(n, len(probs)))
    return list(zip(ids.tolist(), values.tolist())), float(probs[token]) if token is not None else 0.0


def post_sampling_probabilities(
    sampler: Sampler, logits: torch.Tensor, n: int, token: int
) -> tuple[list[tuple[int, float]], float]:
    """llama-server's post_sampling_probs: the n most likely tokens of the distribution the sampler draws from
    (after biases, penalties, top-k/typical/top-p/min-p and temperature), fewer when fewer survive, and the
    probability of `token` there (0 for a token the chain removed, e.g. one a reasoning budget forced)."""
    dist = sampler.probabilities(logits)
    top = sorted(dist.items(), key=lambda item: -item[1])[:n]
    return top, dist.get(token, 0.0)


@dataclass(frozen=True)
class DeviceBias:
    """A request's logit biases as tensors on one device, made once (a request's biases do not change)."""

    ids: torch.Tensor
    values: torch.Tensor
    tokens: frozenset[int]
    lowers_only: bool  # bans and other cuts: the best unbiased token stands unless it is itself biased

    @classmethod
    def of(cls, bias: dict[int, float], device: torch.device) -> DeviceBias | None:
        if not bias:
            return None
        ids = torch.tensor(list(bias), device=device)
        values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        return cls(ids, values, frozenset(bias), all(b <= 0 for b in bias.values()))


def ranked_on_device(
    logits: torch.Tensor,
    n: int,
    bias: DeviceBias | None,
    counts: dict[int, int],
    repeat_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """`Sampler._ranked`'s twin for a row left on its device: the biases, then the penalties of the tokens in
    `counts`, as the numpy path computes them (the same float32 operations in the same order), then the n highest
    found there; only they and the (n+1)-th come over, in one copy (ids as float32: exact below 2^24). None where
    the (n+1)-th ties the n-th (which of the tied ids the n take is decided by id, on the host's whole row), or the
    vocabulary is too large for that copy."""
    if len(logits) > 1 << 24:
        return None
    row = logits.float()
    if n == 1 and not counts and (bias is None or bias.lowers_only):  # the greedy token without a biased copy
        best = _best_on_device(row)
        if bias is None or int(best[0][0]) not in bias.tokens:
            return best
    if bias is not None or counts:
        row = row.clone()
    if bias is not None:
        row[bias.ids] += bias.values
    if counts:
        ids = torch.tensor(list(counts), device=row.device)
        n_seen = torch.tensor(list(counts.values()), dtype=torch.float32, device=row.device)
        values = row[ids]
        values = torch.where(values <= 0, values * np.float32(repeat_penalty), values / np.float32(repeat_penalty))
        row[ids] = values - n_seen * np.float32(frequency_penalty) - np.float32(presence_penalty)
    if n == 1:
        return _best_on_device(row)
    top_values, top_ids = top_candidates(row, min(n + 1, len(row)))
    values, ids = torch.stack((top_values, top_ids.float())).cpu().numpy()
    return _ranked_candidates(values, ids.astype(np.int64), n)


def rows_ranked_on_device(rows: torch.Tensor, n: int, bias: DeviceBias | None) -> list[Ranked | None]:
    """`ranked_on_device` for rows [R, V] without penalties: the biases, and each row's n highest found together,
    with the (n+1)-th, in one copy. Per row as `ranked_on_device` gives it, None where the (n+1)-th ties the n-th
    (n = 1: the first of tied best logits, as torch.max and numpy's argmax give it)."""
    if rows.shape[-1] > 1 << 24:
        return [None] * len(rows)
    rows = rows.float()
    if bias is not None:
        rows = rows.clone()
        rows[:, bias.ids] += bias.values
    if n == 1:
        best, where = rows.max(-1)
        packed = torch.stack((best, where.float()), -1).cpu().numpy()
        return [(row[1:].astype(np.int64), row[:1]) for row in packed]
    packed = rows_candidates_on_device(rows, n, None)
    k = packed.shape[-1] // 2
    return [_ranked_candidates(row[:k], row[k:].astype(np.int64), n) for row in packed]


def rows_candidates_on_device(rows: torch.Tensor, n: int, bias: DeviceBias | None) -> np.ndarray:
    """Each row's k = n + 1 highest logits (n where the row is no longer) after the biases, found together and
    copied in one: [R, 2k] float32, the values high to low, then their ids (exact below 2^24), their order among
    equal values open (`_ranked_candidates` and ops.verify_drawn order them by id)."""
    rows = rows.float()
    if bias is not None:
        rows = rows.clone()
        rows[:, bias.ids] += bias.values
    values, ids = top_candidates(rows, min(n + 1, rows.shape[-1]))
    return torch.cat((values, ids.float()), -1).cpu().numpy()


def _ranked_candidates(values: np.ndarray, ids: np.ndarray, n: int) -> Ranked | None:
    """The n highest of a device's top candidates (values high to low, the (n+1)-th last if it came), equal
    logits by id; None where the (n+1)-th ties the n-th (which of the tied ids the n take is decided by id, on the
    host's whole row)."""
    if len(ids) > n:
        if values[n] == values[n - 1]:
            return None
        ids, values = ids[:n], values[:n]
    order = np.lexsort((ids, -values))
    return ids[order], values[order]


def _best_on_device(row: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(id, logit) of the first largest logit (torch.max's index, as numpy's argmax), in one copy."""
    value, best = row.max(0)
    pair = torch.stack((value, best.float())).cpu().numpy()
    return pair[1:].astype(np.int64), pair[:1]


def _top_n(row: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n largest logits, largest first, equal logits by id (llama.cpp's partial sort leaves their
    order unspecified). Without sorting the vocabulary: split into 1,024 strided groups, the n-th largest group
    maximum bounds the n-th largest logit from below (n groups hold a logit at or above it), so only the logits at
    or above it are sorted. ~70 us over 248,320 logits where torch's topk takes ~450 us (bench/engine_overhead.py)."""
    if n >= len(row) or n > _CHUNKS // 2 or len(row) < 2 * _CHUNKS:
        return np.argsort(-row, kind="stable")[:n]
    maxima = row[: len(row) // _CHUNKS * _CHUNKS].reshape(-1, _CHUNKS).max(axis=0)  # group j: row[j::1024]
    bound = np.partition(maxima, _CHUNKS - n)[_CHUNKS - n]
    if bound == -np.inf:  # a masked row (a grammar's): the finite logits, then banned ones by id to make up n
        ids = np.flatnonzero(row > -np.inf)
        if len(ids) < n:
            banned = np.flatnonzero(row == -np.inf)[: n - len(ids)]
            return np.concatenate([ids[np.argsort(-row[ids], kind="stable")], banned])
    else:
        ids = np.flatnonzero(row >= bound)
    if len(ids) > 8 * n:  # many logits near the top (a flat row): narrow to the n-th largest among them first
        nth = np.partition(row[ids], len(ids) - n)[len(ids) - n]
        ids = ids[row[ids] >= nth]
    return ids[np.argsort(-row[ids], kind="stable")[:n]]


_CHUNKS = 1024


def _softmax(values: np.ndarray) -> np.ndarray:
    """llama.cpp's softmax: float32, the sum taken in order."""
    weights = np.exp(values - values.max())
    return weights / np.cumsum(weights)[-1]


def _top_p(values: np.ndarray, ids: np.ndarray, top_p: float, min_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the smallest prefix (values sorted descending) whose mass reaches top_p, at least min_keep."""
    cumulative = np.cumsum(_softmax(values))
    reached = np.flatnonzero(cumulative >= np.float32(top_p))
    keep = len(values) if len(reached) == 0 else int(reached[0]) + 1
    keep = max(keep, min(min_keep, len(values)))
    return values[:keep], ids[:keep]


def _min_p(values: np.ndarray, ids: np.ndarray, min_p: float, min_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p); at least min_keep."""
    threshold = np.float32(float(values.max()) + math.log(min_p))
    keep = values >= threshold
    if int(keep.sum()) < max(min_keep, 1):
        keep[: max(min_keep, 1)] = True  # values are sorted: the best ones
    return values[keep], ids[keep]


def _typical(values: np.ndarray, ids: np.ndarray, typical_p: float, min_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling: order by |-log p - entropy|, keep until the mass exceeds typical_p."""
    probs = _softmax(values)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)
        entropy = -np.nansum(probs * logp)
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    cumulative = np.cumsum(probs[order])
    past = np.flatnonzero(cumulative > np.float32(typical_p))
    keep = len(values) if len(past) == 0 else int(past[0]) + 1
    keep = max(keep, min(min_keep, len(values)))
    chosen = order[:keep]
    return values[chosen], ids[chosen]


def _argmax(logits: torch.Tensor) -> int:
    """The first index of the largest logit, as torch's argmax gives it; through numpy, which reads a 248,320-token
    row in ~20 us where torch's threaded reduction takes ~250 us on the engine's thread (bench/engine_overhead.py)."""
    return int(logits.float().numpy().argmax())
