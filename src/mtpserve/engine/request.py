"""What a request asks of the engine and what comes back (the errors it can end with: errors.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (engine.grammar): `kind` "json_schema" (`source` the schema's JSON),
    "gbnf" (a llama.cpp GBNF grammar) or "structural_tag" (an xgrammar structural tag's JSON: free text,
    reasoning and tool calls in a model's format)."""

    kind: str
    source: str


@dataclass(frozen=True)
class ReasoningBudgetSpec:
    """llama-server's reasoning budget for a request whose output starts inside a reasoning block
    (engine.reasoning_budget): after `tokens` generated tokens with the block still open, the engine emits
    `forced` (the budget message and the end tag) one token per step; any of `end_texts` closes the block."""

    tokens: int
    forced: tuple[int, ...]
    end_texts: tuple[str, ...] = ("\n</think>", "</think>", "<tool_call>")


@dataclass
class Request:
    """A completion: prompt tokens and llama-server's generation fields."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1  # -1: until EOG, a stop string or the context is full
    stop: list[str] = field(default_factory=list)  # matched across token boundaries, never emitted
    n_indent: int = 0  # code completion: a new line indented less than this ends the answer, the line cut
    t_max_predict_ms: int = 0  # code completion: past this much generating, the next newline ends the answer
    ignore_eos: bool = False
    cache_prompt: bool = True  # reuse what the slot already holds of this prompt
    n_probs: int = 0  # top-N probabilities per generated token: of the raw softmax, or after the sampler's chain
    post_sampling_probs: bool = False  # n_probs from the distribution the token was drawn from
    return_progress: bool = False  # a ProgressEvent before the prompt's first pass and after each
    id_slot: int = -1  # a slot to run on (-1: the engine chooses)
    keep_special: frozenset[int] = frozenset()  # control tokens whose text goes into the output (e.g. <think>)
    checkpoint_at: tuple[int, ...] = ()  # extra prompt positions to keep recurrent state at (e.g. last user turn)
    # prompt positions a later request may resume from (the ends of the system prompt and of the messages): a
    # recurrent model keeps its state there too, for the prompt cache; other models change nothing
    resume_at: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None  # constrained decoding: every sampled token keeps the output matching it
    reasoning_budget: ReasoningBudgetSpec | None = None  # chat with thinking on and --reasoning-budget >= 0
    # The client reads the events as they come (a streamed answer). False: only the whole answer matters, so an engine
    # on another machine (mtpserve.cluster) sends the events in one batch at the end; this engine ignores it.
    incremental: bool = True


@dataclass
class Timings:
    """llama-server's per-request `timings` (milliseconds, tokens per second)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_n_per_pos: list[int] = field(default_factory=list)  # drafts that reached position i (from 0)
    draft_n_accepted_per_pos: list[int] = field(default_factory=list)  # ... and were kept there

    @property
    def prompt_per_token_ms(self) -> float:
        return self.prompt_ms / self.prompt_n if self.prompt_n else 0.0

    @property
    def prompt_per_second(self) -> float:
        return 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0

    @property
    def decode_steps(self) -> int:
        # llama-server's rates count decode steps: the first token comes free with the prompt's last batch
        return max(self.predicted_n - 1, 0)

    @property
    def predicted_per_token_ms(self) -> float:
        return self.predicted_ms / self.decode_steps if self.decode_steps else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.decode_steps / self.predicted_ms if self.predicted_ms and self.decode_steps else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_per_token_ms,
            "prompt_per_second": self.prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_per_token_ms,
            "predicted_per_second": self.predicted_per_second,
        }
        if self.draft_n:
            out["draft_n"] = self.draft_n
            out["draft_n_accepted"] = self.draft_n_accepted
            out["draft_n_per_pos"] = list(self.draft_n_per_pos)  # mtpserve's: acceptance by draft position
            out["draft_n_accepted_per_pos"] = list(self.draft_n_accepted_per_pos)
        return out


@dataclass
class TokenEvent:
    """One generated token: `text` is what may be shown now (text held back while it could still
    become a stop string or an incomplete character is released with a later event)."""

    token: int
    text: str
    top_probs: list[tuple[int, float]] = field(default_factory=list)  # with n_probs: the N most likely
    prob: float = 0.0  # with n_probs: this token's probability (raw softmax, as top_probs)


@dataclass
class ProgressEvent:
    """With `return_progress`: where the prompt's evaluation stands (llama-server's prompt_progress), sent before
    its first pass (processed == cache) and after each. `timings` as they are at that moment."""

    total: int  # prompt tokens
    cache: int  # reused from the slot's cache
    processed: int  # in the slot now, the cached ones included
    time_ms: float
    timings: Timings

    def as_dict(self) -> dict[str, float | int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class FinishEvent:
    """The end of a request. finish_reason: "stop" (EOG token or stop string), "length" (n_predict or a
    full context, the latter with `truncated`); stop_type as llama-server's: "eos", "word", "limit"."""

    finish_reason: str
    stop_type: str
    text: str  # the whole generated text, stop string excluded
    tokens: list[int]
    tail: str  # text not sent with a TokenEvent (held back as a possible stop string or partial character)
    timings: Timings
    stopping_word: str = ""
    truncated: bool = False
    n_prompt_tokens: int = 0
    id_slot: int = -1
    accepted_per_position: list[int] = field(default_factory=list)  # speculative: accepted drafts per position
    verify_steps: int = 0  # speculative: verification passes with a draft
