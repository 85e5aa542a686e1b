"""The CPU decode step as one C call (ops.decode_program) against the same step layer by layer: the same logits bit
for bit, the same caches and recurrent states afterwards, for each architecture's blocks; and the cases it must
leave to the layer-by-layer path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.models.base import Batch, CausalLM
from mtpserve.models.loader import load

from ..conftest import default_model, tinyqwen_path

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernel library did not build here")


def _model(name: str):
    return load(tinyqwen_path("Q4_K_M") if name == "tinyqwen35" else default_model(name))


def _decode(model, prompt: torch.Tensor, tokens: list[int], ctx: int, cache_type: str = "f16"):
    """Logits of each decoded token, and the state's caches and recurrent states at the end."""
    state = model.new_state(ctx, cache_type, cache_type)
    model.prefill(prompt, state)
    logits = torch.stack([model.decode(t, state) for t in tokens])
    caches = [(kv.k.data.clone(), kv.v.data.clone(), kv.positions.clone(), kv.length) for kv in state.kv.values()]
    recurrent = [(r.conv.clone(), r.ssm.clone()) for r in state.recurrent.values()]
    return logits, caches, recurrent, state


def _layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CausalLM, "decode_program", lambda self, state: None)


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        elif isinstance(x, (list, tuple)):
            _assert_same(x, y)
        else:
            assert x == y


@needs_kernels
@pytest.mark.parametrize("name", ["smollm2", "gemma3", "tinyqwen35"])
def test_decode_program_equals_the_layers_one_by_one(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's blocks, Gemma 3's (query scale, post-norms, two RoPE tables, GeGLU) and Qwen3.5's (Gated DeltaNet
    mixers, sigmoid-gated attention), past 512 cells where a single query's attention splits the cache in two."""
    model = _model(name)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.n_vocab, (505,), generator=gen)
    tokens = torch.randint(0, model.config.n_vocab, (12,), generator=gen).tolist()
    with monkeypatch.context() as m:
        calls = _count_program_calls(m)
        program = _decode(model, prompt, tokens, 768)
    assert len(calls) == len(tokens)  # every decode took the one call
    assert len(program[3].programs["trunk"].blocks) == 2 * model.config.n_layer
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        layers = _decode(model, prompt, tokens, 768)
    _assert_same(program[:3], layers[:3])


def _verify_shaped(model, prompts: list[torch.Tensor], drafts: list[list[int]], program: bool):
    """A draft verification's pass (every sequence's next tokens at once, each DeltaNet state after every token kept)
    through the program or the layers: hidden states, logits, each state's caches and recurrent states, the kept
    states."""
    states = []
    for prompt in prompts:
        state = model.new_state(1024)
        model.prefill(prompt, state)
        states.append(state)
    tokens = [t for draft in drafts for t in draft]
    if program:
        steps: dict = {}
        out = model.program_decode(tokens, states, steps, logits=True)
        assert out is not None, "the program must serve a verification of this shape"
        hidden, logits = out
    else:
        batch = Batch.of(torch.tensor(tokens), states)
        batch.keep_steps = True
        hidden, steps = model.forward_batch(batch), batch.steps
        logits = model.logits_on_device(hidden, len(drafts[0]))
    caches = [[(kv.k.data, kv.v.data, kv.positions, kv.length) for kv in st.kv.values()] for st in states]
    recurrent = [[(r.conv, r.ssm) for r in st.recurrent.values()] for st in states]
    kept = [[[(r.conv, r.ssm) for r in per_token] for per_token in steps[layer]] for layer in sorted(steps)]
    return hidden, logits, caches, recurrent, kept


@needs_kernels
@pytest.mark.parametrize("name", ["smollm2", "gemma3", "tinyqwen35"])
@pytest.mark.parametrize("n_seq", [1, 3])
def test_a_verification_through_the_program_equals_the_layers(name: str, n_seq: int) -> None:
    """Several tokens a sequence (a draft's verification: 3 here) of one or several sequences at different depths in
    one program call: the layers' hidden states, logits, caches and recurrent states bit for bit, and the DeltaNet
    states after every token (the rollback points) kept as the layers keep them."""
    model = _model(name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.n_vocab, (n,), generator=gen) for n in (37, 520, 99)[:n_seq]]
    drafts = [torch.randint(0, model.config.n_vocab, (3,), generator=gen).tolist() for _ in range(n_seq)]
    program = _verify_shaped(model, prompts, drafts, program=True)
    layers = _verify_shaped(model, prompts, drafts, program=False)
    assert (len(program[4]) > 0) == (name == "tinyqwen35")
    _assert_same(program, layers)


