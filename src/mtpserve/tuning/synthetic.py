"""Synthetic GGUF files of a real model's shape: the deployment's Qwen3.6-27B (qwen35, 64 layers + the MTP block)
with its tensor names, shapes and metadata, each matrix in the type llama-quantize's Q4_K_M rules give it, and
random weights -- for measuring memory, loading and speed at the deployment's size without the 16.8 GB download.

The weights are random quantized blocks (the scales chosen so a row's values spread like a trained model's, ~0.02),
generated per tensor from a seed and the tensor's name, so a file is the same byte for byte wherever it is made,
and streamed to disk a few MiB at a time (a 16 GB file in well under 1 GB of memory). `Qwen35Shape(n_layer=4)` is a
4-layer file at the 27B's widths (~2.4 GB, most of it the 248,320-row embedding and output), small enough for a
token-parity check against llama.cpp; 64 random layers are too chaotic for that (a float32 and a float64 forward
pass already differ by 0.1 nats), so the full file is for memory, loading and speed.

Types (llama.cpp src/llama-quant.cpp, `LLAMA_FTYPE_MOSTLY_Q4_K_M`, checked against the tinyqwen35 fixture that
llama-quantize made): Q4_K by default; the output layer Q6_K; `attn_v` and the Gated DeltaNet `attn_qkv` (counted
together, in layer order) and `ffn_down` (counted separately, the MTP block's included) Q6_K where `use_more_bits`
holds -- the first eighth, the last eighth, and every third layer between; vectors, norms, `ssm_a`, `ssm_dt.bias`
and `ssm_conv1d` F32. The vocabulary: the Qwen BPE vocabulary of ../shared/fixtures/vocab/ggml-vocab-qwen35.gguf
(151,936 tokens) padded with unused `[PADn]` tokens to 248,320, as converters pad a vocabulary to the embedding's
rows; the chat template the tinyqwen35 fixture carries (Qwen 3.5's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..gguf import open_gguf

QK_K = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210
CHUNK_BYTES = 32 << 20  # written at a time


@dataclass(frozen=True)
class Qwen35Shape:
    """Qwen3.6-27B's hyperparameters (../shared/spec/qwen35-architecture.md, the "27B" column)."""

    n_layer: int = 64  # trunk blocks; the MTP block comes after them
    n_embd: int = 5120
    n_ff: int = 17408
    n_head: int = 24
    n_head_kv: int = 4
    head_dim: int = 256
    n_vocab: int = 248320
    ssm_state: int = 128  # dk = dv
    ssm_groups: int = 16  # K heads
    ssm_rank: int = 48  # V heads
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rope_dims: int = 64
    context_length: int = 262144

    @property
    def ssm_inner(self) -> int:
        return self.ssm_rank * self.ssm_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_groups * self.ssm_state + self.ssm_inner

    def recurrent(self, il: int) -> bool:
        return il < self.n_layer and (il + 1) % self.full_attention_interval != 0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # GGUF order: columns first
    type: str  # "F32", "Q4_K", "Q6_K"

    @property
    def nbytes(self) -> int:
        n = int(np.prod(self.ne))
        block, size = {"F32": (1, 4), "Q4_K": (QK_K, Q4_K_BYTES), "Q6_K": (QK_K, Q6_K_BYTES)}.get(self.type, (0, 0))
        if not block:
            raise ValueError(f"{self.name}: {self.type} is planned but not written by this generator")
        return n // block * size


