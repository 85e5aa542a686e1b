"""Streaming detokenization: token ids in, text out, never a broken character.

A token may end in the middle of a UTF-8 character (byte tokens, CJK or emoji split by BPE), so pieces
are fed to Python's incremental UTF-8 decoder, which holds back an incomplete tail until the next bytes
complete it (llama-server holds back the same tail, `validate_utf8`). Bytes that can never form a
character become U+FFFD exactly where a one-shot decode puts them, so the outputs joined, plus `flush()`,
equal `Tokenizer.decode` of the same ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Decode one token at a time for streaming; `skip_special`/`keep_special` as in `Tokenizer.decode`."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, keep_special: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.keep_special = frozenset(keep_special)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text that token completes (possibly "", while a character is still incomplete)."""
        special = not self.skip_special or token_id in self.keep_special
        return self._decoder.decode(self.tokenizer.token_bytes(token_id, special), final=False)

    def add_many(self, ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """End of stream: an incomplete trailing character comes out as U+FFFD."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> bytes:
        """Bytes held back because they do not yet form a whole character."""
        return self._decoder.getstate()[0]
