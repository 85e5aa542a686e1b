"""A request's own sampler chain (llama-server's `samplers` field): the stages in the order the request names them,
as common_sampler_init builds the chain (logit biases first, the named stages, then the draw), and llama.cpp's
`infill` stage, which editor clients (llama.vim, llama.vscode) ask for with `["top_k", "top_p", "infill"]`.

A stage not named is not applied: without "temperature" the draw is at temperature 1 (a request's temperature 0 is
greedy only where "temperature" is in the chain), without "penalties" no penalty counts. Each stage keeps llama.cpp's
candidate order, since the draw takes the first candidate in that order whose running sum reaches the target: top-k,
top-p and infill sort by logit; min-p and the temperature keep the order; typical-p orders by typicality.
The default order (sampling.py's fixed chain) is used where the request names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# llama.cpp's names (common_sampler_types_from_names) and chars (common_sampler_types_from_chars)
CANONICAL = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties")
ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"} | {
    alias: name for name in CANONICAL if "_" in name for alias in (name.replace("_", "-"), name.replace("_", ""))
}
CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p", "t": "temperature"}
CHARS |= {"x": "xtc", "i": "infill", "e": "penalties"}
# stages whose parameters the server refuses to set (server/params.py): at their defaults they change nothing
NO_OPS = frozenset({"dry", "top_n_sigma", "xtc"})
DEFAULT_ORDER = ("penalties", "top_k", "typ_p", "top_p", "min_p", "temperature")  # llama-server's, without NO_OPS


def stage_names(value: object) -> tuple[str, ...] | None:
    """`samplers` (an array of names, or a string of chars) as canonical stage names without the no-ops; None where
    it is llama-server's default order. A ValueError names what is not a stage."""
    if isinstance(value, str):
        unknown = sorted({c for c in value if c not in CHARS})
        if unknown:
            raise ValueError(f"unknown sampler chars {unknown} (known: {''.join(CHARS)})")
        names = [CHARS[c] for c in value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        lowered = [v.lower() for v in value]
        unknown = sorted({v for v in lowered if v not in CANONICAL and v not in ALIASES})
        if unknown:
            raise ValueError(f"unknown sampler names {unknown} (known: {', '.join(CANONICAL)})")
        names = [ALIASES.get(v, v) for v in lowered]
    else:
        raise ValueError("expected an array of sampler names or a string of sampler chars")
    stages = tuple(n for n in names if n not in NO_OPS)
    return None if stages == DEFAULT_ORDER else stages


@dataclass(frozen=True)
class InfillVocab:
    """What the infill stage reads of the vocabulary: a token's text (b"" for control tokens) and the end tokens."""

    piece: Callable[[int], bytes]
    eog_ids: frozenset[int]
    end_token: int  # EOT, else EOS: the one candidate left when no text token is likely enough


@dataclass(frozen=True)
class StageParams:
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    temperature: float
    min_keep: int


def run_chain(
    ids: np.ndarray,
    values: np.ndarray,
    stages: tuple[str, ...],
    p: StageParams,
    penalize: Callable[[np.ndarray, np.ndarray], np.ndarray],
    vocab: InfillVocab | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (ids, float32 logits) the draw reads, in llama.cpp's order, after `stages` over every token
    (ids in vocabulary order, logits after the biases)."""
    from .sampling import _min_p, _top_n, _top_p, _typical  # the default chain's stages (sampling.py imports this)

    ordered = False
    for stage in stages:
        if stage == "penalties":
            values, ordered = penalize(ids, values), False  # (llama.cpp marks the list unsorted)
        elif stage == "top_k" and p.top_k > 0:
            order = _top_n(values, min(p.top_k, len(values)))
            ids, values, ordered = ids[order], values[order], True
        elif stage == "typ_p" and p.typical_p < 1.0:
            ids, values, _ = _sorted(ids, values, ordered)
            values, ids = _typical(values, ids, p.typical_p, p.min_keep)
            ordered = False
        elif stage == "top_p" and p.top_p < 1.0:
            ids, values, ordered = _sorted(ids, values, ordered)
            values, ids = _top_p(values, ids, p.top_p, p.min_keep)
        elif stage == "min_p" and p.min_p > 0.0:
            ids, values, ordered = _min_p_in_order(ids, values, ordered, p, _min_p)
        elif stage == "temperature":
            if p.temperature <= 0.0:
                best = int(np.argmax(values))  # the first of the highest, as llama.cpp's scan
                ids, values = ids[best : best + 1], values[best : best + 1]
            else:
                values = values / np.float32(p.temperature)
        elif stage == "infill":
            if vocab is None:
                raise ValueError("the infill sampler needs the vocabulary")
            ids, values, ordered = infill(ids, values, ordered, vocab)
    return ids, values


def _min_p_in_order(
    ids: np.ndarray, values: np.ndarray, ordered: bool, p: StageParams, sorted_min_p: Callable
) -> tuple[np.ndarray, np.ndarray, bool]:
    """llama.cpp's min-p: on an unsorted list the tokens at or above max + log(min_p) in their order, where that
    leaves at least min_keep; else (and on a sorted list) the sorted list's best ones."""
    if not ordered:
        keep = values >= np.float32(float(values.max()) + math.log(p.min_p))
        if keep.any() and int(keep.sum()) >= p.min_keep:
            return ids[keep], values[keep], False
        ids, values, ordered = _sorted(ids, values, ordered)
    values, ids = sorted_min_p(values, ids, p.min_p, p.min_keep)
    return ids, values, True


def _sorted(ids: np.ndarray, values: np.ndarray, ordered: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    if ordered:
        return ids, values, True
    order = np.argsort(-values, kind="stable")
    return ids[order], values[order], True


def infill(
    ids: np.ndarray, values: np.ndarray, ordered: bool, vocab: InfillVocab
) -> tuple[np.ndarray, np.ndarray, bool]:
    """llama.cpp's infill sampler (llama_sampler_infill_apply), float32 as it computes: if the end tokens hold
    enough of the mass (3 x p_eog x n > p_text), only they are left; else a token whose text begins another's takes
    that one's probability (into whichever is likelier), then text tokens below 0.2 are dropped, then, among the
    rest renormalized, those below 1 / (texts + 1); none left: the end token alone. The draw after it weighs the
    survivors by their own logits (llama.cpp's dist recomputes them), so the merged probabilities only choose."""
    ids, values, _ = _sorted(ids, values, ordered)
    f32 = np.float32
    weights = np.exp(values - values[0]).astype(f32)
    total = f32(0.0)
    for w in weights:
        total = f32(total + w)
    probs = [f32(w / total) for w in weights]
    eog = [int(t) in vocab.eog_ids for t in ids]
    p_text, p_eog = f32(0.0), f32(0.0)
    for pr, is_eog in zip(probs, eog):
        if is_eog:
            p_eog = f32(p_eog + pr)
        else:
            p_text = f32(p_text + pr)
    if f32(f32(3.0) * p_eog * f32(len(ids))) > p_text:
        keep = np.array(eog, dtype=bool)
        return ids[keep], values[keep], True

    logits = [float(v) for v in values]
    pieces = [vocab.piece(int(t)) for t in ids]
    for i0 in range(len(ids)):
        for i1 in range(len(ids)):
            if logits[i0] == -math.inf:
                break
            if i0 == i1 or logits[i1] == -math.inf:
                continue
            a, b = pieces[i0], pieces[i1]
            if 0 < len(a) <= len(b) and b.startswith(a):  # token i0's text begins token i1's
                dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
                probs[dst] = f32(probs[dst] + probs[src])
                logits[src], probs[src] = -math.inf, f32(0.0)

    kept, n_text, mass = [], 0, f32(0.0)
    for i, (pr, is_eog) in enumerate(zip(probs, eog)):
        if pr < f32(0.2) and not is_eog:
            continue
        n_text += not is_eog
        mass = f32(mass + pr)
        kept.append(i)
    if n_text == 0:
        return np.array([vocab.end_token]), np.array([1.0], dtype=f32), True
    threshold = f32(1.0 / (n_text + 1))
    final = [i for i in kept if not (f32(probs[i] / mass) < threshold and not eog[i])]
    out_values = np.array([logits[i] for i in final], dtype=f32)
    return ids[final], out_values, True
