"""Tokenizer from GGUF metadata: token-exact with llama.cpp's test vectors and reference prompts, decoding
equal to llama-server's generated text, streaming decode equal to full decode."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpserve.gguf import GGUFError, open_gguf
from mtpserve.tokenizer import IncrementalDetokenizer, Tokenizer
from mtpserve.tokenizer.pretokenizers import PRE_TOKENIZERS

from ..conftest import TINYQWEN_QUANTS, tinyqwen_path
from ..support.ggufgen import write_gguf
from ..support.vocabs import REF_MODELS, VOCAB_VECTORS, model_tokenizer, reference, vector_cases, vocab_tokenizer

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- llama.cpp's own test vectors (tests/test-tokenizer-0: add_special=false, parse_special=false) ------


@pytest.mark.parametrize("name", VOCAB_VECTORS)
def test_llama_cpp_vocab_vectors(name):
    tok = vocab_tokenizer(name)
    cases = vector_cases(name)
    assert len(cases) >= 40
    wrong = [(text, tok.encode(text, add_special=False), ids) for text, ids in cases]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} of {len(cases)} vectors differ, first: {wrong[0]}"


def test_vector_vocabs_are_what_the_spec_says():
    qwen = vocab_tokenizer("qwen35")
    assert (qwen.vocab.model, qwen.vocab.pre, qwen.n_vocab) == ("gpt2", "qwen35", 151936)
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos) == (151643, 151643, False)
    assert qwen.token_id("<|im_start|>") == 151644 and qwen.is_special(151644)
    spm = vocab_tokenizer("llama-spm")
    assert (spm.vocab.model, spm.bos_id, spm.eos_id, spm.add_bos, spm.vocab.add_space_prefix) == (
        "llama",
        1,
        2,
        True,
        True,
    )


# -- llama-server's reference prompts and outputs ---------------------------------------------------


@pytest.mark.parametrize("ref", REF_MODELS)
def test_completion_prompt_ids_match_llama_server(ref):
    """/tokenize {add_special: true, parse_special: true}, what /completion evaluates."""
    tok = model_tokenizer(ref)
    for case in reference(ref)["greedy"]["completions"]:
        ids = tok.encode(case["prompt"], add_special=True, parse_special=True)
        assert ids == case["prompt_token_ids"], case["name"]


@pytest.mark.parametrize("ref", REF_MODELS)
def test_chat_prompt_ids_match_llama_server(ref):
    tok = model_tokenizer(ref)
    for case in reference(ref)["greedy"]["chat"]:
        ids = tok.encode(case["rendered_prompt"], add_special=True, parse_special=True)
        assert ids == case["prompt_token_ids"], case["name"]


@pytest.mark.parametrize("ref", REF_MODELS)
def test_generated_ids_decode_to_the_servers_text(ref):
    """The server renders control tokens only when "preserved" (<think>, </think> for Qwen chats) and drops
    end-of-generation tokens from the text."""
    tok = model_tokenizer(ref)
    data = reference(ref)["greedy"]
    for case in data["completions"]:
        ids = [i for i in case["generated_token_ids"] if not tok.is_eog(i)]
        assert tok.decode(ids, skip_special=True) == case["generated_text"], case["name"]
    preserved = [i for i in (tok.token_id("<think>"), tok.token_id("</think>")) if i is not None]
    for case in data["chat"]:
        ids = [i for i in case["generated_token_ids"] if not tok.is_eog(i)]
        assert tok.decode(ids, skip_special=True, keep_special=preserved) == case["generated_text_raw"], case["name"]


def test_tinyqwen_quants_share_one_vocabulary():
    vocabs = [open_gguf(tinyqwen_path(q)).metadata for q in TINYQWEN_QUANTS]
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    for md in vocabs[1:]:
        assert all(md[k] == vocabs[0][k] for k in keys)
        assert np.array_equal(md["tokenizer.ggml.token_type"], vocabs[0]["tokenizer.ggml.token_type"])
        assert md["tokenizer.chat_template"] == vocabs[0]["tokenizer.chat_template"]


# -- special tokens, BOS/EOS, end of generation -----------------------------------------------------


def test_parse_special_reads_control_tokens_only_on_request():
    tok = model_tokenizer("tinyqwen35-mtp-F16")
    im_start, think = tok.token_id("<|im_start|>"), tok.token_id("<think>")
    ids = tok.encode("<|im_start|>user<think>", parse_special=True)
    assert ids[0] == im_start and ids[-1] == think and tok.decode(ids) == "<|im_start|>user<think>"
    plain = tok.encode("<|im_start|>user<think>", parse_special=False)
    assert im_start not in plain and think not in plain
    assert tok.decode(plain) == "<|im_start|>user<think>"


def test_encodes_with_both_special_settings_at_once_give_each_its_own_ids():
    """Each setting has its own copy of the library's tokenizer (none is switched while another thread encodes
    with it), so many threads mixing the two get what one thread gets."""
    tok = model_tokenizer("tinyqwen35-mtp-F16")
    texts = [f"<|im_start|>user {i} <think>" * 50 for i in range(16)]
    expected = [(tok.encode(t, parse_special=True), tok.encode(t, parse_special=False)) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: (tok.encode(t, parse_special=True), tok.encode(t, parse_special=False)), texts))
    assert got == expected
    assert expected[0][0] != expected[0][1]


def test_user_defined_tokens_are_always_split_out():
    """llama.cpp splits USER_DEFINED tokens even with parse_special=false (Qwen's [PAD...] tokens)."""
    tok = vocab_tokenizer("qwen35")
    pad = tok.token_id("[PAD151646]")
    assert tok.encode("x[PAD151646]y", add_special=False, parse_special=False)[1] == pad
    assert not tok.is_special(pad)


def test_gemma_adds_bos_and_reads_its_control_tokens():
    tok = model_tokenizer("gemma-3-270m-q4_k_m")
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (2, 1, True, False)
    assert tok.encode("") == [2] and tok.encode("", add_special=False) == []
    turn = tok.token_id("<start_of_turn>")
    assert tok.encode("<start_of_turn>user", parse_special=True)[:2] == [2, turn]
    assert turn not in tok.encode("<start_of_turn>user", parse_special=False)


def test_end_of_generation_sets():
    """llama.cpp's EOG set: EOS plus tokens recognised by text (and FIM repo/pad/sep tokens)."""
    qwen = model_tokenizer("tinyqwen35-mtp-F16")
    assert qwen.eog_ids == {qwen.token_id("<|im_end|>"), qwen.token_id("<|endoftext|>")}
    assert qwen.eos_id == qwen.eot_id == qwen.token_id("<|im_end|>")
    smol = model_tokenizer("SmolLM2-135M-Instruct.Q4_1")
    assert {smol.token_id("<|im_end|>"), smol.token_id("<|endoftext|>")} <= smol.eog_ids
    gemma = model_tokenizer("gemma-3-270m-q4_k_m")
    assert {gemma.token_id("<eos>"), gemma.token_id("<end_of_turn>")} <= gemma.eog_ids
    assert gemma.eot_id == gemma.token_id("<end_of_turn>")


def test_encode_batch_equals_encode():
    tok = model_tokenizer("gemma-3-270m-q4_k_m")
    texts = ["Hello <start_of_turn>", "", "  two  spaces\n"]
    for parse_special in (False, True):
        expected = [tok.encode(t, parse_special=parse_special) for t in texts]
        assert tok.encode_batch(texts, parse_special=parse_special) == expected


def test_pieces_follow_token_to_piece():
    qwen = vocab_tokenizer("qwen35")
    assert qwen.token_bytes(qwen.token_id("Ġworld")) == b" world"
    assert qwen.token_bytes(151644) == b"<|im_start|>" and qwen.token_bytes(151644, special=False) == b""
    gemma = model_tokenizer("gemma-3-270m-q4_k_m")
    assert gemma.token_bytes(gemma.token_id("▁the")) == b" the"
    assert gemma.token_bytes(gemma.token_id("<0x0A>")) == b"\n"
    assert gemma.token_to_piece(gemma.token_id("<0xF0>")) == "\ufffd"  # a lone lead byte
    with pytest.raises(ValueError, match="out of range"):
        gemma.token_bytes(gemma.n_vocab)


def test_spm_space_prefix_and_byte_fallback():
    """llama-spm adds a space prefix (SPM default); characters outside the vocab become <0xXX> tokens."""
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("𝔘", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["▁", "<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]
    assert tok.encode("Hi") == [1, *tok.encode("Hi", add_special=False)]


# -- vocabularies we cannot tokenize are clear errors ------------------------------------------------


def _vocab_gguf(path, model="gpt2", pre="qwen2"):
    tokens = ["a", "b", "ab", "<|endoftext|>"]
    metadata = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
    }
    write_gguf(path, "llama", metadata)
    return path


def test_small_synthetic_vocab(tmp_path):
    tok = Tokenizer.from_gguf(_vocab_gguf(tmp_path / "v.gguf"))
    assert tok.encode("abab<|endoftext|>", parse_special=True) == [2, 2, 3]
    assert tok.bos_id is None and tok.eog_ids == {3}  # BPE's default BOS/EOS id 11 is outside this vocab


def test_duplicate_tokens_are_a_clear_error(tmp_path):
    path = tmp_path / "v.gguf"
    write_gguf(path, "llama", {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "a"]})
    with pytest.raises(GGUFError, match="token text 'a' appears twice"):
        Tokenizer.from_gguf(path)


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(GGUFError, match="unknown pre-tokenizer 'martian'.*supported: .*qwen35"):
        Tokenizer.from_gguf(_vocab_gguf(tmp_path / "v.gguf", pre="martian"))


def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path):
    with pytest.raises(GGUFError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf(_vocab_gguf(tmp_path / "v.gguf", model="t5"))


def test_supported_pre_tokenizers_include_the_required_ones():
    assert {"qwen2", "qwen35", "smollm", "llama-bpe", "default", "gpt-2"} <= set(PRE_TOKENIZERS)
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["llama-bpe"].add_bos


# -- properties ------------------------------------------------------------------------------------


@PROPERTY
@given(st.text())
def test_byte_level_round_trip(text):
    """For vocabularies holding all 256 byte tokens. (SmolLM2's lacks 21, e.g. 0x04 and 0xF1: llama.cpp
    drops such bytes from the output, and so does the library, so no round trip there.)"""
    for tok in (vocab_tokenizer("qwen35"), model_tokenizer("tinyqwen35-mtp-F16")):
        assert tok.decode(tok.encode(text, add_special=False)) == text


@PROPERTY
@given(st.text().filter(lambda s: "▁" not in s))
def test_sentencepiece_round_trip(text):
    """Exceptions, as in llama.cpp: a literal '▁' reads as a space (SPM escapes spaces as '▁'), and with
    add_space_prefix (llama-spm, not Gemma) the decoded text starts with the added space."""
    gemma = model_tokenizer("gemma-3-270m-q4_k_m")
    assert gemma.decode(gemma.encode(text, add_special=False)) == text
    spm = vocab_tokenizer("llama-spm")
    assert spm.decode(spm.encode(text, add_special=False)) == (" " + text if text else "")


@PROPERTY
@given(st.text(alphabet=st.sampled_from("ab 你好🦙𝔘é\n")), st.sampled_from(["qwen35", "gemma"]))
def test_incremental_decoding_never_breaks_a_character(text, which):
    tok = vocab_tokenizer("qwen35") if which == "qwen35" else model_tokenizer("gemma-3-270m-q4_k_m")
    ids = tok.encode(text, add_special=False)
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


@PROPERTY
@given(st.data())
def test_incremental_decoding_equals_full_decoding_at_every_split(data):
    """Any ids (byte tokens included, valid UTF-8 or not), cut anywhere: the stream equals decode()."""
    tok = model_tokenizer("gemma-3-270m-q4_k_m")
    byte_ids = [tok.token_id(f"<0x{b:02X}>") for b in range(256)]
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_ids), st.integers(0, tok.n_vocab - 1)), max_size=24))
    full = tok.decode(ids)
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        assert detok.add_many(ids[:cut]) + detok.add_many(ids[cut:]) + detok.flush() == full


def test_streaming_waits_for_the_rest_of_a_split_emoji():
    tok = vocab_tokenizer("qwen35")
    ids = tok.encode("𝔘!", add_special=False)  # 𝔘 is two tokens here: 3 bytes + 1 byte
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "" and detok.pending == b"\xf0\x9d\x94"
    assert detok.add(ids[1]) == "𝔘"
    assert detok.add_many(ids[2:]) + detok.flush() == "!"
