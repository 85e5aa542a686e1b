"""The vocabulary as llama.cpp loads it from GGUF metadata (src/llama-vocab.cpp, `llama_vocab::impl::load`).

Plain data and llama.cpp's load-time rules, no tokenizer library: the defaults per tokenizer model
(`gpt2` byte-level BPE: BOS/EOS id 11, no BOS added; `llama` SentencePiece: BOS 1, EOS 2, UNK 0, BOS added,
a space prefix), the flags of the pre-tokenizer, then the GGUF keys over them; the special-token ids,
including llama.cpp's detection by text of EOT/EOM/FIM tokens when the keys are absent; the attribute
fix-ups (a control-looking token of the wrong type becomes CONTROL, gpt-oss channel tokens USER_DEFINED);
and the end-of-generation set. Where llama.cpp picks "the first match" while iterating a hash map, this
takes the first text in its list order, which is deterministic.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import TokenType

from ..gguf import GGUFError, Metadata
from .pretokenizers import PreTokenizer, pre_tokenizer_for


class Attr(enum.IntFlag):
    """llama.cpp's token attributes (`llama_token_attr`), the part GGUF token types map onto."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_TYPE_ATTR = {
    TokenType.NORMAL: Attr.NORMAL,
    TokenType.UNKNOWN: Attr.UNKNOWN,
    TokenType.CONTROL: Attr.CONTROL,
    TokenType.USER_DEFINED: Attr.USER_DEFINED,
    TokenType.UNUSED: Attr.UNUSED,
    TokenType.BYTE: Attr.BYTE,
}
# Tokens split out of the text before BPE (llama.cpp's special-token cache); CONTROL/UNKNOWN only on request.
SPLIT_ATTRS = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN
PARSE_SPECIAL_ATTRS = Attr.CONTROL | Attr.UNKNOWN

SUPPORTED_MODELS = ("gpt2", "llama")
# `llama` (SentencePiece) merges are derived by cutting every token at every position (backend.score_merges),
# which costs the square of a token's length: a longer token is refused (real vocabularies stay under 200).
MAX_SPM_TOKEN_CHARS = 1024

# Special ids: GGUF key suffix (tokenizer.ggml.<key>) per name; the deprecated prefix/suffix/middle keys last.
_ID_KEYS = {
    "bos": ("bos_token_id",),
    "eos": ("eos_token_id",),
    "eot": ("eot_token_id",),
    "eom": ("eom_token_id",),
    "unk": ("unknown_token_id",),
    "sep": ("seperator_token_id",),  # sic: the GGUF spelling
    "pad": ("padding_token_id",),
    "mask": ("mask_token_id",),
    "fim_pre": ("fim_pre_token_id", "prefix_token_id"),
    "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid": ("fim_mid_token_id", "middle_token_id"),
    "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",),
    "fim_sep": ("fim_sep_token_id",),
}
# Texts llama.cpp recognises when the id is not in the metadata (the chosen token becomes CONTROL).
_DETECT_TEXTS = {
    "eot": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts whose tokens end generation (llama.cpp's `special_eog_ids`, built from token text).
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
_GPT_OSS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True, eq=False)
class Vocab:
    """A GGUF vocabulary with llama.cpp's rules applied. `tokens[i]` is token i's text as stored (byte-level
    characters for `gpt2`, `▁` for spaces for `llama`); invalid UTF-8 in a token is kept as surrogate escapes."""

    source: str
    model: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str]
    attrs: np.ndarray  # uint8 Attr per token
    scores: np.ndarray  # float32 per token (0 where the file has none)
    merges: list[tuple[str, str]]  # gpt2 only, in rank order
    pre_tokenizer: PreTokenizer | None  # gpt2 only
    special: dict[str, int | None]  # bos, eos, eot, eom, unk, sep, pad, mask, fim_*
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]
    chat_template: str | None
    named_chat_templates: dict[str, str]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def attr(self, token_id: int) -> Attr:
        return Attr(int(self.attrs[token_id]))


