"""Tensor parallelism (`--split-mode row`, issue 40) on the CPU: two ranks as threads of one process (ThreadGroup),
each holding its share of every block (models.tensor_parallel), exchanging partial sums and logits
(ops.collective). Held to one rank's greedy tokens up to the first near tie: the reduction order changes float
rounding only. tinyqwen35's logits agree to ~1e-6 until such a difference tips an activation's int8 rounding (the
kernels round the inputs of every matrix product to 8 bits, as llama.cpp's do): that row moves by a rounding step
(~1e-2), and the recurrent state and the caches carry it on (up to ~0.1 over 24 tokens). Gemma 3 270M is chaotic
under rounding: one float32 ulp on its embeddings moves a logit by ~1.5 on one rank alone."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
import torch

from mtpserve.models.base import Batch
from mtpserve.models.loader import load
from mtpserve.models.tensor_parallel import Partition, attention_share, deltanet_share, ffn_share
from mtpserve.ops.collective import GatheredQTensor, ReducedQTensor, ThreadGroup
from mtpserve.quant.types import GGMLType

from ..conftest import default_model, shared_path, tinyqwen_path

NEAR_TIE = 0.05  # nats, as in the fixtures


def _rank(rank: int, size: int = 2, shares: tuple[float, ...] = ()) -> Partition:
    return Partition(ThreadGroup(size).member(rank), shares)


# --- shares -------------------------------------------------------------------------------------------------


def test_the_27bs_deltanet_heads_split_in_their_tiled_order():
    """16 K heads, 48 V heads (V head j reads K head j % 16): rank 0 holds K heads 0-7 and the V heads that read
    them, in three runs; the out projection's columns are those heads' 128-wide slices, whole Q5_K blocks."""
    shares = [deltanet_share(_rank(r), 16, 48, 128, GGMLType.Q5_K) for r in range(2)]
    assert shares[0].k_heads == range(0, 8) and shares[1].k_heads == range(8, 16)
    assert shares[0].v_heads == (*range(0, 8), *range(16, 24), *range(32, 40))
    assert shares[0].v_runs(128) == ((0, 1024), (2048, 3072), (4096, 5120))
    # q | k | v channels: key_dim 2048, so k starts at 2048 and v at 4096
    assert shares[1].qkv_rows(128, 2048) == ((1024, 2048), (3072, 4096), (5120, 6144), (7168, 8192), (9216, 10240))
    # locally the V heads stay tiled: local V head i reads local K head i % 8
    for s in shares:
        assert all(j % 16 - s.k_heads.start == i % 8 for i, j in enumerate(s.v_heads))


def test_a_model_held_whole_reads_its_deltanet_projections_from_the_file():
    """One rank holds every head, so q | k | v's three row runs are one range: the projection is a view of the
    file's mapping, not a copy (the 27B held 1.7 GB of such copies in its own memory)."""
    path = tinyqwen_path("Q4_K_M")
    model = load(path)
    mapped = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path.resolve())):
                start, end = (int(a, 16) for a in line.split()[0].split("-"))
                mapped.append((start, end))
    mixers = [layer.mixer for layer in model.layers if layer.recurrent]
    assert mixers and mapped
    for mixer in mixers:
        for q in mixer.w.projections:
            assert any(a <= q.data.data_ptr() < b for a, b in mapped), q.name


