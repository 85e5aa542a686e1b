"""Typed configs from GGUF metadata, tensor checks, and the memory estimate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtpserve.cli import main
from mtpserve.gguf import GGUFError, open_gguf
from mtpserve.models import config_from_gguf, config_from_metadata, estimate_memory
from mtpserve.models.gemma3 import Gemma3Config
from mtpserve.models.llama import LlamaConfig
from mtpserve.models.qwen35 import Qwen35Config

from ..conftest import default_model, tinyqwen_path
from ..support.ggufgen import tiny_llama_metadata, tiny_model_tensors, write_gguf

GiB = 1024**3


def test_tinyqwen35_config(tinyqwen):
    # Expected values: the model card in ../shared/fixtures/README.md ("Config", "GGUF hparams").
    c = config_from_gguf(open_gguf(tinyqwen))
    assert isinstance(c, Qwen35Config)
    assert (c.n_vocab, c.n_embd, c.n_layer, c.n_nextn, c.n_ff) == (4096, 256, 8, 1, 768)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.n_rot) == (4, 2, 64, 16)
    assert (c.n_k_heads, c.n_v_heads, c.ssm_head_dim, c.d_conv, c.conv_dim) == (2, 4, 32, 4, 256)
    assert c.rope_sections == (3, 3, 2, 0) and c.rope_base == 1e7 and c.rms_eps == pytest.approx(1e-6)
    assert c.layer_kinds() == ["gated_deltanet"] * 3 + ["attention"] + ["gated_deltanet"] * 3 + ["attention"]
    assert c.mtp_layers() == [8]
    assert not c.tied_embeddings


def test_smollm2_config():
    c = config_from_gguf(open_gguf(default_model("smollm2")))
    assert isinstance(c, LlamaConfig)
    assert (c.architecture, c.n_vocab, c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim) == (
        "llama",
        49152,
        576,
        30,
        9,
        3,
        64,
    )
    assert c.tied_embeddings and not c.rope_neox and c.rope_base == 100000.0
    assert c.layer_kinds() == ["attention"] * 30


def test_gemma3_config():
    # Expected: ../shared/spec/qwen35-architecture.md §7 (270M: 18 layers, globals 5/11/17, bases 1e6/1e4).
    c = config_from_gguf(open_gguf(default_model("gemma3")))
    assert isinstance(c, Gemma3Config)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_vocab) == (
        18,
        640,
        4,
        1,
        256,
        2048,
        262144,
    )
    assert (c.sliding_window, c.rope_base, c.rope_base_swa) == (512, 1e6, 1e4)
    assert [i for i, k in enumerate(c.layer_kinds()) if k == "attention"] == [5, 11, 17]
    assert c.tied_embeddings


QWEN36_27B = {
    # The real Qwen3.6-27B shape (../shared/spec/qwen35-architecture.md §1, "27B" column).
    "general.architecture": "qwen35",
    "qwen35.block_count": 65,
    "qwen35.nextn_predict_layers": 1,
    "qwen35.context_length": 262144,
    "qwen35.embedding_length": 5120,
    "qwen35.feed_forward_length": 17408,
    "qwen35.attention.head_count": 24,
    "qwen35.attention.head_count_kv": 4,
    "qwen35.attention.key_length": 256,
    "qwen35.attention.value_length": 256,
    "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
    "qwen35.rope.dimension_count": 64,
    "qwen35.rope.freq_base": 1e7,
    "qwen35.rope.dimension_sections": np.array([11, 11, 10, 0], dtype=np.int32),
    "qwen35.ssm.conv_kernel": 4,
    "qwen35.ssm.state_size": 128,
    "qwen35.ssm.group_count": 16,
    "qwen35.ssm.time_step_rank": 48,
    "qwen35.ssm.inner_size": 6144,
    "qwen35.full_attention_interval": 4,
    "qwen35.vocab_size": 248320,
}


def test_qwen36_27b_memory_matches_hand_calculation():
    c = config_from_metadata(QWEN36_27B)
    assert c.layer_kinds().count("attention") == 16 and c.layer_kinds().count("gated_deltanet") == 48
    est = estimate_memory(
        c, weights_bytes=0, mtp_weights_bytes=0, ctx_size=262144, cache_type_k="q8_0", cache_type_v="q8_0"
    )
    # By hand. q8_0 stores 32 values in 34 bytes. One attention layer, one token:
    #   4 KV heads x (256 K + 256 V) values x 34/32 bytes = 2176 bytes.
    # 16 attention layers x 2176 B x 262144 tokens = 9,126,805,504 B = 8.5 GiB exactly.
    assert est.kv_bytes == 16 * 2176 * 262144 == 9_126_805_504
    assert est.kv_bytes == 8.5 * GiB
    # The MTP block's own single attention layer: 2176 B x 262144 = 570,425,344 B = 0.53125 GiB.
    assert est.mtp_kv_bytes == 2176 * 262144 == 570_425_344
    # Gated DeltaNet state per layer and sequence, float32:
    #   conv: (4 - 1) x conv_dim (2 x 16 x 128 + 48 x 128 = 10240) x 4 B = 122,880 B
    #   SSM:  48 heads x 128 x 128 x 4 B = 3,145,728 B
    # 48 layers x 3,268,608 B = 156,893,184 B (149.6 MiB) for one slot.
    assert est.recurrent_bytes == 48 * (3 * 10240 * 4 + 48 * 128 * 128 * 4) == 156_893_184
    assert est.total_bytes == 9_126_805_504 + 570_425_344 + 156_893_184
    # Four slots share the context but each holds its own recurrent state.
    est4 = estimate_memory(c, 0, 0, 262144, parallel=4, cache_type_k="q8_0", cache_type_v="q8_0")
    assert est4.kv_bytes == est.kv_bytes and est4.recurrent_bytes == 4 * est.recurrent_bytes
    # f16 K with q4_0 V: 4 x (256 x 2 + 256 x 18/32) = 2624 B per layer and token.
    mixed = estimate_memory(c, 0, 0, 1000, cache_type_k="f16", cache_type_v="q4_0")
    assert mixed.ctx_size == 1024 and mixed.kv_bytes == 16 * 2624 * 1024


def test_sliding_window_cache_is_bounded():
    # Gemma 3 270M at 32768 ctx: the 3 global layers hold every token; the 15 sliding layers hold
    # pad256(min(32768, 512 window + 512 ubatch)) = 1024 cells (llama.cpp's llama_kv_cache_iswa).
    c = config_from_gguf(open_gguf(default_model("gemma3")))
    est = estimate_memory(c, 0, 0, 32768)
    per_cell = 1 * (256 + 256) * 2  # one f16 KV head of dim 256
    assert est.kv_bytes == (3 * 32768 + 15 * 1024) * per_cell


def test_unknown_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba9", {"mamba9.block_count": 1})
    with pytest.raises(
        GGUFError, match=r"unknown architecture 'mamba9' \(supported: gemma3, llama, qwen2, qwen3, qwen35\)"
    ):
        config_from_gguf(open_gguf(path))


def _tiny_llama(path, omit=(), metadata=None):
    md = metadata or tiny_llama_metadata()
    specs = config_from_metadata({"general.architecture": "llama", **md}).tensor_specs()
    write_gguf(path, "llama", md, tiny_model_tensors(specs, np.random.default_rng(0), omit=omit))


def test_synthetic_llama_loads(tmp_path):
    _tiny_llama(tmp_path / "m.gguf")
    c = config_from_gguf(open_gguf(tmp_path / "m.gguf"))
    assert (c.n_layer, c.n_head, c.n_head_kv, c.head_dim) == (2, 4, 2, 16)


def test_missing_required_tensor(tmp_path):
    _tiny_llama(tmp_path / "m.gguf", omit=["blk.1.attn_v.weight"])
    with pytest.raises(
        GGUFError, match=r"m\.gguf: required tensor 'blk\.1\.attn_v\.weight' is missing \(architecture llama\)"
    ):
        config_from_gguf(open_gguf(tmp_path / "m.gguf"))


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    md = tiny_llama_metadata()
    md["llama.feed_forward_length"] = 128
    _tiny_llama(tmp_path / "m2.gguf", metadata=md)
    g = open_gguf(tmp_path / "m2.gguf")
    g.metadata["llama.feed_forward_length"] = 96  # metadata that disagrees with the tensors
    with pytest.raises(
        GGUFError, match=r"tensor 'blk\.0\.ffn_gate\.weight' has shape \[128, 64\], the metadata implies \[96, 64\]"
    ):
        config_from_gguf(g)


def test_missing_and_mistyped_metadata():
    md = {"general.architecture": "llama", **tiny_llama_metadata()}
    del md["llama.embedding_length"]
    with pytest.raises(GGUFError, match=r"x\.gguf: required metadata key 'llama\.embedding_length' is missing"):
        config_from_metadata(md, source="x.gguf")
    md["llama.embedding_length"] = "64"
    with pytest.raises(GGUFError, match=r"metadata key 'llama\.embedding_length' should be an integer, got str"):
        config_from_metadata(md, source="x.gguf")


def test_inspect_text(capsys):
    assert main(["inspect", str(tinyqwen_path("Q4_K_M"))]) == 0
    out = capsys.readouterr().out
    assert "architecture   qwen35" in out
    assert "layer pattern  DDDA x 2" in out
    assert "Gated DeltaNet:               6 layers  0-2, 4-6" in out
    assert "full attention:               2 layers  3, 7" in out
    assert "MTP (NextN) block:            1 layer   8" in out
    for qtype in ("Q4_K", "Q6_K", "Q5_0", "F32"):
        assert f"\n  {qtype} " in out


def test_inspect_json_defaults_to_smollm2(capsys):
    default_model("smollm2")
    assert main(["inspect", "--json", "-c", "4096", "-ctk", "q8_0", "-ctv", "q8_0"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["architecture"] == "llama" and r["layer_kinds"] == ["attention"] * 30
    assert set(r["tensor_types"]) == {"Q4_1", "Q8_0", "F32"}
    # 30 layers x 3 KV heads x (64 + 64) values x 34/32 bytes per token, 4096 tokens.
    assert r["memory"]["kv_bytes"] == 30 * 3 * 128 * 34 // 32 * 4096


def test_inspect_gemma3(capsys):
    assert main(["inspect", str(default_model("gemma3"))]) == 0
    out = capsys.readouterr().out
    assert "layer pattern  SSSSSA x 3" in out and "full attention:               3 layers  5, 11, 17" in out
    assert "\n  Q5_0 " in out and "\n  Q4_K " in out and "\n  Q6_K " in out


def test_inspect_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(4))
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "smaller than a GGUF header" in err
