"""The synthetic 27B-shaped GGUF (mtpserve.tuning.synthetic): llama-quantize's Q4_K_M types, the real file's size,
a file our loader and llama.cpp read, and at the 27B's widths llama.cpp's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mtpserve.gguf import open_gguf
from mtpserve.models.loader import load
from mtpserve.tuning.synthetic import Qwen35Shape, tensor_chunks, tensors, write

from ..conftest import shared_path, tinyqwen_path

VOCAB = shared_path("fixtures", "vocab", "ggml-vocab-qwen35.gguf")
TEMPLATE = tinyqwen_path("Q4_K_M")
REFERENCE = Path(__file__).parents[1] / "fixtures" / "qwen35_27b_4L_llama.json"
# the tinyqwen35 fixture's hyperparameters (made by llama.cpp's converter and llama-quantize)
TINY = Qwen35Shape(
    n_layer=8, n_embd=256, n_ff=768, n_head=4, n_head_kv=2, head_dim=64, n_vocab=4096, ssm_state=32, ssm_groups=2,
    ssm_rank=4, rope_dims=16, context_length=4096,
)  # fmt: skip
SMALL = Qwen35Shape(
    n_layer=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, ssm_state=32, ssm_groups=2, ssm_rank=8,
    rope_dims=16, context_length=4096,
)  # fmt: skip


def test_the_plan_is_what_llama_quantize_made_of_the_tiny_model():
    """Every tensor of the tinyqwen35 Q4_K_M fixture, by name, shape and type -- the fallback types of rows that
    are not whole super-blocks included -- is the plan for its shape."""
    gguf = open_gguf(TEMPLATE)
    made = {t.name: (tuple(t.ne), t.ggml_type.name) for t in gguf.tensors.values()}
    planned = {t.name: (t.ne, t.type) for t in tensors(TINY)}
    assert planned == made


def test_the_27b_plan_is_the_size_of_the_real_file():
    """16,799,719,424 bytes: the size llama-bench reports (15.65 GiB) for the deployment's Q4_K_M file."""
    specs = tensors(Qwen35Shape())
    assert sum(t.nbytes for t in specs) == 16_799_719_424
    assert len(specs) == 866 and sum(t.type == "Q6_K" for t in specs) == 67  # output, 33 attn_v/qkv, 33 ffn_down


def test_a_small_file_loads_and_decodes(tmp_path):
    path = tmp_path / "small.gguf"
    size = write(path, SMALL, VOCAB, TEMPLATE, seed=3)
    assert size == path.stat().st_size
    gguf = open_gguf(path)
    assert {t.name: t.ggml_type.name for t in gguf.tensors.values()} == {t.name: t.type for t in tensors(SMALL)}
    assert gguf.metadata["tokenizer.ggml.tokens"][-1] == f"[PAD{SMALL.n_vocab - 1}]"
    model = load(path)
    state = model.new_state(64)
    logits = model.logits(model.forward(torch.tensor([1, 2, 3, 4]), state))
    assert logits.shape == (4, SMALL.n_vocab) and torch.isfinite(logits).all()
    # the same seed, the same bytes; another seed, others
    spec = next(t for t in tensors(SMALL) if t.name == "blk.0.ffn_down.weight")
    written = np.fromfile(path, np.uint8, spec.nbytes, offset=gguf.tensors[spec.name].offset).tobytes()
    assert b"".join(tensor_chunks(spec, 3)) == written
    assert b"".join(tensor_chunks(spec, 4)) != b"".join(tensor_chunks(spec, 3))


@pytest.mark.slow  # writes a 2.7 GiB file and runs 4 layers at the 27B's widths (~2 min): `make test-all`
def test_greedy_tokens_at_the_27b_widths_match_llama_cpp(tmp_path):
    """The 4-layer file at the 27B's widths (bench/make_qwen35_27b.py --layers 4, seed 0): llama-server's greedy
    tokens (bench/record_llama_ref.py) up to the first near tie of each prompt."""
    path = tmp_path / "qwen35-27b-4L.gguf"
    write(path, Qwen35Shape(n_layer=4), VOCAB, TEMPLATE, seed=0)
    model = load(path)
    compared = 0
    for case in json.loads(REFERENCE.read_text())["cases"]:
        expected = case["generated_token_ids"]
        stop = min(case["near_tie_positions"], default=len(expected))
        state = model.new_state(256)
        logits = model.logits(model.forward(torch.tensor(case["prompt_token_ids"]), state))[-1]
        ours = []
        for _ in range(stop):
            ours.append(int(logits.argmax()))
            logits = model.logits(model.forward(torch.tensor(ours[-1:]), state))[-1]
        assert ours == expected[:stop], case["text"]
        compared += stop
    assert compared >= 25