def _count_program_calls(m: pytest.MonkeyPatch) -> list[int]:
    """The decode program's C calls (a decode pass, or the blocks alone) from here on."""
    calls: list[int] = []
    for name in ("mtp_decode_pass", "mtp_run_blocks"):
        entry = getattr(cpu_kernels.load(), name)
        m.setattr(cpu_kernels.load(), name, lambda *a, entry=entry: calls.append(1) or entry(*a))
    return calls


def _gemma_with_rings() -> CausalLM:
    model = _model("gemma3")
    model.config = dataclasses.replace(model.config, sliding_window=16)  # rings of 256 cells (ubatch 8)
    model.ubatch = 8
    return model


@needs_kernels
def test_a_sliding_window_ring_stays_in_the_program_past_its_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's sliding layers keep a ring of cells (position p in cell p % 256 here): the program serves before and
    after the ring wraps, its numbers those of the layers (which read the ring's filled cells in cell order)."""
    model = _gemma_with_rings()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.n_vocab, (250,), generator=gen)
    tokens = torch.randint(0, model.config.n_vocab, (10,), generator=gen).tolist()
    state = model.new_state(512)
    assert any(kv.ring and kv.capacity == 256 for kv in state.kv.values())
    with monkeypatch.context() as m:
        calls = _count_program_calls(m)
        program = _decode(model, prompt, tokens, 512)
    assert len(calls) == 10  # positions 250..259: 256.. wrap the rings
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        layers = _decode(model, prompt, tokens, 512)
    _assert_same(program[:3], layers[:3])


def _decode_after_a_rollback(model, prompt, tokens: list[int], program: bool, monkeypatch: pytest.MonkeyPatch):
    """Decode past a ring's wrap, roll back 3 positions (a rejected draft: cells emptied), decode on: the logits after
    the rollback, the caches, and how many steps the program served."""
    with monkeypatch.context() as m:
        if not program:
            _layer_by_layer(m)
        calls = _count_program_calls(m)
        state = model.new_state(512)
        model.prefill(prompt, state)
        for t in tokens[:6]:
            model.decode(t, state)
        for kv in state.kv.values():
            kv.truncate(state.n_past - 3)
        state.n_past -= 3
        logits = torch.stack([model.decode(t, state) for t in tokens[6:]])
    caches = [(kv.k.data.clone(), kv.v.data.clone(), kv.positions.clone(), kv.length) for kv in state.kv.values()]
    return logits, caches, len(calls)


@needs_kernels
def test_a_ring_with_cells_a_rollback_emptied_leaves_the_program_until_they_are_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a rollback past the wrap, a ring has empty cells that the layer path leaves out of its view: the steps
    go layer by layer until the positions reach them again, then back to the program; the numbers are the layers'."""
    model = _gemma_with_rings()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.n_vocab, (255,), generator=gen)
    tokens = torch.randint(0, model.config.n_vocab, (12,), generator=gen).tolist()
    *program, served = _decode_after_a_rollback(model, prompt, tokens, True, monkeypatch)
    *layers, _ = _decode_after_a_rollback(model, prompt, tokens, False, monkeypatch)
    # positions 255..260, then 258..263 after the rollback: 258-260 refill the emptied cells layer by layer
    assert served == 6 + 3
    _assert_same(program, layers)


@needs_kernels
def test_a_ring_cut_back_to_its_start_is_whole_again_after_one_ring_of_positions() -> None:
    """A new request cuts the slot back to 0 (every cell emptied): the ring has holes until it has written as many
    positions as it has cells, and none after, however long the conversation before it was."""
    model = _gemma_with_rings()
    state = model.new_state(1024)
    model.prefill(torch.arange(700) % model.config.n_vocab, state)
    ring = next(kv for kv in state.kv.values() if kv.ring)
    for kv in state.kv.values():
        kv.truncate(0)
    state.n_past = 0
    assert ring.has_holes
    model.prefill(torch.arange(ring.capacity - 1), state)  # one short of every cell
    assert ring.has_holes
    model.decode(1, state)
    assert not ring.has_holes