def default_path(n_layer: int = 64) -> Path:
    """Where bench/make_qwen35_27b.py writes the file of `n_layer` trunk layers."""
    return Path.home() / ".cache" / "mtpserve" / "synthetic" / f"qwen35-27b-{n_layer}L-Q4_K_M.gguf"


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's rule for the layers whose attn_v / ffn_down get more bits under Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(shape: Qwen35Shape) -> list[TensorSpec]:
    """Every tensor of the file, in the order llama.cpp's converter writes them, with its Q4_K_M type."""
    s, E = shape, shape.n_embd
    n_blocks = s.n_layer + 1  # the MTP block last
    out = [TensorSpec("token_embd.weight", (E, s.n_vocab), "Q4_K")]

    def mat(name: str, cols: int, rows: int, quant: str = "Q4_K") -> TensorSpec:
        if cols % QK_K:  # llama-quantize's fallback where a row is not whole super-blocks
            quant = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[quant]
        return TensorSpec(name, (cols, rows), quant)

    for il in range(n_blocks):
        p = f"blk.{il}."
        block = [TensorSpec(p + "attn_norm.weight", (E,), "F32")]
        # llama-quantize counts attn_v (with the GDN attn_qkv) and ffn_down tensors in file order: one of each
        # per block, so the count is the block's index
        wide = "Q6_K" if use_more_bits(il, n_blocks) else "Q4_K"
        if s.recurrent(il):
            block += [
                mat(p + "attn_qkv.weight", E, s.conv_dim, wide),
                mat(p + "attn_gate.weight", E, s.ssm_inner),
                mat(p + "ssm_beta.weight", E, s.ssm_rank),
                mat(p + "ssm_alpha.weight", E, s.ssm_rank),
                TensorSpec(p + "ssm_dt.bias", (s.ssm_rank,), "F32"),
                TensorSpec(p + "ssm_a", (s.ssm_rank,), "F32"),
                TensorSpec(p + "ssm_conv1d.weight", (s.conv_kernel, s.conv_dim), "F32"),
                TensorSpec(p + "ssm_norm.weight", (s.ssm_state,), "F32"),
                mat(p + "ssm_out.weight", s.ssm_inner, E),
            ]
        else:
            block += [
                mat(p + "attn_q.weight", E, 2 * s.n_head * s.head_dim),
                mat(p + "attn_k.weight", E, s.n_head_kv * s.head_dim),
                mat(p + "attn_v.weight", E, s.n_head_kv * s.head_dim, wide),
                mat(p + "attn_output.weight", s.n_head * s.head_dim, E),
                TensorSpec(p + "attn_q_norm.weight", (s.head_dim,), "F32"),
                TensorSpec(p + "attn_k_norm.weight", (s.head_dim,), "F32"),
            ]
        block += [
            TensorSpec(p + "post_attention_norm.weight", (E,), "F32"),
            mat(p + "ffn_gate.weight", E, s.n_ff),
            mat(p + "ffn_up.weight", E, s.n_ff),
            mat(p + "ffn_down.weight", s.n_ff, E, wide),
        ]
        if il == s.n_layer:
            block += [
                mat(p + "nextn.eh_proj.weight", 2 * E, E),
                TensorSpec(p + "nextn.enorm.weight", (E,), "F32"),
                TensorSpec(p + "nextn.hnorm.weight", (E,), "F32"),
                TensorSpec(p + "nextn.shared_head_norm.weight", (E,), "F32"),
            ]
        out += block
    return out + [TensorSpec("output_norm.weight", (E,), "F32"), mat("output.weight", E, s.n_vocab, "Q6_K")]


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))


