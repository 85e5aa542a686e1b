"""`mtpserve quantize`: quantizers equal to gguf-py / llama.cpp, llama-quantize's type mix, the written file.

Oracles: `gguf.quants.quantize` for the 32-blocks (Q8_0, Q4_0, Q5_0, Q5_1); for the K-quants, which gguf-py
cannot quantize, the llama.cpp-made tinyqwen35 fixtures (llama-quantize from the F16 fixture, no imatrix):
our bytes must equal theirs tensor by tensor, and whole files when written in llama.cpp's tensor order.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from mtpserve.cli import main
from mtpserve.gguf import open_gguf
from mtpserve.quant.mix import FILE_TYPES, ModelFacts, plan_types, use_more_bits
from mtpserve.quant.quantize import quantize, quantize_q4_k, quantize_q5_k, quantize_q6_k, quantize_q8_0
from mtpserve.quant.writer import quantize_model

from ..conftest import shared_path, tinyqwen_path

PPL_TOLERANCE = 0.03


@pytest.fixture
def one_thread():
    """The quantizers are chains of small vector ops; on a shared, busy CPU torch's thread pool makes them
    ~10x slower (quantize_model runs them one chunk per thread for that reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :64] = 0.0  # all-zero blocks
    x[1, :32] = 0.49999997  # rounds to 0 in C's roundf, to 1 with floor(x + 0.5)
    x[2] *= 1e-5  # tiny values
    x[3] *= 300.0
    x[4, :256] = np.abs(x[4, :256])  # one-signed sub-blocks: the min is clamped to 0
    x[5, :256] = 1.5  # a flat block
    return x


def _f16_tensor(name: str) -> np.ndarray:
    f16 = open_gguf(tinyqwen_path("F16")).tensors[name]
    return f16.numpy().astype(np.float32)


# --- quantizers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_32_blocks_are_byte_identical_to_gguf_py(ggml_type):
    x = _random((64, 512))
    assert np.array_equal(quantize(torch.from_numpy(x), ggml_type).numpy(), quants.quantize(x, ggml_type))


def test_q8_0_is_byte_identical_to_gguf_py_on_a_real_tensor():
    x = _f16_tensor("blk.0.ffn_down.weight")  # [256, 768]
    assert np.array_equal(quantize_q8_0(torch.from_numpy(x)).numpy(), quants.quantize(x, T.Q8_0))


@pytest.mark.parametrize(
    "ggml_type,fn,rms_bound",
    [(T.Q4_K, quantize_q4_k, 0.075), (T.Q5_K, quantize_q5_k, 0.038), (T.Q6_K, quantize_q6_k, 0.019)],
    ids=["Q4_K", "Q5_K", "Q6_K"],
)
def test_k_quants_round_trip_through_gguf_py(ggml_type, fn, rms_bound, one_thread):
    # gguf-py has no K-quant quantizer: decode ours with its dequantizer and bound the error (N(0, 1) data).
    x = np.random.default_rng(1).standard_normal((128, 1024)).astype(np.float32)
    q = fn(torch.from_numpy(x)).numpy()
    assert q.shape == (128, 1024 // 256 * quants.GGML_QUANT_SIZES[ggml_type][1])
    y = quants.dequantize(q, ggml_type)
    assert np.sqrt(np.mean((y - x) ** 2)) < rms_bound
    edge = _random((8, 512))  # zeros, flat and one-signed blocks, tiny and large values: decode to finite values
    y = quants.dequantize(fn(torch.from_numpy(edge)).numpy(), ggml_type)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0, :64], np.zeros(64, np.float32))  # zero sub-blocks decode to exact zeros
    assert np.abs(y[5, :256] - 1.5).max() < 0.01


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q6_K"])
def test_k_quant_tensors_equal_llama_quantize_output(quant, one_thread):
    """Every block-quantized tensor of llama.cpp's file, quantized by us from the same F16 values."""
    src = open_gguf(tinyqwen_path("F16"))
    ref = open_gguf(tinyqwen_path(quant))
    checked = set()
    for name, t in ref.tensors.items():
        if t.ggml_type in (T.F32, T.F16):
            continue
        values = torch.from_numpy(src.tensors[name].numpy().astype(np.float32))
        assert np.array_equal(quantize(values, t.ggml_type).numpy().reshape(-1), t.raw()), (name, t.ggml_type.name)
        checked.add(t.ggml_type)
    assert checked == ({T.Q4_K, T.Q6_K, T.Q5_0} if quant == "Q4_K_M" else {T.Q6_K, T.Q8_0})


