"""What one request's generated tokens become: streamed text, held back while it could still become a stop
string or an incomplete character, and the reason the request ends.

`RequestOutput.add(token, position)` takes each sampled token and says what to send now and whether the
request ends there (llama-server's order: an end-of-generation token first, then stop strings, then the
token limit, then a full context); `finish` gives what was held back. Stop strings are matched across token
boundaries and never sent.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class Stop:
    """Why a request ends: finish_reason "stop" (EOG token or stop string) or "length" (the token limit, or a
    full context with `truncated`); stop_type as llama-server's: "eos", "word", "limit"."""

    reason: str
    stop_type: str
    word: str = ""
    truncated: bool = False


@dataclass(frozen=True)
class CodeLimits:
    """llama-server's limits for code completion (editor clients): `n_indent`, a new line indented by fewer spaces
    or tabs ends the answer, the line cut after its indentation; `t_max_predict_ms`, once generating has taken
    longer, the next token that sends a newline ends it. 0: off."""

    n_indent: int = 0
    t_max_predict_ms: int = 0


class RequestOutput:
    """One request's text as it is generated. `limit`: tokens it may generate (-1: no limit); `n_ctx`: the
    slot's context, whose last cell ends generation."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str],
        limit: int,
        n_ctx: int,
        keep_special: Collection[int] = (),
        code: CodeLimits = CodeLimits(),
    ) -> None:
        self.eog_ids = tokenizer.eog_ids
        self.stops, self.limit, self.n_ctx, self.code = stops, limit, n_ctx, code
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special=True, keep_special=keep_special)
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already sent
        self.has_new_line = False  # a sent piece held a newline (llama-server's flag for the code limits)
        self.line_start = 0  # where the text's last line that the indentation check has reached starts

    def add(self, token: int, position: int, generating_ms: float = 0.0) -> tuple[str, Stop | None]:
        """A sampled token that would sit at `position` of the context, `generating_ms` after the first token
        was sampled: (text to send now, why the request ends here or None)."""
        self.tokens.append(token)
        if token in self.eog_ids:
            self._code_limits("", generating_ms)  # (its cut applies; the end is the EOG token's)
            return "", Stop("stop", "eos")
        self.text += self.detokenizer.add(token)
        found = stop_position(self.text, self.stops, self.sent) if self.stops else None
        if found is not None:
            index, word = found
            self.text = self.text[:index]
            return self._release(len(self.text)), Stop("stop", "word", word)
        hold = partial_stop_length(self.text, self.stops) if self.stops else 0
        text = self._release(len(self.text) - hold)
        stop = None
        if 0 <= self.limit <= len(self.tokens):
            stop = Stop("length", "limit")
        elif position + 1 >= self.n_ctx:
            stop = Stop("length", "limit", truncated=True)
        code_stop = self._code_limits(text, generating_ms)
        return text, stop or code_stop

    def _code_limits(self, text: str, generating_ms: float) -> Stop | None:
        """llama-server's checks in its order: the indentation of the line begun after the last newline seen by a
        previous token (one line a token), then the time limit on a token that sends a newline."""
        stop = None
        if self.has_new_line and self.code.n_indent > 0:
            if self.line_start > 0:
                indent = len(self.text) - len(self.text[self.line_start :].lstrip(" \t")) - self.line_start
                cut = self.line_start + indent
                if cut < len(self.text) and indent < self.code.n_indent:
                    self.text, self.sent = self.text[:cut], min(self.sent, cut)  # (sent text stays sent)
                    stop = Stop("length", "limit")
            newline = self.text.find("\n", self.line_start)
            if newline >= 0:
                self.line_start = newline + 1
        if "\n" in text:
            self.has_new_line = True
            if 0 < self.code.t_max_predict_ms < generating_ms:
                stop = Stop("length", "limit")
        return stop

    def finish(self, stop: Stop) -> str:
        """The text held back until the end (a possible stop string that was not, an incomplete character)."""
        if stop.stop_type != "word":
            self.text += self.detokenizer.flush()
        return self._release(len(self.text))

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate (-1: no limit)."""
        return max(self.limit - len(self.tokens), 0) if self.limit >= 0 else -1

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


def stop_position(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest occurrence of a stop string ending at or after `start`."""
    best: tuple[int, str] | None = None
    for word in stops:
        i = text.find(word, max(0, start - len(word) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, word)
    return best


def partial_stop_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for word in stops:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:n]):
                longest = n
                break
    return longest