def test_attention_heads_take_their_kv_heads_and_share_one_when_fewer():
    big = [attention_share(_rank(r), 24, 4, 256, GGMLType.Q4_K) for r in range(2)]  # the 27B
    assert [(s.heads, s.kv_heads) for s in big] == [(range(0, 12), range(0, 2)), (range(12, 24), range(2, 4))]
    assert big[1].out_columns(256) == ((3072, 6144),)
    gemma = [attention_share(_rank(r), 4, 1, 256, GGMLType.Q4_K) for r in range(2)]  # one KV head, held by both
    assert [(s.heads, s.kv_heads) for s in gemma] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    # 64-wide heads cannot be cut out of a 256-wide Q4_K block: every rank holds the whole block
    tiny = attention_share(_rank(1), 4, 2, 64, GGMLType.Q4_K)
    assert (tiny.heads, tiny.kv_heads, tiny.partition.split) == (range(4), range(2), False)
    # fewer heads than ranks, or shares that leave a rank none: whole on every rank (a head on two ranks would be
    # summed twice)
    for share in (
        attention_share(_rank(1), 1, 1, 256, GGMLType.Q8_0),
        attention_share(_rank(0, shares=(1, 9)), 4, 4, 256, GGMLType.Q8_0),
    ):
        assert not share.partition.split and share.heads == range(share.heads.stop)
    assert not deltanet_share(_rank(1), 1, 2, 128, GGMLType.Q8_0).partition.split
    assert attention_share(_rank(1), 4, 2, 64, GGMLType.Q8_0).heads == range(2, 4)  # 32-wide blocks: cut


def test_ffn_columns_are_whole_blocks_in_proportion_to_the_shares():
    assert ffn_share(_rank(0), 17408, GGMLType.Q4_K).columns == ((0, 8704),)
    assert ffn_share(_rank(1, shares=(3, 1)), 2048, GGMLType.Q6_K).columns == ((1536, 2048),)
    assert ffn_share(_rank(1), 768, GGMLType.Q6_K).columns == ((256, 768),)  # 3 blocks: 1 and 2
    assert not ffn_share(_rank(0), 96, GGMLType.Q4_K).partition.split  # under one block: whole
    assert ffn_share(Partition(), 768, GGMLType.Q6_K).columns == ((0, 768),)


# --- models ---------------------------------------------------------------------------------------------------


def _cases(ref_name: str) -> list[dict]:
    ref = json.loads(shared_path("fixtures", "refs", f"{ref_name}.json").read_text())
    return ref["greedy"]["completions"] + ref["greedy"]["chat"]