def test_unsupported_target_type_is_an_error():
    with pytest.raises(ValueError, match="cannot quantize to IQ4_XS"):
        quantize(torch.zeros(1, 256), T.IQ4_XS)
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        quantize_q4_k(torch.zeros(2, 128))


# --- type mix -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q6_K", "Q8_0"])
def test_mix_matches_llama_quantize_tensor_by_tensor(quant):
    src = open_gguf(tinyqwen_path("F16"))
    ref = open_gguf(tinyqwen_path(quant))
    planned = plan_types(
        {n: (t.ne, t.ggml_type) for n, t in src.tensors.items()},
        FILE_TYPES[quant],
        ModelFacts.from_metadata(src.metadata),
    )
    assert {n: t.name for n, t in planned.items()} == {n: t.ggml_type.name for n, t in ref.tensors.items()}


def test_use_more_bits_layers_of_a_65_layer_model():
    # ../shared/spec/gguf-quant-formats.md §6: qwen35-27B with its MTP block.
    assert [i for i in range(65) if use_more_bits(i, 65)] == [*range(8), *range(10, 56, 3), *range(56, 65)]


def _plan(tensors: dict[str, tuple[int, ...]], quant: str, facts: ModelFacts) -> dict[str, str]:
    fallbacks: list[str] = []
    planned = plan_types({n: (ne, T.F16) for n, ne in tensors.items()}, FILE_TYPES[quant], facts, fallbacks)
    return {n: t.name for n, t in planned.items()}