@needs_kernels
def test_logits_that_are_not_the_plain_product_come_from_the_model_after_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the logits are more than the output layer's product (Gemma's soft-capping), the pass stops at the final
    norm and the model's own `logits_on_device` makes them: here a stand-in post-step, so the C head cannot pass."""
    model = _model("gemma3")
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.config.n_vocab, (20,), generator=gen)
    plain = _decode(model, prompt, [5, 6], 64)[0]
    logits_on_device = model.logits_on_device
    monkeypatch.setattr(model, "head_is_product", lambda: False)
    monkeypatch.setattr(model, "logits_on_device", lambda h, seq_len=None: logits_on_device(h, seq_len) * 0.5)
    del model._decode_head  # made at first use: made again without the head
    with monkeypatch.context() as m:
        calls = _count_program_calls(m)
        halved = _decode(model, prompt, [5, 6], 64)[0]
    assert len(calls) == 2 and model.decode_head().n_vocab == 0
    assert torch.equal(halved, plain * 0.5)


@needs_kernels
def test_a_token_outside_the_table_fails_the_pass_and_moves_nothing() -> None:
    model = _model("smollm2")
    state = model.new_state(64)
    model.prefill(torch.tensor([1, 2, 3]), state)
    with pytest.raises(IndexError, match="out of range"):
        model.program_decode([model.config.n_vocab], [state], logits=True)
    assert state.n_past == 3 and all(kv.length == 3 for kv in state.kv.values())
    assert model.decode(4, state).shape == (model.config.n_vocab,)


@needs_kernels
def test_quantized_kv_caches_stay_layer_by_layer() -> None:
    model = _model("smollm2")
    state = model.new_state(256, "q8_0", "q8_0")
    assert model.decode_program(state) is None
    assert state.programs["trunk"] is False  # decided once per state
    model.decode(1, state)
    assert state.n_past == 1


def _mtp_rows(model, program: bool, monkeypatch: pytest.MonkeyPatch):
    """Catch-up rows for 3 tokens, then two chained draft steps, through the MTP block: logits, hidden states, and
    the MTP cache afterwards."""
    if not program:
        program_over = model.program_over
        monkeypatch.setattr(
            model, "program_over", lambda s, name, layers: None if name == "mtp" else program_over(s, name, layers)
        )
    gen = torch.Generator().manual_seed(3)
    state = model.new_state(1024, mtp=True)
    hidden = model.forward(torch.randint(0, model.config.n_vocab, (40,), generator=gen), state)
    tokens = torch.randint(0, model.config.n_vocab, (40,), generator=gen)
    outs = [model.mtp_step(hidden[:-1], tokens[1:], state)]  # a prompt's rows, past 8 tokens: the layer path
    outs.append(model.mtp_step(hidden[-3:], torch.tensor([5, 6, 7]), state))  # catch-up rows after a verification
    h = outs[-1][1][-1:]
    for token in (8, 9):  # chained drafts: each step reads the last one's hidden state
        outs.append(model.mtp_step(h, torch.tensor([token]), state))
        h = outs[-1][1]
    assert bool(state.programs.get("mtp")) == program  # the steps of up to 8 rows took the program, or could not
    kv = state.kv[model.mtp_kv_index]
    return outs, (kv.k.data, kv.v.data, kv.positions, kv.length)


@needs_kernels
def test_the_mtp_block_through_the_program_equals_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5's MTP block (a draft step, its catch-up rows) as a decode program over the state's MTP cache: the
    layer's logits, hidden states and cache bit for bit."""
    model = _model("tinyqwen35")
    with monkeypatch.context() as m:
        program = _mtp_rows(model, True, m)
    with monkeypatch.context() as m:
        layer = _mtp_rows(model, False, m)
    _assert_same(program, layer)


def _eager_drafts(model, state, hidden, tokens, n_steps, head, top_k=40, p_min=0.0):
    """The drafter's eager chain (engine.drafters.MTPDrafter._proposals without the C call): `mtp_step`, then the
    head's row, its argmax and the argmax's softmax over the top_k, each step fed the last."""
    from mtpserve.ops.linear import linear

    out, ids = [], torch.tensor(tokens)
    for _ in range(n_steps):
        _, h = model.mtp_step(hidden, ids, state, with_logits=False)
        hidden = h[-1:]
        top = linear(hidden, head)[0].float().topk(top_k)
        out.append((int(top.indices[0]), float(torch.softmax(top.values, 0)[0])))
        if out[-1][1] < p_min:
            break
        ids = torch.tensor([out[-1][0]])
    return out