def _teacher_forced(model, case: dict, n: int, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Logits over a fixture case: the prompt's last (the prompt path), then its generated tokens one by one
    (decode), then three at once (a draft's verification); with `mtp`, the MTP head's over the whole sequence."""
    prompt, generated = case["prompt_token_ids"], case["generated_token_ids"][:n]
    state = model.new_state(1024, mtp=mtp) if mtp else model.new_state(1024)
    with torch.inference_mode():
        rows = [model.prefill(prompt, state)]
        rows += [model.decode(t, state) for t in generated[:-4]]
        verified = model.logits(model.forward(torch.tensor(generated[-4:-1]), state), seq_len=3)
        out = {"logits": torch.cat((torch.stack(rows), verified))}
        if mtp:
            tokens = torch.tensor(prompt + generated)
            hidden = model.forward(tokens, model.new_state(1024))
            previous = torch.cat((torch.zeros_like(hidden[:1]), hidden[:-1]))
            out["mtp"] = model.mtp_step(previous, tokens, model.new_state(1024, mtp=True))[0]
    return out


def _first_near_tie(logits: torch.Tensor) -> int:
    top2 = torch.log_softmax(logits.float(), -1).topk(2, -1).values
    ties = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE).nonzero()
    return int(ties[0]) if len(ties) else len(logits)


def _same_tokens_up_to_a_near_tie(one: torch.Tensor, split: torch.Tensor, what: str) -> None:
    first_tie = _first_near_tie(one)
    a, b = one.argmax(-1)[:first_tie], split.argmax(-1)[:first_tie]
    assert torch.equal(a, b), f"{what}: greedy token {int((a != b).nonzero()[0])} differs before the near tie"


def _tinyqwen_runs(quant: str, n: int = 24) -> tuple[list[dict], list[list[dict]]]:
    path, cases = tinyqwen_path(quant), _cases(f"tinyqwen35-mtp-{quant}")
    one = [_teacher_forced(load(path), c, n, mtp=True) for c in cases]

    def rank_runs(rank):
        model = load(path, partition=Partition(rank))
        return [_teacher_forced(model, c, n, mtp=True) for c in cases]

    return one, ThreadGroup(2).run(rank_runs)


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0"])
def test_tinyqwen35_on_two_ranks_gives_one_ranks_logits_and_mtp_drafts(quant):
    """Q4_K_M: its Gated DeltaNet blocks and FFNs split (its attention's 64-wide heads sit in 256-wide Q4_K blocks, so
    those blocks are whole on each rank); Q8_0 (32-wide blocks): every block split, the MTP block's attention too.
    The prompt path, decode, a verification and the MTP head."""
    one, (rank0, rank1) = _tinyqwen_runs(quant)
    for case, a, b, c in zip(_cases(f"tinyqwen35-mtp-{quant}"), one, rank0, rank1):
        for part in ("logits", "mtp"):
            assert torch.equal(b[part], c[part]), "the ranks' results differ"  # rank-order sums: same bits
            _same_tokens_up_to_a_near_tie(a[part], b[part], f"{case['name']} {part}")


@pytest.mark.parametrize("quant, kv_share", [("Q4_K_M", 1), ("Q8_0", 2)])
def test_a_ranks_share_of_tinyqwen35_holds_half_its_split_state(quant, kv_share):
    path = tinyqwen_path(quant)
    whole = load(path).new_state(256, mtp=True)
    shares = ThreadGroup(2).run(lambda rank: load(path, partition=Partition(rank)).new_state(256, mtp=True))
    for state in shares:
        assert state.recurrent_nbytes * 2 == whole.recurrent_nbytes  # half the DeltaNet heads
        assert state.kv_nbytes * kv_share == whole.kv_nbytes  # Q4_K_M: attention whole (above); Q8_0: half its heads


def test_gemma3_on_two_ranks_gives_one_ranks_greedy_tokens():
    """Every block split: 2 of the 4 query heads a rank, the one KV head held by both, half the FFN's blocks."""
    path, cases = default_model("gemma3"), _cases("gemma-3-270m-q4_k_m")[:3]
    one = [_teacher_forced(load(path), c, 16)["logits"] for c in cases]

    def rank_runs(rank):
        model = load(path, partition=Partition(rank))
        assert isinstance(model.layers[0].down, ReducedQTensor) and isinstance(model.output, GatheredQTensor)
        assert model.layers[0].attn.wq.shape[0] == 512 and model.new_state(256).kv[0].k.n_heads == 1
        return [_teacher_forced(model, c, 16)["logits"] for c in cases]

    rank0, rank1 = ThreadGroup(2).run(rank_runs)
    for case, a, b, c in zip(cases, one, rank0, rank1):
        assert torch.equal(b, c), "the ranks' results differ"
        _same_tokens_up_to_a_near_tie(a, b, case["name"])


def test_smollm2_layers_on_two_ranks_give_one_ranks_outputs():
    """The default model (llama), a layer at a time on the same input: its FFN's 48 Q4_1 blocks split, its 9 query
    heads in groups of 3 whole on each rank (2 ranks would cut a group), the vocabulary split. Compared layer by
    layer because over the whole model SmolLM2 is chaotic under rounding, as Gemma 3 is (a float32 ulp on its
    embeddings moves its logits by ~1), so a rounding change may flip a token at a 0.09-nat margin."""
    path = default_model("smollm2")
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0)) * 4

    def layers(model) -> tuple[list[torch.Tensor], torch.Tensor]:
        state = model.new_state(256)
        batch = Batch.of(torch.arange(5), [state])
        with torch.inference_mode():
            outs = [layer(x, batch.rope(model.rope_table), batch) for layer in model.layers[:4]]
            logits = model.logits(model.final_norm(x))
        return outs, logits

    one = layers(load(path))

    def rank_run(rank):
        model = load(path, partition=Partition(rank))
        assert isinstance(model.layers[0].down, ReducedQTensor) and isinstance(model.output, GatheredQTensor)
        assert model.layers[0].down.shape[1] == 768 and model.layers[0].attn.c.n_head == 9
        return layers(model)

    for outs, logits in ThreadGroup(2).run(rank_run):
        for a, b in zip(one[0], outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)
        assert torch.equal(logits, one[1])  # the vocabulary's rows gathered: each logit its own dot product


