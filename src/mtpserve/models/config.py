"""What every architecture's config tells the rest of the engine: its layers, its tensors, its caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..gguf import GGUFError, Metadata

# llama.cpp's LLAMA_MAX_LAYERS: no real model has more blocks, and a file claiming 2**32 of them must fail
# here rather than in a per-layer loop.
MAX_LAYERS = 512


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the architecture reads: name, torch-order shape, and whether the file must have it."""

    name: str
    shape: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class AttentionCacheSpec:
    """One attention layer's KV cache: per token it holds `n_kv_heads * (k_dim + v_dim)` values."""

    layer: int
    n_kv_heads: int
    k_dim: int
    v_dim: int
    sliding_window: int | None = None  # keys older than this many positions are never read


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One recurrent (Gated DeltaNet) layer's state per sequence, always float32 (as in llama.cpp)."""

    layer: int
    conv_state_elements: int  # (d_conv - 1) * conv_dim
    ssm_state_elements: int  # Hv * dk * dv


@dataclass(frozen=True)
class CacheLayout:
    attention: tuple[AttentionCacheSpec, ...]
    recurrent: tuple[RecurrentStateSpec, ...]
    mtp_attention: tuple[AttentionCacheSpec, ...] = ()


class ModelConfig(Protocol):
    """The interface `inspect`, the memory planner and the loader use; each architecture file implements it."""

    architecture: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers, without MTP blocks
    context_length: int  # trained context
    tied_embeddings: bool  # no output.weight: the LM head is the embedding table

    def layer_kinds(self) -> list[str]:
        """One entry per trunk layer: "attention", "sliding_attention" or "gated_deltanet"."""
        ...

    def mtp_layers(self) -> list[int]:
        """Block indices of MTP/NextN layers (after the trunk); empty when the file has none."""
        ...

    def tensor_specs(self) -> list[TensorSpec]: ...

    def cache_layout(self) -> CacheLayout: ...


def common_hparams(md: Metadata) -> dict[str, Any]:
    """Config fields every architecture reads from the same llama.cpp keys (`<arch>.embedding_length`, ...).

    `block_count` (which for qwen35 includes the MTP blocks) is returned too, for the caller to split.
    """
    p = md.get_str("general.architecture")
    block_count = md.get_int(f"{p}.block_count")
    if not 1 <= block_count <= MAX_LAYERS:
        raise GGUFError(md.source, f"{p}.block_count = {block_count}: must be 1 to {MAX_LAYERS}")
    n_embd = md.get_int(f"{p}.embedding_length")
    n_head = md.get_uniform_int(f"{p}.attention.head_count", block_count)
    head_dim = md.get_int(f"{p}.attention.key_length", n_embd // max(n_head, 1))
    value_length = md.get_int(f"{p}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise GGUFError(md.source, f"attention key_length {head_dim} != value_length {value_length} is not supported")
    return dict(
        architecture=p,
        block_count=block_count,
        n_vocab=vocab_size(md),
        n_embd=n_embd,
        n_ff=md.get_uniform_int(f"{p}.feed_forward_length", block_count),
        n_head=n_head,
        n_head_kv=md.get_uniform_int(f"{p}.attention.head_count_kv", block_count, n_head),
        head_dim=head_dim,
        rms_eps=md.get_float(f"{p}.attention.layer_norm_rms_epsilon"),
        rope_base=md.get_float(f"{p}.rope.freq_base", 10000.0),
        context_length=md.get_int(f"{p}.context_length"),
    )


def common_metadata(config: Any, block_count: int) -> dict[str, Any]:
    """The keys common_hparams reads, from a config's fields (for writing a file of a config's shapes; the
    vocabulary size is the tokenizer's, written with it)."""
    p = config.architecture
    return {
        "general.architecture": p,
        f"{p}.context_length": config.context_length,
        f"{p}.embedding_length": config.n_embd,
        f"{p}.block_count": block_count,
        f"{p}.feed_forward_length": config.n_ff,
        f"{p}.attention.head_count": config.n_head,
        f"{p}.attention.head_count_kv": config.n_head_kv,
        f"{p}.attention.key_length": config.head_dim,
        f"{p}.attention.value_length": config.head_dim,
        f"{p}.attention.layer_norm_rms_epsilon": float(config.rms_eps),
        f"{p}.rope.freq_base": float(config.rope_base),
    }


def lm_tensor_specs(n_vocab: int, n_embd: int) -> list[TensorSpec]:
    """Embedding, final norm and LM head; a file without `output.weight` ties the head to the embedding."""
    return [
        TensorSpec("token_embd.weight", (n_vocab, n_embd)),
        TensorSpec("output_norm.weight", (n_embd,)),
        TensorSpec("output.weight", (n_vocab, n_embd), required=False),
    ]


def attention_specs(b: str, n_embd: int, q_rows: int, kv_rows: int, n_out: int, qk_norm: int = 0) -> list[TensorSpec]:
    """A block's attention weights (`b`: "blk.N"): q [q_rows, E], k and v [kv_rows, E], the output [E, n_out], and
    with `qk_norm` (the head size) the per-head q and k norms."""
    E = n_embd
    specs = [
        TensorSpec(f"{b}.attn_q.weight", (q_rows, E)),
        TensorSpec(f"{b}.attn_k.weight", (kv_rows, E)),
        TensorSpec(f"{b}.attn_v.weight", (kv_rows, E)),
        TensorSpec(f"{b}.attn_output.weight", (E, n_out)),
    ]
    if qk_norm:
        specs += [TensorSpec(f"{b}.attn_q_norm.weight", (qk_norm,)), TensorSpec(f"{b}.attn_k_norm.weight", (qk_norm,))]
    return specs


def ffn_specs(b: str, n_embd: int, n_ff: int) -> list[TensorSpec]:
    """A block's gated FFN: gate and up [F, E], down [E, F]."""
    E, F = n_embd, n_ff
    return [
        TensorSpec(f"{b}.ffn_gate.weight", (F, E)),
        TensorSpec(f"{b}.ffn_up.weight", (F, E)),
        TensorSpec(f"{b}.ffn_down.weight", (E, F)),
    ]


def vocab_size(md: Metadata) -> int:
    """The vocabulary size as llama.cpp takes it: the token list's length, else `<arch>.vocab_size`."""
    tokens = md.values.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return len(tokens)
    return md.get_int(f"{md.get_str('general.architecture')}.vocab_size")