def test_mix_for_a_gemma3_270m_shaped_model():
    """The spec's expectations for Gemma-3-270M (n_embd 640, not a multiple of 256; tied embeddings)."""
    n = 18
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (640, 262144), "output_norm.weight": (640,)}
    for i in range(n):
        tensors |= {
            f"blk.{i}.attn_q.weight": (640, 1024),
            f"blk.{i}.attn_k.weight": (640, 256),
            f"blk.{i}.attn_v.weight": (640, 256),
            f"blk.{i}.attn_output.weight": (1024, 640),
            f"blk.{i}.ffn_gate.weight": (640, 2048),
            f"blk.{i}.ffn_up.weight": (640, 2048),
            f"blk.{i}.ffn_down.weight": (2048, 640),
            f"blk.{i}.attn_norm.weight": (640,),
        }
    got = _plan(tensors, "Q4_K_M", ModelFacts("gemma3", n))
    more = {0, 1, 4, 7, 10, 13, 15, 16, 17}
    assert got["token_embd.weight"] == "Q8_0" and got["output_norm.weight"] == "F16"  # tied; 1-D kept as stored
    for i in range(n):
        assert got[f"blk.{i}.attn_q.weight"] == got[f"blk.{i}.ffn_up.weight"] == "Q5_0"
        assert got[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        assert got[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert got[f"blk.{i}.attn_output.weight"] == "Q4_K"


def test_mix_special_cases():
    tensors = {
        "token_embd.weight": (256, 100),  # tied (no output.weight): takes output's Q6_K
        "blk.0.attn_v.weight": (256, 64),
        "blk.0.attn_k.weight": (256, 64),
        "blk.0.attn_output.weight": (256, 256),
        "blk.0.ffn_gate_inp.weight": (256, 8),  # MoE router: kept
        "blk.0.ssm_conv1d.weight": (4, 256),  # kept
        "blk.0.odd.weight": (48, 16),  # not a multiple of 32: F16
        "blk.0.wide.weight": (256, 1, 1),  # 1-D once trailing 1s are dropped: kept
    }
    got = _plan(tensors, "Q4_K_M", ModelFacts("llama", 1))
    assert got == {
        "token_embd.weight": "Q6_K",
        "blk.0.attn_v.weight": "Q6_K",
        "blk.0.attn_k.weight": "Q4_K",
        "blk.0.attn_output.weight": "Q4_K",
        "blk.0.ffn_gate_inp.weight": "F16",
        "blk.0.ssm_conv1d.weight": "F16",
        "blk.0.odd.weight": "F16",
        "blk.0.wide.weight": "F16",
    }
    moe8 = _plan(tensors, "Q4_K_M", ModelFacts("llama", 1, n_expert=8))
    assert moe8["blk.0.attn_v.weight"] == moe8["blk.0.attn_k.weight"] == "Q8_0"
    assert moe8["blk.0.attn_output.weight"] == "Q5_K"
    q6 = _plan(tensors | {"output.weight": (256, 100)}, "Q6_K", ModelFacts("llama", 1))
    assert q6["token_embd.weight"] == q6["output.weight"] == q6["blk.0.attn_v.weight"] == "Q6_K"
    q8 = _plan(tensors, "Q8_0", ModelFacts("llama", 1))
    assert q8["token_embd.weight"] == q8["blk.0.attn_v.weight"] == "Q8_0" and q8["blk.0.odd.weight"] == "F16"


# --- the written file -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantize") / "tinyqwen35-mtp-Q4_K_M.gguf"
    result = quantize_model(tinyqwen_path("F16"), out, "Q4_K_M", progress=False)
    assert result.fallbacks == [f"blk.{i}.ssm_out.weight" for i in (0, 1, 2, 4, 5, 6)]  # 128 columns -> Q5_0
    return out


def test_q4_k_m_file_reads_back_and_equals_llama_quantize_per_tensor(q4_k_m_file):
    src, ours, ref = open_gguf(tinyqwen_path("F16")), open_gguf(q4_k_m_file), open_gguf(tinyqwen_path("Q4_K_M"))
    assert list(ours.tensors) == list(src.tensors)  # the input's tensor order
    for name, t in ref.tensors.items():
        assert ours.tensors[name].ggml_type == t.ggml_type, name
        assert ours.tensors[name].ne == t.ne
        assert np.array_equal(ours.tensors[name].raw(), t.raw()), name
    # Metadata: the input's keys, values and types, with llama-quantize's file_type / quantization_version.
    assert list(ours.metadata) == list(ref.metadata)
    assert ours.metadata_types == ref.metadata_types
    for key, value in ref.metadata.items():
        assert np.array_equal(np.asarray(ours.metadata[key], dtype=object), np.asarray(value, dtype=object)), key
    assert ours.metadata["general.file_type"] == 15
    reader = GGUFReader(q4_k_m_file)  # gguf-py reads it too, with the same tensors
    assert [(t.name, t.tensor_type) for t in reader.tensors] == [(t.name, t.ggml_type) for t in ours.tensors.values()]
    out = next(t for t in reader.tensors if t.name == "output.weight")
    assert np.array_equal(np.asarray(out.data).reshape(-1), ref.tensors["output.weight"].raw())


@pytest.mark.slow  # 30 s on 2 cores: `make test-all`
def test_q4_k_m_file_perplexity_within_3_percent_of_llama_cpp(q4_k_m_file):
    from mtpserve.engine.perplexity import perplexity
    from mtpserve.models.loader import load
    from mtpserve.tokenizer import Tokenizer

    ref = json.loads(shared_path("fixtures", "refs", "tinyqwen35-mtp-Q4_K_M.json").read_text())["perplexity"]
    model, tokenizer = load(q4_k_m_file), Tokenizer.from_gguf(q4_k_m_file)
    text = shared_path("fixtures", "eval", ref["text_file"]).read_text(encoding="utf-8")
    tokens = tokenizer.encode(text, add_special=True, parse_special=False)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    result = perplexity(model, tokens, ref["ctx"], ref["chunks"], bos)
    assert abs(result.ppl - ref["ppl"]) / ref["ppl"] < PPL_TOLERANCE, (result.ppl, ref["ppl"])


def test_q8_0_in_llama_order_is_the_llama_quantize_file(tmp_path):
    out = tmp_path / "q8.gguf"
    assert main(["quantize", str(tinyqwen_path("F16")), str(out), "q8_0", "--llama-order", "-t", "2"]) == 0
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest == hashlib.sha256(tinyqwen_path("Q8_0").read_bytes()).hexdigest()
    assert not (tmp_path / "q8.gguf.part").exists()


def test_cli_errors(tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(tinyqwen_path("F16")), str(out), "Q5_K_M"]) == 1
    assert "unsupported quantization type 'Q5_K_M'; choose one of: Q8_0, Q6_K, Q4_K_M" in capsys.readouterr().err
    assert main(["quantize", str(tinyqwen_path("Q8_0")), str(out), "Q4_K_M"]) == 1
    err = capsys.readouterr().err
    assert "is already quantized (Q8_0)" in err and "--allow-requantize" in err
    assert not out.exists() and not (tmp_path / "out.gguf.part").exists()


def _synthetic_model(path: Path) -> dict[str, np.ndarray]:
    """A small 'llama' file with every metadata value type, raw-byte strings, and awkward tensors."""
    rng = np.random.default_rng(3)
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_key_value("test.i8", -3, GGUFValueType.INT8)
    w.add_key_value("test.u64", 2**40, GGUFValueType.UINT64)
    w.add_key_value("test.f64", 0.1, GGUFValueType.FLOAT64)
    w.add_key_value("test.f32", 0.1, GGUFValueType.FLOAT32)
    w.add_key_value("test.bool", True, GGUFValueType.BOOL)
    w.add_key_value("test.raw", b"\xff\xfeok", GGUFValueType.STRING)  # not UTF-8
    w.add_key_value("test.strs", ["a", b"\xc3", "\u00e9"], GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("test.i16s", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT16)
    w.add_key_value("test.f32s", [0.5, 0.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    w.add_key_value("test.bools", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    w.add_uint32("general.alignment", 64)
    tensors = {
        "token_embd.weight": rng.standard_normal((8, 256)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(256).astype(np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((16, 512)).astype(np.float32),
        "blk.0.attn_v.weight": rng.standard_normal((4, 64)).astype(np.float32),  # 64 columns: Q6_K -> Q8_0
        "blk.0.odd.weight": rng.standard_normal((3, 48)).astype(np.float32),  # 48 columns: F16
    }
    for name, values in tensors.items():
        if name == "blk.0.ffn_down.weight":  # stored as BF16
            w.add_tensor(name, quants.quantize(values, T.BF16), raw_dtype=T.BF16)
        elif name == "blk.0.attn_norm.weight":
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, values.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_synthetic_model_metadata_types_and_requantize(tmp_path):
    src = tmp_path / "in.gguf"
    values = _synthetic_model(src)
    out = tmp_path / "out.gguf"
    result = quantize_model(src, out, "Q4_K_M", progress=False)
    a, b = open_gguf(src), open_gguf(out)
    keys = [k for k in a.metadata if k not in ("general.file_type", "general.quantization_version")]
    assert list(b.metadata) == keys + ["general.quantization_version", "general.file_type"]
    for key in keys:
        assert b.metadata_types[key] == a.metadata_types[key], key
        assert np.array_equal(np.asarray(b.metadata[key], dtype=object), np.asarray(a.metadata[key], dtype=object)), key
    assert b.metadata["test.raw"].encode("utf-8", "surrogateescape") == b"\xff\xfeok"
    assert b.alignment == 64 and all(t.offset % 64 == 0 for t in b.tensors.values())
    assert {n: t.ggml_type.name for n, t in b.tensors.items()} == {
        "token_embd.weight": "Q6_K",  # tied (no output.weight): output's type
        "blk.0.attn_norm.weight": "F32",
        "blk.0.ffn_down.weight": "Q6_K",  # n_layer 1: use_more_bits(0, 1)
        "blk.0.attn_v.weight": "Q8_0",
        "blk.0.odd.weight": "F16",
    }
    assert result.fallbacks == ["blk.0.attn_v.weight", "blk.0.odd.weight"]
    bf16 = torch.from_numpy(quants.dequantize(quants.quantize(values["blk.0.ffn_down.weight"], T.BF16), T.BF16))
    assert np.array_equal(b.tensors["blk.0.ffn_down.weight"].raw(), quantize_q6_k(bf16).numpy().reshape(-1))
    # Requantizing: refused, then allowed (dequantized first); the already-Q8_0 and F32 tensors are copied.
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(out, tmp_path / "again.gguf", "Q8_0", progress=False)
    quantize_model(out, tmp_path / "again.gguf", "Q8_0", allow_requantize=True, progress=False)
    again = open_gguf(tmp_path / "again.gguf")
    assert again.tensors["token_embd.weight"].ggml_type == T.Q8_0
    assert np.array_equal(again.tensors["blk.0.attn_v.weight"].raw(), b.tensors["blk.0.attn_v.weight"].raw())
    dq = quants.dequantize(again.tensors["token_embd.weight"].numpy(), T.Q8_0)
    assert np.abs(dq - values["token_embd.weight"]).max() < 0.5
