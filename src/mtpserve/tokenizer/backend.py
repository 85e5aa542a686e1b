"""A `tokenizers.Tokenizer` (Hugging Face's Rust library) built from a `Vocab`, giving llama.cpp's token ids.

* `gpt2` (byte-level BPE): the library's BPE model on the GGUF tokens and merges; one `Split(regex,
  "isolated")` per llama.cpp regex, in sequence, then `ByteLevel` without its own regex: the same steps
  as llama.cpp's `llm_tokenizer_bpe_session`. `ignore_merges` is the BPE option of the same name. Merges
  whose parts or result are not tokens are dropped (the library cannot hold them; none of the
  vocabularies here has one).
* `llama` (SentencePiece with scores): llama.cpp starts from characters and merges, again and again, the
  adjacent pair whose concatenation is a token with the highest score (leftmost on a tie), then falls
  back to `<0xXX>` byte tokens for characters outside the vocabulary. That is BPE with one merge per way
  of cutting a token into two tokens, ranked by the token's score: derived here (about 1 s for Gemma's
  262k tokens, faster than reloading a saved tokenizer.json) and given to the library's BPE with
  `byte_fallback`. Spaces become `▁` and, with `add_space_prefix`, one `▁` starts every text fragment (a
  normalizer; llama.cpp prefixes every fragment too, as each one follows a special token or the start).
  Rank ties: the library breaks them by merge rank, llama.cpp by position; among equal scores the rank
  follows the token id. Gemma 3's multi-character tokens all have distinct scores.
* Special tokens: CONTROL/UNKNOWN tokens become "special" added tokens, USER_DEFINED ones plain added
  tokens, all matched on the raw text. The library's `encode_special_tokens` switch then gives llama.cpp's
  `parse_special=false`: control tokens are plain text, user-defined ones are still split out. The
  library matches leftmost-longest where llama.cpp splits by the longest token first over the whole
  text: the same unless two special tokens overlap by a proper prefix/suffix.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from ..gguf import GGUFError
from .vocab import PARSE_SPECIAL_ATTRS, SPLIT_ATTRS, Vocab


def build_backend(vocab: Vocab) -> HFTokenizer:
    """The Rust tokenizer for `vocab`, with special tokens registered (ids checked against the GGUF)."""
    texts = _library_texts(vocab.tokens)
    ids = {text: i for i, text in enumerate(texts)}
    if vocab.model == "gpt2":
        assert vocab.pre_tokenizer is not None
        merges = _usable_merges(vocab.merges, ids)
        tok = HFTokenizer(BPE(ids, merges, ignore_merges=vocab.pre_tokenizer.ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), "isolated") for rx in vocab.pre_tokenizer.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        unk = vocab.special["unk"]
        tok = HFTokenizer(
            BPE(
                ids,
                score_merges(texts, vocab.scores.tolist()),
                byte_fallback=True,
                unk_token=texts[unk] if unk is not None else None,
            )
        )
        steps = [normalizers.Replace(" ", "▁")]
        if vocab.add_space_prefix:
            steps.append(normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(steps)

    split = np.flatnonzero(vocab.attrs & int(SPLIT_ATTRS)).tolist()
    special = (vocab.attrs & int(PARSE_SPECIAL_ATTRS)).astype(bool).tolist()
    tok.add_tokens([AddedToken(texts[i], special=special[i], normalized=False) for i in split])
    for i in split:
        if tok.token_to_id(texts[i]) != i:
            raise GGUFError(vocab.source, f"special token {texts[i]!r} maps to id {tok.token_to_id(texts[i])}, not {i}")
    return tok


def score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's score-driven SentencePiece merging: every (a, b) with a, b and
    a + b all tokens, best score of a + b first, ties by token id."""
    ids = {text: i for i, text in enumerate(tokens)}
    found: list[tuple[float, int, str, str]] = []
    for text, i in ids.items():
        for cut in range(1, len(text)):
            left = text[:cut]
            if left in ids:
                right = text[cut:]
                if right in ids:
                    found.append((-scores[i], i, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def _usable_merges(merges: list[tuple[str, str]], ids: dict[str, int]) -> list[tuple[str, str]]:
    """The merges the library can hold: parts and result in the vocab, each pair once (first rank wins, as
    in llama.cpp's rank map)."""
    seen: set[tuple[str, str]] = set()
    usable = []
    for pair in merges:
        left, right = pair
        if pair not in seen and left in ids and right in ids and left + right in ids:
            seen.add(pair)
            usable.append(pair)
    return usable


def _library_texts(tokens: list[str]) -> list[str]:
    """Token texts the Rust library accepts: a token that is not valid UTF-8 (kept as surrogate escapes)
    can never come out of encoding a Python string, so it gets a placeholder name there."""
    try:
        "".join(tokens).encode("utf-8")
        return tokens
    except UnicodeEncodeError:
        out = list(tokens)
        for i, text in enumerate(out):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                out[i] = f"[INVALID_UTF8_{i}]"
        return out