def _random_bytes(rng: np.random.Generator, n_rows: int, row_bytes: int) -> np.ndarray:
    words = -(-n_rows * row_bytes // 8)
    return rng.bit_generator.random_raw(words).view(np.uint8)[: n_rows * row_bytes].reshape(n_rows, row_bytes)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _q4_k_blocks(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    """Q4_K blocks: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values. A value is
    d * scale * q - dmin * min; with dmin ~7.5 d the blocks centre near zero, with d ~8e-5 they spread ~0.02."""
    out = _random_bytes(rng, n, Q4_K_BYTES)
    d = scale * rng.uniform(6.5e-5, 9.5e-5, n)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(7.5 * d)
    return out


def _q6_k_blocks(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    """Q6_K blocks: 128 + 64 bytes of 6-bit values (centred on 32), 16 int8 scales (kept within +-16), d (f16)."""
    out = _random_bytes(rng, n, Q6_K_BYTES)
    out[:, 192:208] = (out[:, 192:208] % 33).astype(np.int8) - 16  # int8 in -16..16, as two's complement bytes
    out[:, 208:210] = _f16_bytes(scale * rng.uniform(6.5e-5, 9.5e-5, n))
    return out


def _f32_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(spec.ne))
    if spec.name.endswith("ssm_a"):  # -exp(A_log), A_log ~ log U(1, 16)
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if spec.name.endswith("ssm_dt.bias"):
        return rng.normal(0.0, 0.5, n).astype(np.float32)
    if spec.name.endswith("ssm_conv1d.weight"):
        return rng.normal(0.0, 0.2, n).astype(np.float32)
    return rng.normal(1.0, 0.05, n).astype(np.float32)  # norms, stored as 1 + w


def tensor_chunks(spec: TensorSpec, seed: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The tensor's data, a chunk of whole blocks at a time. The output layer's values are 4x wider: random
    weights at a trained model's spread give logits that spread ~1.4, too flat for greedy choices that are not
    near ties; at ~6 most positions are separated by more than 0.05 nats."""
    rng = _rng(seed, spec.name)
    if spec.type == "F32":
        yield _f32_values(spec, rng).tobytes()
        return
    size, make = {"Q4_K": (Q4_K_BYTES, _q4_k_blocks), "Q6_K": (Q6_K_BYTES, _q6_k_blocks)}[spec.type]
    scale = 4.0 if spec.name == "output.weight" else 1.0
    total = spec.nbytes // size
    step = max(1, chunk_bytes // size)
    for start in range(0, total, step):
        yield make(rng, min(step, total - start), scale).tobytes()


def metadata(shape: Qwen35Shape, vocab: Path, template_from: Path) -> dict:
    """The file's key-value pairs: the 27B's hyperparameters, the vocabulary padded to n_vocab, the template."""
    from gguf import TokenType

    source = open_gguf(vocab).metadata
    tokens = list(source["tokenizer.ggml.tokens"])
    types = [int(t) for t in source["tokenizer.ggml.token_type"]]
    if len(tokens) > shape.n_vocab:
        raise ValueError(f"{vocab} has {len(tokens)} tokens, more than n_vocab {shape.n_vocab}")
    pad = range(len(tokens), shape.n_vocab)
    s = shape
    return {
        "general.architecture": "qwen35",
        "general.type": "model",
        "general.name": f"qwen35-synthetic-{s.n_layer}L-{s.n_embd}",
        "general.file_type": 15,  # MOSTLY_Q4_K_M
        "general.quantization_version": 2,
        "qwen35.block_count": s.n_layer + 1,
        "qwen35.nextn_predict_layers": 1,
        "qwen35.context_length": s.context_length,
        "qwen35.embedding_length": s.n_embd,
        "qwen35.feed_forward_length": s.n_ff,
        "qwen35.attention.head_count": s.n_head,
        "qwen35.attention.head_count_kv": s.n_head_kv,
        "qwen35.attention.key_length": s.head_dim,
        "qwen35.attention.value_length": s.head_dim,
        "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen35.rope.dimension_count": s.rope_dims,
        "qwen35.rope.freq_base": 1e7,
        "qwen35.rope.dimension_sections": [11, 11, 10, 0],
        "qwen35.ssm.conv_kernel": s.conv_kernel,
        "qwen35.ssm.state_size": s.ssm_state,
        "qwen35.ssm.group_count": s.ssm_groups,
        "qwen35.ssm.time_step_rank": s.ssm_rank,
        "qwen35.ssm.inner_size": s.ssm_inner,
        "qwen35.full_attention_interval": s.full_attention_interval,
        "qwen35.attention.recurrent_layers": [s.recurrent(il) for il in range(s.n_layer + 1)],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": source["tokenizer.ggml.pre"],
        "tokenizer.ggml.tokens": tokens + [f"[PAD{i}]" for i in pad],
        "tokenizer.ggml.token_type": types + [int(TokenType.UNUSED)] * len(pad),
        "tokenizer.ggml.merges": list(source["tokenizer.ggml.merges"]),
        "tokenizer.ggml.eos_token_id": int(source["tokenizer.ggml.eos_token_id"]),
        "tokenizer.ggml.padding_token_id": int(source["tokenizer.ggml.padding_token_id"]),
        "tokenizer.ggml.bos_token_id": int(source["tokenizer.ggml.bos_token_id"]),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": open_gguf(template_from).metadata["tokenizer.chat_template"],
    }


def write(
    path: Path,
    shape: Qwen35Shape,
    vocab: Path,
    template_from: Path,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write the file; `progress(bytes written, total)` after each chunk. Returns the file's size."""
    import gguf

    specs = tensors(shape)
    writer = gguf.GGUFWriter(path, "qwen35", use_temp_file=False)
    for key, value in metadata(shape, vocab, template_from).items():
        if key == "general.architecture":
            continue  # the writer's own
        _add(writer, key, value)
    for spec in specs:
        if spec.type == "F32":
            writer.add_tensor_info(spec.name, tuple(reversed(spec.ne)), np.dtype(np.float32), spec.nbytes)
        else:
            qtype = gguf.GGMLQuantizationType[spec.type]
            rows = int(np.prod(spec.ne[1:]))
            writer.add_tensor_info(
                spec.name, (rows, spec.nbytes // rows), np.dtype(np.uint8), spec.nbytes, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    total, done = sum(s.nbytes for s in specs), 0
    for spec in specs:
        writer.write_padding(fout, fout.tell())
        for chunk in tensor_chunks(spec, seed):
            fout.write(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    writer.write_padding(fout, fout.tell())
    size = fout.tell()
    fout.close()
    return size


def _add(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif key.endswith("dimension_sections") or key.endswith("token_type"):
        writer.add_array(key, [int(v) for v in value])
    else:
        writer.add_array(key, list(value))
