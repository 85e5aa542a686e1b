"""Reasoning split for thinking models: generated text -> `reasoning_content` and `content`, as llama.cpp.

llama.cpp parses `generation_prompt + generated text` (../shared/spec/chat-template.md §4; the Qwen3.5
handler, common/parsers/qwen3-coder.cpp): the generation prompt's header (up to its `<think>`, if it has
one), then an optional block `<think>`, whitespace skipped, **reasoning** up to the first `</think>` or an
interrupting tag (`<tool_call>`, not consumed), `</think>` consumed, whitespace skipped, **content** =
the rest. So thinking-on output `I'm\\nthinking\\n</think>\\n\\nHello` gives reasoning `I'm\\nthinking\\n`
(not trimmed at the end) and content `Hello`; with thinking off the prompt's own empty block parses as
empty reasoning and all output is content; unterminated reasoning (a length stop) stays reasoning.
"Whitespace" is C `isspace`. Templates without `<think>` are content-only: the text, untouched.

`split_reasoning` parses a whole text; `ReasoningStream` does the same incrementally for streaming: it
holds back text that could still become a delimiter (`</thi...`) or the opening `<think>`, and its deltas,
joined, equal `split_reasoning` of the whole text for any chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

WHITESPACE = " \t\n\v\f\r"


@dataclass(frozen=True)
class ThinkTags:
    """The tags of a thinking template: reasoning opens with `start`, ends at `end` or (not consumed) at
    one of `interrupts`."""

    start: str = "<think>"
    end: str = "</think>"
    interrupts: tuple[str, ...] = ("<tool_call>",)

    @property
    def closers(self) -> tuple[str, ...]:
        return (self.end, *self.interrupts)


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning_content: str
    content: str


def _body(generation_prompt: str, tags: ThinkTags) -> str:
    """What follows the generation prompt's header: its `<think>...` part, if any (then the output)."""
    cut = generation_prompt.find(tags.start)
    return generation_prompt[cut:] if cut >= 0 else ""


def split_reasoning(
    text: str, generation_prompt: str = "", tags: ThinkTags | None = ThinkTags(), extract: bool = True
) -> ReasoningSplit:
    """Split a whole generated `text` (the generation prompt given separately, as the template made it).

    tags=None: a template without reasoning (content = text). extract=False is llama.cpp's
    `reasoning_format: none`: no split, content keeps the `<think>` part.
    """
    if tags is None:
        return ReasoningSplit("", text)
    rest = _body(generation_prompt, tags) + text
    if not extract or not rest.startswith(tags.start):
        return ReasoningSplit("", rest.lstrip(WHITESPACE))
    body = rest[len(tags.start) :].lstrip(WHITESPACE)
    found = [(i, closer) for closer in tags.closers if (i := body.find(closer)) >= 0]
    if not found:
        return ReasoningSplit(body, "")
    at, closer = min(found)
    after = body[at + len(tags.end) :] if closer == tags.end else body[at:]
    return ReasoningSplit(body[:at], after.lstrip(WHITESPACE))


class ReasoningStream:
    """Incremental `split_reasoning`: `feed(delta)` and finally `finish()` return the new reasoning and
    content text; `reasoning_content`/`content` hold all that was returned so far."""

    _OPEN, _SKIP_REASONING, _REASONING, _SKIP_CONTENT, _CONTENT = range(5)

    def __init__(self, generation_prompt: str = "", tags: ThinkTags | None = ThinkTags(), extract: bool = True) -> None:
        self.tags = tags
        self.extract = extract
        self._buf = _body(generation_prompt, tags) if tags is not None else ""
        self._pos = 0
        self._state = self._CONTENT if tags is None else self._OPEN
        self.reasoning_content = ""
        self.content = ""

    def feed(self, text: str) -> ReasoningSplit:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningSplit:
        """End of output: text held back as a possible delimiter is released."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningSplit:
        buf, pos, tags = self._buf, self._pos, self.tags
        reasoning, content = "", ""
        while True:
            if self._state == self._OPEN:
                assert tags is not None
                rest = buf[pos:]
                if self.extract and rest.startswith(tags.start):
                    pos += len(tags.start)
                    self._state = self._SKIP_REASONING
                elif self.extract and not final and tags.start.startswith(rest):
                    break  # could still become <think>
                else:
                    self._state = self._SKIP_CONTENT
            elif self._state in (self._SKIP_REASONING, self._SKIP_CONTENT):
                while pos < len(buf) and buf[pos] in WHITESPACE:
                    pos += 1
                if pos == len(buf) and not final:
                    break
                self._state += 1  # to _REASONING / _CONTENT
            elif self._state == self._REASONING:
                assert tags is not None
                found = [(i, closer) for closer in tags.closers if (i := buf.find(closer, pos)) >= 0]
                if found:
                    at, closer = min(found)
                    reasoning += buf[pos:at]
                    pos = at + len(closer) if closer == tags.end else at
                    self._state = self._SKIP_CONTENT
                    continue
                keep = 0 if final else _partial_suffix(buf, pos, tags.closers)
                reasoning += buf[pos : len(buf) - keep]
                pos = len(buf) - keep
                break
            else:
                content += buf[pos:]
                pos = len(buf)
                break
        self._buf, self._pos = buf[pos:], 0  # what lies before pos is never read again
        self.reasoning_content += reasoning
        self.content += content
        return ReasoningSplit(reasoning, content)


def _partial_suffix(buf: str, start: int, delimiters: tuple[str, ...]) -> int:
    """Length of the longest tail of buf[start:] that is a proper prefix of a delimiter."""
    longest = 0
    for d in delimiters:
        for n in range(min(len(d) - 1, len(buf) - start), longest, -1):
            if buf.endswith(d[:n]):
                longest = n
                break
    return longest
