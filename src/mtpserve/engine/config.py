"""The engine's configuration: llama-server's slot, cache and speculative flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequest

SPEC_TYPES = ("none", "draft-mtp", "draft-simple", "ngram")
DRAFT_SAMPLINGS = ("greedy", "probabilistic")  # --spec-draft-sampling (engine.rejection)
# --spec-draft-head: what scores an MTP draft (models.draft_head): the head, a Q4_0 copy shortlisting for it, or
# the copy where it pays (a head on a GPU, a quarter fewer bytes)
DRAFT_HEADS = ("auto", "full", "q4_0")
AUTO_N_MAX = 4  # --spec-draft-n-max auto tries drafts of up to this many tokens


@dataclass(frozen=True)
class SpecConfig:
    """llama-server's --spec-* flags."""

    type: str = "none"
    n_max: int = 3  # --spec-draft-n-max (llama.cpp's default)
    n_min: int = 0
    p_min: float = 0.0
    auto: bool = False  # --spec-draft-n-max auto: n_max is then the longest draft tried
    ngram_size: int = 3
    draft_model: str | None = None  # --model-draft: the GGUF of draft-simple
    draft_vocab: int = 0  # draft-mtp: score only the first N token ids when drafting (0: all)
    # at a temperature: a draw from the draft's chain kept by the ratio rule, or its argmax kept if sampled (llama.cpp)
    draft_sampling: str = "probabilistic"
    draft_head: str = "auto"  # draft-mtp: what scores a draft (DRAFT_HEADS)

    def __post_init__(self) -> None:
        if self.type not in SPEC_TYPES:
            raise InvalidRequest(f"unknown --spec-type '{self.type}' (use one of {', '.join(SPEC_TYPES)})")
        if self.n_max < 0 or self.n_min < 0:
            raise InvalidRequest("--spec-draft-n-max and --spec-draft-n-min must be >= 0")
        if self.draft_vocab < 0:
            raise InvalidRequest(f"--spec-draft-vocab must be >= 0 (0: the whole vocabulary), not {self.draft_vocab}")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise InvalidRequest(
                f"unknown --spec-draft-sampling '{self.draft_sampling}' (use one of {', '.join(DRAFT_SAMPLINGS)})"
            )
        if self.draft_head not in DRAFT_HEADS:
            raise InvalidRequest(f"unknown --spec-draft-head '{self.draft_head}' (use one of {', '.join(DRAFT_HEADS)})")
        if self.type == "draft-simple" and not self.draft_model:
            raise InvalidRequest("--spec-type draft-simple needs a draft model (--model-draft FILE)")

    @property
    def enabled(self) -> bool:
        return self.type != "none" and self.n_max > 0

    @property
    def probabilistic(self) -> bool:
        """Drafts drawn from the draft's distribution and kept by the ratio rule (draft-mtp, draft-simple: the
        drafters with a distribution; n-gram drafts are lookups, and comparing is the exact rule for them)."""
        drafts_from_a_model = self.type in ("draft-mtp", "draft-simple")
        return self.enabled and drafts_from_a_model and self.draft_sampling == "probabilistic"

    @property
    def draft_mtp(self) -> bool:
        """The model's MTP block drafts (its KV cache is allocated)."""
        return self.enabled and self.type == "draft-mtp"

    @property
    def verified_tokens(self) -> int:
        """Tokens a verification runs (n_max + 1), each leaving a recurrent state kept for the rollback; 0 without
        speculation."""
        return self.n_max + 1 if self.enabled else 0


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost (serve's --grammar-* flags)."""

    max_bytes: int = 1 << 20  # the schema or grammar's source (Claude Code's 24 tools: ~100 KB as a structural tag)
    timeout_s: float = 30.0  # waiting for a worker and compiling, together
    max_memory: int = 1 << 30  # a worker's resident memory while it compiles (24 tools at 152K tokens: 331 MiB; Linux)
    workers: int = 2  # compiles at once

    def __post_init__(self) -> None:
        if self.workers < 1 or self.timeout_s <= 0 or self.max_bytes <= 0 or self.max_memory <= 0:
            raise ValueError("--grammar-workers, -timeout, -max-size and -max-memory must each be above 0")


DEFAULT_GRAMMAR_LIMITS = GrammarLimits()


@dataclass(frozen=True)
class EngineConfig:
    """llama-server's slot, cache and weight-residency flags."""

    n_parallel: int = 1  # -np: slots
    ctx_size: int = 4096  # -c: total context over all slots, 0 = the model's trained context
    ubatch: int = 512  # -ub: prompt tokens per forward pass
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    ctx_checkpoints: int = 32  # per slot: recurrent-state checkpoints kept for prompt reuse
    # -cms: tokens at least between checkpoints inside a prompt. 0 here (llama-server: 8192): the checkpoints are
    # spread over the prompt (ctx_checkpoints of them), so a conversation that parts mid-prompt resumes near there
    checkpoint_min_step: int = 0
    n_predict: int = -1  # server-wide default limit
    slot_prompt_similarity: float = 0.1  # -sps
    kv_unified: bool = False  # --kv-unified: one pool of -c cells shared by all slots
    cache_ram: int = 0  # --cache-ram: MiB of prompt states kept in host memory beyond the slots (-1: no limit, 0: off)
    cache_idle_slots: bool = (
        True  # --cache-idle-slots: an idle slot's state is saved before --kv-unified takes its cells
    )
    spec: SpecConfig = field(default_factory=SpecConfig)  # --spec-type and --spec-draft-*
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # --grammar-*: what one grammar may cost
    use_mmap: bool = True  # --no-mmap: False, the weights read into memory (a model on the CPU)
    use_mlock: bool = False  # --mlock: the weights pinned in RAM (a model on the CPU)

    @property
    def resident_weights(self) -> bool:
        """--no-mmap or --mlock: the weights held in RAM, where they apply (a model on the CPU)."""
        return not self.use_mmap or self.use_mlock
