"""Which type each tensor gets in a quantized file: llama-quantize's rules (src/llama-quant.cpp), for the file
types `mtpserve quantize` writes (Q8_0, Q6_K, Q4_K_M). Summary in ../shared/spec/gguf-quant-formats.md §6.

* Only 2-D+ tensors whose names end in `weight` are quantized, minus norms, MoE routers, conv1d kernels,
  position embeddings and a list of small per-architecture tensors (`allows_quantization`); the others keep
  their stored type.
* The file type's default (Q8_0, Q6_K, Q4_K) then goes through the type-mix rules. For Q4_K_M:
  `output.weight` (and a tied `token_embd.weight`) Q6_K; `attn_v`/`attn_qkv`/`attn_kv_b` and `ffn_down` Q6_K
  on the `use_more_bits` layers; 8-expert MoE models and Llama-2-70B-shaped models get their own bumps
  (Q8_0 attn_k/attn_v, Q5_K attn_output / attn_v). Q6_K and Q8_0 files keep the default everywhere except
  `output` (Q6_K in a Q6_K file) and the 8-expert attn_k/attn_v (Q8_0).
* A row length that is not a multiple of the chosen type's block size falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 when even 32 does not divide it.

The position counters (`i_attention_wv`, `i_ffn_down`) run in llama.cpp's tensor order: by layer number
(`blk.N.`; others first), then by name, whatever the order in the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .types import GGMLType, block_geometry


@dataclass(frozen=True)
class FileType:
    name: str
    ftype: int  # llama_ftype, stored as general.file_type
    default: GGMLType


FILE_TYPES: dict[str, FileType] = {
    "Q8_0": FileType("Q8_0", 7, GGMLType.Q8_0),
    "Q6_K": FileType("Q6_K", 18, GGMLType.Q6_K),
    "Q4_K_M": FileType("Q4_K_M", 15, GGMLType.Q4_K),
}

# Stored types that are plain floats: their tensors are quantized without --allow-requantize.
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

# Substrings (and exact names) of tensors llama-quantize never quantizes.
_KEEP_SUBSTRINGS = (
    "_norm.weight",
    "ffn_gate_inp.weight",  # MoE router
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")
_KEEP_SUBSTRINGS_GLM5_NEXT = (
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
)
_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}
_LAYER = re.compile(r"^blk\.([+-]?\d+)\.")


def n_dims(ne: Sequence[int]) -> int:
    """ggml_n_dims: the dimension count without trailing size-1 dimensions (at least 1)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, ne: Sequence[int], arch: str) -> bool:
    if n_dims(ne) < 2 or not name.endswith("weight") or name in _KEEP_NAMES:
        return False
    keep = _KEEP_SUBSTRINGS + (_KEEP_SUBSTRINGS_GLM5_NEXT if arch == "glm5-next" else ())
    return not any(s in name for s in keep)


def category(name: str) -> str:
    """llama-quant.cpp's broad tensor categories (first match wins, in this order)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (
        ("attn_qkv.weight", "attn_qkv"),
        ("attn_kv_b.weight", "attn_kv_b"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return cat
    return "other"


def layer_of(name: str) -> int:
    """`sscanf(name, "blk.%d.")`, -1 for tensors outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names: Iterable[str]) -> list[str]:
    """llama.cpp's tensor order (llama_model_loader's weights_map): by layer number, then by name."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode()))


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class ModelFacts:
    """The hyperparameters the rules look at."""

    arch: str
    n_layer: int  # block_count, MTP/NextN layers included (llama.cpp's n_layer_all)
    n_expert: int = 0
    is_70b: bool = False  # llama.cpp's LLM_TYPE_70B (Llama-2/3-70B shape: 80 layers, GQA)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ModelFacts:
        arch = str(metadata.get("general.architecture", ""))

        def first_int(key: str, default: int) -> int:
            value = metadata.get(f"{arch}.{key}", default)
            if hasattr(value, "__len__") and not isinstance(value, str):
                return int(value[0]) if len(value) else default
            return int(value)

        n_layer = first_int("block_count", 0)
        n_head, n_head_kv = first_int("attention.head_count", 0), first_int("attention.head_count_kv", -1)
        is_70b = n_layer == 80 and (arch == "deci" or (arch == "llama" and n_head_kv not in (-1, n_head)))
        return cls(arch, n_layer, first_int("expert_count", 0), is_70b)


def _fallback(name: str, ne0: int, target: GGMLType) -> GGMLType:
    """A compatible type when the target's block size does not divide the row length."""
    block = block_geometry(target)[0]
    if ne0 % block == 0:
        return target
    if target in _FALLBACK:
        out = _FALLBACK[target]
    elif block <= 32:
        out = target
    else:
        raise ValueError(f"tensor '{name}': no fallback type for {target.name} (row length {ne0})")
    return out if ne0 % block_geometry(out)[0] == 0 else GGMLType.F16


