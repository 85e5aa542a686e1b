"""`Tokenizer`: text to llama.cpp's token ids and back, for any GGUF file, from its metadata alone.

Encoding runs in the Rust `tokenizers` library (built by `backend.py`); BOS/EOS are added here by the
GGUF's `add_bos_token`/`add_eos_token`. Decoding is ours, because it must be llama.cpp's
`token_to_piece`, which the library has no notion of: a piece is the bytes a token stands for (GPT-2
byte characters mapped back to bytes, `▁` back to a space, `<0xXX>` to its byte), control tokens render
as their text only when asked, user-defined tokens always as their text. `decode` concatenates pieces the
way llama-server builds its output and its /detokenize answer: no space-prefix stripping and no
clean-up of spaces before punctuation (those belong to `llama_detokenize`, which the server does not use).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..gguf import GGUFError, GGUFFile, open_gguf
from .backend import build_backend
from .vocab import PARSE_SPECIAL_ATTRS, Attr, Vocab, load_vocab


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, reversed (llama.cpp `unicode_utf8_to_byte_map`)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + n) for n, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()


class Tokenizer:
    """A GGUF vocabulary as a tokenizer. Build with `Tokenizer.from_gguf(path_or_file)`.

    Thread-safe, and encodes run at once and outside the GIL: the library's special-token switch belongs to its
    tokenizer object, so each setting has its own copy, never switched while in use; and its `encode` holds the
    GIL for the whole text (a 0.6 MB prompt: 0.5 s during which no other request's thread ran) where
    `encode_batch` releases it.
    """

    def __init__(self, vocab: Vocab, backend: HFTokenizer | None = None) -> None:
        if vocab.add_bos and vocab.special["bos"] is None:
            raise GGUFError(vocab.source, "add_bos_token is set but the vocabulary has no BOS token")
        if vocab.add_eos and vocab.special["eos"] is None:
            raise GGUFError(vocab.source, "add_eos_token is set but the vocabulary has no EOS token")
        self.vocab = vocab
        self.backend = backend if backend is not None else build_backend(vocab)
        self._lock = threading.Lock()
        self._backends = {self.backend.encode_special_tokens: self.backend}  # by encode_special_tokens
        self._attrs = vocab.attrs.tolist()
        self._pieces: list[bytes | None] = [None] * vocab.n_tokens

    @classmethod
    def from_gguf(cls, source: GGUFFile | str | Path) -> Tokenizer:
        """The tokenizer of a GGUF file (a path or an opened `GGUFFile`); reads metadata only, no weights."""
        gguf = source if isinstance(source, GGUFFile) else open_gguf(source)
        return cls(load_vocab(gguf.metadata, gguf.path))

    # -- vocabulary facts ------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_tokens

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special["eot"]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation (llama.cpp's EOG set: EOS, EOT, `<|im_end|>`-like tokens, FIM pad...)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def chat_template(self) -> str | None:
        """The GGUF's default chat template (`tokenizer.chat_template`), None when it has none."""
        return self.vocab.chat_template

    @property
    def named_chat_templates(self) -> Mapping[str, str]:
        """The GGUF's named chat templates (`tokenizer.chat_template.NAME`, such as `tool_use`)."""
        return self.vocab.named_chat_templates

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def is_special(self, token_id: int) -> bool:
        """A control (or unknown) token: rendered only on request, parsed from text only with parse_special."""
        return bool(self._attrs[self._check(token_id)] & PARSE_SPECIAL_ATTRS)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (byte-level characters, `▁`, `<0x0A>`, ...)."""
        return self.vocab.tokens[self._check(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of the token whose stored text is exactly `text`, if any."""
        return self.backend.token_to_id(text)

    # -- encoding --------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special adds BOS/EOS where the vocabulary says so; parse_special reads control-token text such
        as `<|im_start|>` as that token (user-defined tokens are always read as tokens, as in llama.cpp).
        """
        ids = self._backend(parse_special).encode_batch([text], add_special_tokens=False)[0].ids
        if add_special:
            if self.vocab.add_bos:
                ids.insert(0, self.vocab.special["bos"])
            if self.vocab.add_eos:
                ids.append(self.vocab.special["eos"])
        return ids

    def encode_batch(self, texts: list[str], add_special: bool = True, parse_special: bool = False) -> list[list[int]]:
        """`encode` of many texts at once, spread over the library's threads."""
        batch = [e.ids for e in self._backend(parse_special).encode_batch(texts, add_special_tokens=False)]
        if add_special and (self.vocab.add_bos or self.vocab.add_eos):
            bos = [self.vocab.special["bos"]] if self.vocab.add_bos else []
            eos = [self.vocab.special["eos"]] if self.vocab.add_eos else []
            batch = [bos + ids + eos for ids in batch]
        return batch

    def _backend(self, parse_special: bool) -> HFTokenizer:
        """The library's tokenizer reading control-token text as tokens (`parse_special`) or as text; the second
        setting a copy made on first use (0.4 s at 152K tokens)."""
        plain_text = not parse_special
        backend = self._backends.get(plain_text)
        if backend is None:
            with self._lock:
                if plain_text not in self._backends:
                    copy = HFTokenizer.from_str(self.backend.to_str())
                    copy.encode_special_tokens = plain_text
                    self._backends[plain_text] = copy
                backend = self._backends[plain_text]
        return backend

    # -- decoding --------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes token `token_id` stands for (llama.cpp `token_to_piece`); control tokens give b""
        unless `special`. A piece may be part of a UTF-8 character (byte tokens, split CJK/emoji)."""
        attr = self._attrs[self._check(token_id)]
        if not special and attr & PARSE_SPECIAL_ATTRS:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, Attr(attr))
        return piece

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """`token_bytes` as text (an incomplete UTF-8 character shows as U+FFFD)."""
        return self.token_bytes(token_id, special).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False, keep_special: Collection[int] = ()) -> str:
        """The text of `ids`: their pieces joined, as llama-server builds generated text.

        skip_special drops control tokens' text except those in keep_special (the server's "preserved"
        tokens, e.g. `<think>`). Bytes that never form valid UTF-8 become U+FFFD.
        """
        pieces = (self.token_bytes(i, not skip_special or i in keep_special) for i in ids)
        return b"".join(pieces).decode("utf-8", errors="replace")

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab.n_tokens:
            raise ValueError(f"token id {token_id} is out of range for a vocabulary of {self.vocab.n_tokens}")
        return token_id

    def _piece(self, token_id: int, attr: Attr) -> bytes:
        text = self.vocab.tokens[token_id]
        raw = text.encode("utf-8", errors="surrogateescape")
        if attr & (Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED):
            return raw
        if attr & Attr.NORMAL:
            if self.vocab.model == "gpt2":
                # A character outside GPT-2's byte table keeps its UTF-8 (llama.cpp writes "[UNK_BYTE_..]").
                return b"".join(
                    bytes((_BYTE_DECODER[c],)) if c in _BYTE_DECODER else c.encode("utf-8", "surrogateescape")
                    for c in text
                )
            return raw.replace("▁".encode(), b" ")
        if attr & Attr.BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes((int(text[3:5], 16),))
        return b""  # unused / undefined tokens render as nothing, as in llama.cpp

    def __repr__(self) -> str:
        return f"Tokenizer({self.vocab.model}/{self.vocab.pre or '-'}, {self.n_vocab} tokens, {self.vocab.source})"
