"""Memory estimate of a model at a given context: weights as stored, KV cache, recurrent state, MTP KV.

Sizing follows llama.cpp (src/llama-context.cpp, llama-kv-cache*.cpp, llama-memory-recurrent.cpp):
* the context is padded to a multiple of 256 and split evenly over `parallel` slots, each slot's share
  padded to 256 again (so the cache holds `parallel * ctx_per_slot` cells; `--kv-unified` holds one
  shared stream of `ctx_size` cells);
* only attention layers hold K/V; a sliding-window layer holds
  `pad256(min(ctx_per_stream, window * seqs_per_stream + ubatch))` cells per stream;
* quantized cache types cost their block size (q8_0: 34 bytes per 32 values);
* recurrent layers hold float32 conv and SSM state, one row per slot (times `recurrent_rows_per_slot`
  when speculative rollback keeps extra per-position states);
* the MTP block has its own KV cache of the same size as a trunk attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gguf import GGUFFile
from ..quant.types import bytes_per_element, parse_cache_type
from .config import AttentionCacheSpec, ModelConfig

CTX_PAD = 256


def _pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class MemoryEstimate:
    ctx_size: int  # after padding
    parallel: int
    cache_type_k: str
    cache_type_v: str
    weights_bytes: int  # every tensor as stored, MTP included
    mtp_weights_bytes: int
    kv_bytes: int  # trunk attention layers
    mtp_kv_bytes: int
    recurrent_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.mtp_kv_bytes + self.recurrent_bytes


def kv_bytes_per_cell(spec: AttentionCacheSpec, cache_type_k: str, cache_type_v: str) -> float:
    """Bytes one token occupies in one layer's K and V cache."""
    k = spec.n_kv_heads * spec.k_dim * bytes_per_element(parse_cache_type(cache_type_k))
    v = spec.n_kv_heads * spec.v_dim * bytes_per_element(parse_cache_type(cache_type_v))
    return k + v


def kv_cells(
    spec: AttentionCacheSpec, ctx_size: int, parallel: int, kv_unified: bool = False, ubatch: int = 512
) -> int:
    """Cells (token slots) llama.cpp allocates for one attention layer, summed over streams."""
    n_ctx = _pad(ctx_size)
    streams, ctx_per_stream = (1, n_ctx) if kv_unified else (parallel, _pad(n_ctx // parallel))
    if spec.sliding_window is None:
        return streams * ctx_per_stream
    seqs_per_stream = parallel if kv_unified else 1
    return streams * _pad(min(ctx_per_stream, spec.sliding_window * seqs_per_stream + ubatch))


def estimate_memory(
    config: ModelConfig,
    weights_bytes: int,
    mtp_weights_bytes: int,
    ctx_size: int,
    parallel: int = 1,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    *,
    kv_unified: bool = False,
    ubatch: int = 512,
    recurrent_rows_per_slot: int = 1,
) -> MemoryEstimate:
    """Bytes needed to serve `config` with `ctx_size` tokens of context (0 = the trained context)."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    if ctx_size < 0:
        raise ValueError(f"ctx_size must be >= 0, got {ctx_size}")
    ctx_size = _pad(ctx_size or config.context_length)
    layout = config.cache_layout()

    def kv_total(specs: tuple[AttentionCacheSpec, ...]) -> int:
        return sum(
            round(
                kv_cells(s, ctx_size, parallel, kv_unified, ubatch) * kv_bytes_per_cell(s, cache_type_k, cache_type_v)
            )
            for s in specs
        )

    recurrent_rows = parallel * recurrent_rows_per_slot
    recurrent = sum(4 * (r.conv_state_elements + r.ssm_state_elements) for r in layout.recurrent) * recurrent_rows
    return MemoryEstimate(
        ctx_size=ctx_size,
        parallel=parallel,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        weights_bytes=weights_bytes,
        mtp_weights_bytes=mtp_weights_bytes,
        kv_bytes=kv_total(layout.attention),
        mtp_kv_bytes=kv_total(layout.mtp_attention),
        recurrent_bytes=recurrent,
    )


def weight_bytes(gguf: GGUFFile, config: ModelConfig) -> tuple[int, int]:
    """(all tensor bytes, bytes of the MTP blocks' own tensors) as stored in the file."""
    mtp_prefixes = tuple(f"blk.{i}." for i in config.mtp_layers())
    total = mtp = 0
    for t in gguf.tensors.values():
        total += t.n_bytes
        if mtp_prefixes and t.name.startswith(mtp_prefixes):
            mtp += t.n_bytes
    return total, mtp
