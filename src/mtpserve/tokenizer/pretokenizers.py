"""The pre-tokenizers of byte-level BPE vocabularies, chosen by the GGUF key `tokenizer.ggml.pre`.

llama.cpp (src/llama-vocab.cpp, `llm_tokenizer_bpe`) splits text with a *sequence* of regexes, each one
splitting the pieces the previous one produced, then byte-encodes each piece and runs BPE on it. The
regexes here are llama.cpp's, written out once per family; the names map onto them as llama.cpp's loader
maps `tokenizer.ggml.pre` onto its pre-tokenizer types, together with the two per-type flags that change
tokens (`ignore_merges`: a piece that is a whole token is taken as it is; `add_bos`: the default for
`tokenizer.ggml.add_bos_token`). Families whose llama.cpp splitter is hand-written beyond a regex
(kimi-k2, afmoe, gemma4, ...) are not listed: an unknown name is an error naming the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama.cpp's own rewrite of `(?i:'s|...)` as explicit case classes (its splitter has no (?i:)).
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regex sequence and the flags it sets."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_FAMILIES: dict[PreTokenizer, tuple[str, ...]] = {
    PreTokenizer(DEFAULT): ("default",),
    PreTokenizer((GPT2,)): (
        "gpt-2",
        "phi-2",
        "jina-es",
        "jina-de",
        "gigachat",
        "jina-v2-es",
        "jina-v2-de",
        "a.x-4.0",
        "mellum",
        "modern-bert",
        "mpt",
        "olmo",
        "jais",
        "trillion",
        "granite-docling",
        "exaone4",
    ),
    PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True): (
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
    ),
    PreTokenizer((LLAMA3,)): ("dbrx", "smaug-bpe"),
    PreTokenizer((QWEN2,)): (
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "megrez",
        "stablelm2",
        "hunyuan",
        "solar-open",
    ),
    PreTokenizer((QWEN35,)): ("qwen35",),
    # StarCoder family: every digit on its own, then the GPT-2 regex.
    PreTokenizer((r"\p{N}", GPT2)): (
        "starcoder",
        "refact",
        "command-r",
        "smollm",
        "codeshell",
        "exaone",
        "minerva-7b",
        "mellum2",
    ),
}

PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for pre, names in _FAMILIES.items() for name in names}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre = name` (empty: 'default', as llama.cpp).

    Raises ValueError naming the supported names when `name` is not one of them.
    """
    try:
        return PRE_TOKENIZERS[name or "default"]
    except KeyError:
        raise ValueError(
            f"unknown pre-tokenizer '{name}' (tokenizer.ggml.pre); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        ) from None