class _Counters:
    def __init__(self, names: Sequence[str], facts: ModelFacts) -> None:
        self.n_attention_wv = sum(category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names)
        self.i_attention_wv = 0
        self.n_ffn_down = facts.n_layer
        self.i_ffn_down = 0
        self.tied = "output.weight" not in names


def _mix_type(name: str, ne0: int, file_type: FileType, facts: ModelFacts, c: _Counters) -> GGMLType:
    """llama_tensor_get_type_impl, reduced to the Q8_0, Q6_K and Q4_K_M file types."""
    t = file_type.default
    q4_k_m = file_type.name == "Q4_K_M"
    cat = category(name)
    moe8 = facts.n_expert == 8
    if cat == "output" or (c.tied and cat == "token_embd"):
        if facts.arch == "falcon" or ne0 % block_geometry(t)[0]:
            t = GGMLType.Q8_0
        elif t != GGMLType.Q8_0:
            t = GGMLType.Q6_K
    elif cat == "token_embd":
        pass
    elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        if q4_k_m and use_more_bits(c.i_attention_wv, c.n_attention_wv):
            t = GGMLType.Q6_K
        if facts.is_70b and t in (GGMLType.Q3_K, GGMLType.Q4_K):
            t = GGMLType.Q5_K
        if moe8:
            t = GGMLType.Q8_0
        c.i_attention_wv += 1
    elif cat == "attn_k":
        if moe8:
            t = GGMLType.Q8_0
    elif cat == "ffn_down":
        i, n = c.i_ffn_down, c.n_ffn_down
        if facts.n_expert > 1:  # experts may be stored out of order: the layer comes from the name
            i = layer_of(name)
            if not 0 <= i < n:
                raise ValueError(f"tensor '{name}': bad layer {i} (block_count {n})")
        if q4_k_m:
            if facts.arch == "falcon":
                t = GGMLType.Q6_K if i < n // 16 else GGMLType.Q5_K if use_more_bits(i, n) else GGMLType.Q4_K
            elif use_more_bits(i, n):
                t = GGMLType.Q6_K
        c.i_ffn_down += 1
    elif cat == "attn_output" and facts.arch != "falcon" and moe8 and q4_k_m:
        t = GGMLType.Q5_K
    return t


def plan_types(
    tensors: Mapping[str, tuple[Sequence[int], GGMLType]],
    file_type: FileType,
    facts: ModelFacts,
    fallbacks: list[str] | None = None,
) -> dict[str, GGMLType]:
    """Target type of every tensor, {name: type} in the order of `tensors` ({name: (ne, stored type)}).
    Names of tensors that needed a fallback type are appended to `fallbacks` when given."""
    names = list(tensors)
    counters = _Counters(names, facts)
    chosen: dict[str, GGMLType] = {}
    for name in llama_order(names):
        ne, stored = tensors[name]
        if not allows_quantization(name, ne, facts.arch):
            chosen[name] = stored
            continue
        wanted = _mix_type(name, ne[0], file_type, facts, counters)
        chosen[name] = _fallback(name, ne[0], wanted)
        if chosen[name] != wanted and fallbacks is not None:
            fallbacks.append(name)
    return {name: chosen[name] for name in names}