@needs_kernels
@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0", "Q6_K", "F16"])
@pytest.mark.parametrize(
    ("n_rows", "n_steps", "draft_vocab", "p_min"), [(1, 2, 0, 0.0), (3, 3, 0, 0.0), (2, 4, 1024, 0.2)]
)
def test_the_mtp_draft_chain_in_one_call_equals_the_eager_steps(quant, n_rows, n_steps, draft_vocab, p_min) -> None:
    """`mtp_draft` (the whole greedy chain in one C call): the eager steps' tokens, the same MTP cache bit for bit
    (every step's rows at their positions), and each token's top-40 softmax to float32 rounding (the sum's order
    differs from torch's); with p_min the chain stops after the first draft below it, as the eager one does. Step 0
    takes several rows (catch-up rows waiting, then the sampled token's); a trimmed draft vocabulary scores the
    head's first rows."""
    model = load(tinyqwen_path(quant))
    head = model.mtp_head.first_rows(draft_vocab) if draft_vocab else model.mtp_head
    gen = torch.Generator().manual_seed(n_rows)
    prompt = torch.randint(0, model.config.n_vocab, (40,), generator=gen)
    hidden = torch.randn(n_rows, model.config.n_embd, generator=gen)
    tokens = torch.randint(0, model.config.n_vocab, (n_rows,), generator=gen).tolist()
    results = []
    for chain in (True, False):
        state = model.new_state(256, mtp=True)
        with torch.inference_mode():
            trunk = model.forward_batch(Batch.of(prompt, [state]))
            model.mtp_step(torch.cat((trunk.new_zeros(1, trunk.shape[-1]), trunk[:-1])), prompt, state, False)
            if chain:
                drafts = model.mtp_draft(hidden, tokens, state, n_steps, head, 40, p_min)
            else:
                drafts = _eager_drafts(model, state, hidden, tokens, n_steps, head, 40, p_min)
        kv = state.kv[model.mtp_kv_index]
        results.append((drafts, kv.k.data.clone(), kv.v.data.clone(), kv.positions.clone(), kv.length))
    (chain, *chain_cache), (eager, *eager_cache) = results
    assert [t for t, _ in chain] == [t for t, _ in eager]
    assert len(chain) == (n_steps if p_min == 0 else len(eager)) and (p_min == 0 or len(chain) < n_steps)
    for (_, p), (_, q) in zip(chain, eager):
        assert p == pytest.approx(q, rel=1e-5)
    _assert_same(chain_cache, eager_cache)
    assert chain_cache[-1] == 40 + n_rows + len(chain) - 1


def _counted(step, calls: list[int], serve: bool):
    """`step`, each call counted; None (cannot serve) unless `serve`."""

    def call(*args):
        calls.append(1)
        return step(*args) if serve else None

    return call


def _drawn_drafts(model, monkeypatch: pytest.MonkeyPatch, params, n_max: int, patched: str, serve: bool) -> tuple:
    """Drafts drawn at a temperature by the MTP drafter's steps from a fixed state (two rows waiting, random hidden
    states), with the model's method `patched` counted and left to serve only if `serve`: (drafts, each step's
    distribution, the MTP cache, calls to `patched`)."""
    from mtpserve.engine import SpecConfig
    from mtpserve.engine.drafters import MTPDrafter
    from mtpserve.engine.rejection import DraftPicker
    from mtpserve.engine.sampling import Mt19937Uniform, Sampler

    drafter = MTPDrafter(model, SpecConfig("draft-mtp", n_max=n_max))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.n_vocab, (40,), generator=gen)
    hidden = torch.randn(2, model.config.n_embd, generator=gen)
    tokens = torch.randint(0, model.config.n_vocab, (2,), generator=gen).tolist()
    state = model.new_state(256, mtp=True)
    picker = DraftPicker(Sampler(params), None, Mt19937Uniform(9), model.config.n_vocab)
    calls: list[int] = []
    with torch.inference_mode(), monkeypatch.context() as m:
        m.setattr(model, patched, _counted(getattr(model, patched), calls, serve))
        trunk = model.forward_batch(Batch.of(prompt, [state]))
        model.mtp_step(torch.cat((trunk.new_zeros(1, trunk.shape[-1]), trunk[:-1])), prompt, state, False)
        drafts = list(drafter._proposals(state, hidden, tokens, n_max, picker))
    kv = state.kv[model.mtp_kv_index]
    return drafts, picker.qs, (kv.k.data.clone(), kv.v.data.clone(), kv.positions.clone(), kv.length), len(calls)