def load_vocab(metadata: Mapping[str, Any], source: str | Path) -> Vocab:
    """Read a GGUF file's vocabulary from its metadata; a missing or unusable key is a `GGUFError`."""
    md = Metadata(metadata, source)
    model = md.get_str("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        supported = ", ".join(SUPPORTED_MODELS)
        raise GGUFError(source, f"tokenizer model '{model}' is not supported (supported: {supported})")
    tokens = list(md.get_str_list("tokenizer.ggml.tokens"))
    n = len(tokens)
    if n == 0:
        raise GGUFError(source, "the vocabulary (tokenizer.ggml.tokens) is empty")
    for i, text in enumerate(tokens):
        if not text:  # llama.cpp renames empty tokens the same way
            tokens[i] = f"[EMPTY_{i}]"
    token_to_id = {text: i for i, text in enumerate(tokens)}
    if len(token_to_id) != n:  # llama.cpp asserts the same
        dup = next(t for i, t in enumerate(tokens) if token_to_id[t] != i)
        raise GGUFError(source, f"token text {dup!r} appears twice in tokenizer.ggml.tokens")

    # Numeric GGUF arrays arrive as 1-D numpy arrays; anything else (a list of strings or of arrays) is refused.
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        attrs = np.full(n, int(Attr.NORMAL), dtype=np.uint8)
    else:
        if not isinstance(types, np.ndarray) or types.ndim != 1 or types.dtype.kind not in "iu" or len(types) < n:
            raise GGUFError(source, f"tokenizer.ggml.token_type should be {n} integers")
        table = np.zeros(max(_TYPE_ATTR) + 1, dtype=np.uint8)
        for token_type, attr in _TYPE_ATTR.items():
            table[int(token_type)] = int(attr)
        types = types[:n]
        known = (types >= 0) & (types < len(table))
        # Unknown types (negative, or beyond the table) stay UNDEFINED, as in llama.cpp.
        attrs = np.where(known, table[np.where(known, types, 0)], 0).astype(np.uint8)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        scores = np.zeros(n, dtype=np.float32)
    else:
        if not isinstance(scores, np.ndarray) or scores.ndim != 1 or scores.dtype.kind not in "iuf" or len(scores) < n:
            raise GGUFError(source, f"tokenizer.ggml.scores should be {n} numbers")
        scores = scores[:n].astype(np.float32)

    pre = md.get_str("tokenizer.ggml.pre", "")
    merges: list[tuple[str, str]] = []
    pre_tokenizer = None
    if model == "gpt2":
        try:
            pre_tokenizer = pre_tokenizer_for(pre)
        except ValueError as e:
            raise GGUFError(source, str(e)) from None
        for merge in md.get_str_list("tokenizer.ggml.merges"):
            cut = merge.find(" ", 1)  # the first space after the first character, as llama.cpp splits
            if cut > 0:
                merges.append((merge[:cut], merge[cut + 1 :]))
        special = dict.fromkeys(_ID_KEYS, None) | {"bos": 11, "eos": 11}
        add_bos, add_eos, add_space_prefix = pre_tokenizer.add_bos, False, False
    else:
        long = next((i for i, text in enumerate(tokens) if len(text) > MAX_SPM_TOKEN_CHARS), None)
        if long is not None:
            chars = len(tokens[long])
            limit = f"at most {MAX_SPM_TOKEN_CHARS} in a 'llama' vocabulary"
            raise GGUFError(source, f"token {long} of tokenizer.ggml.tokens is {chars} characters long ({limit})")
        special = dict.fromkeys(_ID_KEYS, None) | {"bos": 1, "eos": 2, "unk": 0}
        add_bos, add_eos, add_space_prefix = True, False, True
    add_space_prefix = md.get_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    add_bos = md.get_bool("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = md.get_bool("tokenizer.ggml.add_eos_token", add_eos)

    for name, keys in _ID_KEYS.items():
        if special[name] is not None and special[name] >= n:  # a default outside this vocab is disabled
            special[name] = None
        for key in keys:
            value = md.get_int(f"tokenizer.ggml.{key}", None)
            if value is not None and 0 <= value < n:  # out of range: llama.cpp warns and keeps the default
                special[name] = value
                break

    def make_control(token_id: int) -> None:
        attrs[token_id] |= Attr.CONTROL

    for name, texts in _DETECT_TEXTS.items():
        if special[name] is None:
            found = next((token_to_id[t] for t in texts if t in token_to_id), None)
            if found is not None:
                special[name] = found
                make_control(found)

    eog = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}
    for text in _EOG_TEXTS:
        if text in token_to_id:
            eog.add(token_to_id[text])
            make_control(token_to_id[text])
    for text in _GPT_OSS_RENDERED:
        if text in token_to_id:
            attrs[token_to_id[text]] = Attr.USER_DEFINED
    eog |= {special[k] for k in ("eos", "eot", "eom") if special[k] is not None}
    eog_texts = {tokens[i] for i in eog}
    # gpt-oss / solar-open: "<|end|>" ends a message, not the generation, when return/call tokens exist.
    end = token_to_id.get("<|end|>")
    has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
    if end in eog and has_call and bool(eog_texts & {"<|return|>", "<|flush|>"}):
        eog.discard(end)
        attrs[end] = Attr.USER_DEFINED
    # gemma4 / plamo: "</s>" is an ordinary token there.
    close_s = token_to_id.get("</s>")
    if close_s in eog and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(close_s)
        attrs[close_s] = Attr.NORMAL

    prefix = "tokenizer.chat_template."
    named = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix) and isinstance(v, str)}
    return Vocab(
        source=str(source),
        model=model,
        pre=pre,
        tokens=tokens,
        attrs=attrs,
        scores=scores,
        merges=merges,
        pre_tokenizer=pre_tokenizer,
        special=special,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        eog_ids=frozenset(eog),
        chat_template=md.get_str("tokenizer.chat_template", None),
        named_chat_templates=named,
    )