def test_the_gpu_path_on_two_ranks_gives_one_ranks_greedy_tokens(monkeypatch):
    """The GPU path's code (ops.device; the Triton kernels under the interpreter on a machine without a GPU, the
    quantized matmuls on their PyTorch twins as in tests/models/test_gpu_path.py): fused norms hand quantized rows to
    the ranks' shares, the FFN's residual add leaves the down projection's launch for after the exchange; the static
    step CUDA graphs capture runs too (uncaptured: a rank's exchanges run on the host)."""
    pytest.importorskip("triton", reason="triton is not installed: the GPU path's kernels cannot run")
    from triton.runtime.interpreter import GridExecutor

    from mtpserve.models.graphs import StepGraph
    from mtpserve.ops.device import emulate_gpu

    if not torch.cuda.is_available():  # the interpreter rebinds triton.language globally while a kernel runs:
        launch, lock = GridExecutor.__call__, threading.Lock()  # one rank's kernel at a time

        def one_at_a_time(self, *args, **kwargs):
            with lock:
                return launch(self, *args, **kwargs)

        monkeypatch.setattr(GridExecutor, "__call__", one_at_a_time)

    path, case = tinyqwen_path("Q4_K_M"), _cases("tinyqwen35-mtp-Q4_K_M")[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def greedy(model) -> torch.Tensor:
        """The prompt, 2 decode steps, then 2 through the static step a CUDA graph captures (models.graphs)."""
        state, rows = model.new_state(256), []
        with torch.inference_mode():
            rows.append(model.prefill(case["prompt_token_ids"], state))
            for _ in range(2):
                rows.append(model.decode(int(rows[-1].argmax()), state))
            static = StepGraph(model, state, capture=False)
            for _ in range(2):
                rows.append(static.step([int(rows[-1].argmax())])[1][0])
        return torch.stack(rows).cpu()

    with emulate_gpu(matmul="torch") if device == "cpu" else contextlib.nullcontext():
        one = greedy(load(path, device=device))
        rank0, rank1 = ThreadGroup(2).run(lambda rank: greedy(load(path, device=device, partition=Partition(rank))))
    assert torch.equal(rank0, rank1)
    _same_tokens_up_to_a_near_tie(one, rank0, "GPU path")


def test_uneven_shares_split_by_whole_units_and_give_one_ranks_tokens():
    """-ts 3,1: the FFN's 3 blocks split 2:1, the vocabulary 3072:1024, the DeltaNet's 2 K heads 1:1 (whole heads)."""
    path, case = tinyqwen_path("Q4_K_M"), _cases("tinyqwen35-mtp-Q4_K_M")[1]
    one = _teacher_forced(load(path), case, 12)["logits"]

    def rank_run(rank):
        model = load(path, partition=Partition(rank, (3.0, 1.0)))
        return model.layers[0].ffn.down.shape[1], model.output.shape[0], _teacher_forced(model, case, 12)["logits"]

    (ffn0, vocab0, a), (ffn1, vocab1, b) = ThreadGroup(2).run(rank_run)
    assert (ffn0, ffn1, vocab0, vocab1) == (512, 256, 3072, 1024)
    assert torch.equal(a, b)
    _same_tokens_up_to_a_near_tie(one, a, "-ts 3,1")