def _same_draws(a: list, b: list, qs_a: list, qs_b: list) -> None:
    """The same tokens, their argmax's p to the float32 sums' rounding, the same distributions in the same order."""
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, p), (_, q) in zip(a, b, strict=True):
        assert p == pytest.approx(q, rel=1e-5)
    for q_a, q_b in zip(qs_a, qs_b, strict=True):
        assert list(q_a) == list(q_b)
        torch.testing.assert_close(torch.tensor(list(q_a.values())), torch.tensor(list(q_b.values())))


@needs_kernels
@pytest.mark.parametrize("quant", ["Q4_K_M", "F16"])
def test_drafts_drawn_on_the_host_step_in_c_as_eagerly(quant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts drawn at a temperature (--spec-draft-sampling probabilistic) on the CPU from a chain the C chain does
    not run (penalties): each step one C call (`mtp_draft_row`: the block's step and the head's whole row), the
    token drawn on the host from it. The eager steps' tokens and distributions (bit for bit: the same row), and
    the same MTP cache bit for bit."""
    from mtpserve.engine.sampling import SamplingParams

    model = load(tinyqwen_path(quant))
    params = SamplingParams(temperature=1.5, top_k=200, top_p=1.0, min_p=0.0, repeat_penalty=1.3, seed=1)
    stepped, qs, cache, calls = _drawn_drafts(model, monkeypatch, params, 3, "mtp_draft_row", serve=True)
    eager, eager_qs, eager_cache, _ = _drawn_drafts(model, monkeypatch, params, 3, "mtp_draft_row", serve=False)
    assert calls == 3 and len(stepped) == 3 and all(len(q) == 200 for q in qs)
    _same_draws(stepped, eager, qs, eager_qs)
    assert qs == eager_qs
    _assert_same(cache, eager_cache)


@needs_kernels
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8},  # the server's chain: top-k 40, top-p 0.95, min-p 0.05
        {"temperature": 1.5, "top_k": 300, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.5, "min_p": 0.9, "min_keep": 2},
        {"temperature": 1.0, "logit_bias": {t: float("-inf") for t in range(0, 4096, 2)}},  # ignore_eos's kind
    ],
    ids=["server-defaults", "hot-wide", "min-keep", "bans"],
)
def test_drafts_drawn_in_the_c_chain_are_the_hosts_draws(params: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts drawn in one C call (`mtp_draft` with a DrawnChain: blocks.c's chain over the head's row, the CPU
    twin of ops.sampling_chain) against the same draws made on the host a step at a time from the same uniforms:
    the same tokens, each step's distribution (survivors in order, probabilities to float64 rounding), and the
    same MTP cache bit for bit."""
    from mtpserve.engine.sampling import SamplingParams

    model = load(tinyqwen_path("Q4_K_M"))
    sampling = SamplingParams(**params, seed=1)
    in_c, qs, cache, calls = _drawn_drafts(model, monkeypatch, sampling, 4, "mtp_draft", serve=True)
    on_host, host_qs, host_cache, _ = _drawn_drafts(model, monkeypatch, sampling, 4, "mtp_draft", serve=False)
    assert calls == 1 and len(in_c) == 4
    _same_draws(in_c, on_host, qs, host_qs)
    _assert_same(cache, host_cache)


def test_the_mtp_draft_chain_leaves_what_it_cannot_serve_to_the_eager_steps() -> None:
    """No chain where the block's program cannot serve (a quantized MTP cache) or the cache lacks room for every
    step's row; the drafter then steps eagerly."""
    model = _model("tinyqwen35")
    hidden, head = torch.zeros(1, model.config.n_embd), model.mtp_head
    quantized = model.new_state(256, "q8_0", "q8_0", mtp=True)
    assert model.mtp_draft(hidden, [1], quantized, 2, head, 40, 0.0) is None
    full = model.new_state(256, mtp=True)
    full.kv[model.mtp_kv_index].length = full.capacity - 2
    assert model.mtp_draft(hidden, [1], full, 3, head, 40, 0.0) is None
    assert model.mtp_draft(hidden, [1], full, 2, head, 40, 0.0) is not None
