"""The device placement planner (engine/placement.py) on fake device lists: llama.cpp's layer rule for
--gpu-layers / --split-mode / --tensor-split, per-device memory, and the refusal when a device overflows.

The model is the real Qwen3.6-27B shape without a file: its config from metadata (test_models_config's
QWEN36_27B) and each tensor's Q4_K_M size from llama-quantize's type rules (quant.mix), which add up to the
16.8 GB of the deployment's file."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from mtpserve.engine import EngineConfig, InsufficientMemory, SpecConfig
from mtpserve.engine.devices import GpuRequest, list_devices_text, select_devices, to_torch, torch_device_name
from mtpserve.engine.placement import (
    Device,
    assign_layers,
    compute_reserve_bytes,
    layer_bytes_from_gguf,
    layer_bytes_from_sizes,
    place,
    split_points,
)
from mtpserve.gguf import open_gguf
from mtpserve.models import config_from_gguf, config_from_metadata, estimate_memory
from mtpserve.models.memory import weight_bytes
from mtpserve.quant.mix import FILE_TYPES, ModelFacts, plan_types
from mtpserve.quant.types import GGMLType, tensor_bytes

from ..conftest import tinyqwen_path
from ..models.test_config import QWEN36_27B

GiB = 1024**3
MiB = 1024**2

CONFIG = config_from_metadata(QWEN36_27B)
_SPECS = [s for s in CONFIG.tensor_specs() if s.required or s.name == "output.weight"]  # as the converter writes
_TYPES = plan_types(
    {s.name: (tuple(reversed(s.shape)), GGMLType.F32) for s in _SPECS},
    FILE_TYPES["Q4_K_M"],
    ModelFacts.from_metadata(QWEN36_27B),
)
SIZES = {s.name: tensor_bytes(_TYPES[s.name], math.prod(s.shape)) for s in _SPECS}
LAYER_BYTES = layer_bytes_from_sizes(SIZES, CONFIG)
FILE_BYTES = sum(SIZES.values())

# The deployment: -c 262144 -np 1 -ctk q8_0 -ctv q8_0 --spec-type draft-mtp --spec-draft-n-max 2.
DEPLOY = EngineConfig(
    n_parallel=1, ctx_size=262144, cache_type_k="q8_0", cache_type_v="q8_0", spec=SpecConfig(type="draft-mtp", n_max=2)
)

# By hand (see test_models_config): one attention layer's q8_0 KV at 262144 cells, one Gated DeltaNet layer's state.
KV_LAYER = 4 * (256 + 256) * 34 // 32 * 262144  # 570,425,344 B
STATE_LAYER = 3 * 10240 * 4 + 48 * 128 * 128 * 4  # 3,268,608 B
ROLLBACK_LAYER = 3 * STATE_LAYER  # verifying 2 drafts runs 3 tokens and keeps the state after each
ACTIVATIONS = 4 * 512 * (3 * 17408 + 4 * 5120)  # compute reserve of any device running blocks: 142 MiB
LOGITS = 4 * 248320 * 512  # plus the logits of one micro-batch on the output device: 485 MiB
PROMPT_KV = 2 * 262144 * 4 * (256 + 256)  # plus one attention layer's K and V read as bf16/f16 by a prompt: 1 GiB
DRAFT_COPY = 248320 * 5120 // 32 * 18  # the MTP draft's Q4_0 copy of the output layer (--spec-draft-head auto)


def fake_devices(n: int, gib: float, kind: str = "cuda", used_mib: int = 300) -> list[Device]:
    """n devices of `gib` GiB with `used_mib` already taken (driver and context on a GPU)."""
    prefix = "CUDA" if kind == "cuda" else "CPU"
    total = int(gib * GiB)
    return [Device(f"{prefix}{i}", kind, total, total - used_mib * MiB) for i in range(n)]


def blocks_bytes(first: int, last: int) -> int:
    """Weights of trunk blocks first..last (inclusive); block 64 is the MTP block."""
    return sum(LAYER_BYTES["mtp"] if i == 64 else LAYER_BYTES[i] for i in range(first, last + 1))


def attention_in(first: int, last: int) -> int:
    return sum(1 for i in range(first, min(last, 63) + 1) if i % 4 == 3)


def test_27b_shape_and_sizes():
    assert CONFIG.n_layer == 64 and CONFIG.mtp_layers() == [64]
    assert round(FILE_BYTES / 1e9, 1) == 16.8  # the deployment's 16.8 GB file
    assert sum(LAYER_BYTES.values()) == FILE_BYTES  # the file has output.weight: nothing counted twice
    assert LAYER_BYTES["token_embd"] == 248320 * 5120 * 144 // 256  # Q4_K
    assert LAYER_BYTES["output"] == 248320 * 5120 * 210 // 256 + 5120 * 4  # Q6_K head + f32 norm


def test_27b_on_two_22gb_gpus_uses_llama_cpps_ranges():
    gpus = fake_devices(2, 22)  # RTX 2080 Ti 22 GB class
    p = place(CONFIG, LAYER_BYTES, DEPLOY, gpus, "all", "layer", [1, 1])
    # llama.cpp's rule by hand: n_layer_all = 64 trunk + 1 MTP = 65, the output layer is index 65, so
    # -ngl all = 66, i_gpu_start = max(65 + 1 - 66, 0) = 0, act = 66. --tensor-split 1,1 gives split points
    # s = (1/2, 2/2) = (0.5, 1.0); layer il goes to the first GPU d with s_d > il / 66:
    #   GPU0 iff il / 66 < 0.5 iff il < 33  ->  blocks 0-32 (33 blocks);
    #   il = 33: 33 / 66 = 0.5 is not < 0.5  ->  GPU1 holds blocks 33-63, the MTP block 64 and the output 65.
    assert (p.i_gpu_start, p.n_gpu_layers, p.splits) == (0, 66, (0.5, 1.0))
    assert p.layer_ranges() == {"CPU": [], "CUDA0": [(0, 32)], "CUDA1": [(33, 65)]}
    assert p.block_device[64] == "CUDA1" and p.output_device == "CUDA1" and p.token_embd_device == "CPU"
    assert assign_layers(65, 66, (0.5, 1.0)) == [0] * 33 + [1] * 33

    g0, g1, host = p.use("CUDA0"), p.use("CUDA1"), p.use("CPU")
    # GPU0: 8 attention blocks (3, 7, ..., 31) and 25 Gated DeltaNet blocks; GPU1: 8 + 23 and the MTP block.
    assert (attention_in(0, 32), attention_in(33, 64)) == (8, 8)
    assert g0.weights_bytes == blocks_bytes(0, 32)
    assert g0.kv_bytes == 8 * KV_LAYER and g0.recurrent_bytes == 25 * STATE_LAYER and g0.mtp_kv_bytes == 0
    assert g0.compute_bytes == ACTIVATIONS + PROMPT_KV and g0.rollback_bytes == 25 * ROLLBACK_LAYER
    assert g1.weights_bytes == blocks_bytes(33, 64) + LAYER_BYTES["output"] + DRAFT_COPY
    assert g1.kv_bytes == 8 * KV_LAYER and g1.recurrent_bytes == 23 * STATE_LAYER and g1.mtp_kv_bytes == KV_LAYER
    assert g1.compute_bytes == ACTIVATIONS + LOGITS + PROMPT_KV and g1.rollback_bytes == 23 * ROLLBACK_LAYER
    assert host.weights_bytes == LAYER_BYTES["token_embd"] and host.kv_bytes == 0 and not host.blocks
    # Nothing lost or counted twice against the whole-model estimate.
    est = estimate_memory(CONFIG, FILE_BYTES, LAYER_BYTES["mtp"], 262144, 1, "q8_0", "q8_0")
    assert sum(u.weights_bytes for u in p.uses) == est.weights_bytes + DRAFT_COPY  # the file's, and the copy
    assert sum(u.kv_bytes for u in p.uses) == est.kv_bytes and g1.mtp_kv_bytes == est.mtp_kv_bytes
    assert sum(u.recurrent_bytes for u in p.uses) == est.recurrent_bytes
    # Both fit: about 12.8 and 15.2 GiB of the 21.7 GiB free on each.
    assert p.fits and g0.total_bytes < g1.total_bytes < gpus[1].free_bytes
    assert (round(g0.total_bytes / GiB, 2), round(g1.total_bytes / GiB, 2)) == (12.78, 15.24)
    # Drafts scored by the whole head (--spec-draft-head full): no copy.
    full = replace(DEPLOY, spec=replace(DEPLOY.spec, draft_head="full"))
    g1_full = place(CONFIG, LAYER_BYTES, full, gpus, "all", "layer", [1, 1]).use("CUDA1")
    assert g1.weights_bytes - g1_full.weights_bytes == g1.draft_copy_bytes == DRAFT_COPY
    assert g1_full.draft_copy_bytes == 0 and "output layer)" in g1_full.describe()


def test_27b_on_one_22gb_gpu_is_refused():
    gpu = fake_devices(1, 22)
    need = (FILE_BYTES - LAYER_BYTES["token_embd"]) + 16 * KV_LAYER + KV_LAYER + 48 * (STATE_LAYER + ROLLBACK_LAYER)
    need += DRAFT_COPY
    need += ACTIVATIONS + LOGITS + PROMPT_KV
    assert need > gpu[0].free_bytes
    with pytest.raises(InsufficientMemory) as e:
        place(CONFIG, LAYER_BYTES, DEPLOY, gpu, "all", "layer", [1, 1])
    msg = str(e.value)
    assert f"CUDA0 (cuda) needs {need / GiB:.2f} GiB but has {gpu[0].free_bytes / GiB:.2f} GiB free" in msg
    assert "needs 26.87 GiB but has 21.71 GiB free" in msg
    # the weights with the draft's Q4_0 copy of the output layer (0.67 GiB)
    assert (
        "weights 15.65 GiB (layers 0-64, output layer and its Q4_0 copy for drafts), KV cache 8.50 GiB" in msg
        and "MTP KV 0.53 GiB" in msg
    )
    # What to lower: the largest --gpu-layers that fits, then context, KV type, devices.
    assert "Lower --gpu-layers to 50 or less" in msg and "--ctx-size (now 262144)" in msg
    assert "-ctk/-ctv q4_0" in msg and "add a GPU" in msg
    place(CONFIG, LAYER_BYTES, DEPLOY, gpu, 50)
    with pytest.raises(InsufficientMemory):
        place(CONFIG, LAYER_BYTES, DEPLOY, gpu, 51)


def test_two_cpu_devices_place_like_two_gpus():
    gpus = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "layer", [1, 1])
    cpus = place(
        CONFIG,
        LAYER_BYTES,
        DEPLOY,
        fake_devices(2, 22, kind="cpu"),
        "all",
        "layer",
        [1, 1],
        host=Device("host", "cpu", 64 * GiB, 60 * GiB),
    )
    assert cpus.layer_ranges() == {"host": [], "CPU0": [(0, 32)], "CPU1": [(33, 65)]}
    assert [u.total_bytes for u in cpus.uses[1:]] == [u.total_bytes for u in gpus.uses[1:]]
    assert cpus.fits and cpus.use("host").limit_bytes == 60 * GiB


def test_partial_offload_keeps_the_first_layers_on_the_cpu():
    p = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), 40, "layer", [1, 1])
    # i_gpu_start = 66 - 40 = 26, act = 40: layer il >= 26 goes to GPU0 iff (il - 26) / 40 < 0.5 iff il < 46.
    assert p.i_gpu_start == 26
    assert p.layer_ranges() == {"CPU": [(0, 25)], "CUDA0": [(26, 45)], "CUDA1": [(46, 65)]}
    host = p.use("CPU")
    assert host.weights_bytes == LAYER_BYTES["token_embd"] + blocks_bytes(0, 25)
    assert host.kv_bytes == attention_in(0, 25) * KV_LAYER == 6 * KV_LAYER  # KV stays with its layer
    assert host.recurrent_bytes == 20 * STATE_LAYER
    # -ngl 1 offloads only the output layer (position 0 of 1: GPU0); -ngl 0 keeps everything on the CPU.
    assert place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), 1, "layer", [1, 1]).layer_ranges() == {
        "CPU": [(0, 64)],
        "CUDA0": [(65, 65)],
        "CUDA1": [],
    }
    p0 = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), 0)
    assert p0.layer_ranges()["CPU"] == [(0, 65)] and p0.use("CUDA0").total_bytes == 0


def test_auto_picks_the_most_layers_that_fit():
    gpu = fake_devices(1, 16)
    p = place(CONFIG, LAYER_BYTES, DEPLOY, gpu, "auto")
    n = p.n_gpu_layers
    assert 0 < n < 66 and p.layer_ranges() == {"CPU": [(0, 65 - n)], "CUDA0": [(66 - n, 65)]}
    target = gpu[0].free_bytes - 1 * GiB  # auto leaves llama.cpp's --fit-target of 1 GiB free
    assert p.use("CUDA0").total_bytes <= target
    assert place(CONFIG, LAYER_BYTES, DEPLOY, gpu, n + 1).use("CUDA0").total_bytes > target
    assert p.notes == (f"--gpu-layers auto: {n} of 66 layers fit (leaving 1.00 GiB free per device)",)

    # Everything fits: auto is -ngl all with the split by free memory (equal GPUs: 1,1).
    assert place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "auto").layer_ranges()["CUDA0"] == [(0, 32)]

    # Two small GPUs: filled back to front, the last GPU first, as llama.cpp's --fit.
    small = fake_devices(2, 10)
    p2 = place(CONFIG, LAYER_BYTES, DEPLOY, small, "auto")
    r = p2.layer_ranges()
    (a0, b0), (a1, b1) = r["CUDA0"][0], r["CUDA1"][0]
    assert b1 == 65 and a1 == b0 + 1 and r["CPU"] == [(0, a0 - 1)] and p2.n_gpu_layers == 66 - a0
    k0, k1 = b0 - a0 + 1, b1 - a1 + 1
    target = small[0].free_bytes - GiB
    assert p2.use("CUDA0").total_bytes <= target and p2.use("CUDA1").total_bytes <= target
    # The last GPU took as many of the last layers as fit: one more would not (all on CUDA1 via -ts 0,1) ...
    assert place(CONFIG, LAYER_BYTES, DEPLOY, small, k1 + 1, "layer", [0, 1]).use("CUDA1").total_bytes > target
    # ... then GPU0 as many of the layers before those as fit.
    assert (
        place(CONFIG, LAYER_BYTES, DEPLOY, small, k0 + k1 + 1, "layer", [k0 + 1, k1]).use("CUDA0").total_bytes > target
    )
    assert p2.notes[0].endswith(f"--tensor-split {k0},{k1}")


def test_tensor_split_shifts_layers():
    p = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "layer", [3, 1])
    # s = (0.75, 1.0): GPU0 iff il / 66 < 0.75 iff il < 49.5.
    assert p.layer_ranges() == {"CPU": [], "CUDA0": [(0, 49)], "CUDA1": [(50, 65)]}
    # 2,1: s_0 = float32(2/3); il = 44 gives 44/66 = 2/3 exactly, not below s_0, so it goes to GPU1.
    assert split_points([2, 1])[0] == float(np.float32(2 / 3))
    p21 = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "layer", [2, 1])
    assert p21.layer_ranges()["CUDA0"] == [(0, 43)]
    # No --tensor-split: proportional to free memory (24 vs 12 GiB free: s_0 = 2/3 as above).
    uneven = [Device("CUDA0", "cuda", 24 * GiB, 24 * GiB), Device("CUDA1", "cuda", 12 * GiB, 12 * GiB)]
    assert place(CONFIG, LAYER_BYTES, EngineConfig(ctx_size=4096), uneven).layer_ranges()["CUDA0"] == [(0, 43)]


def test_split_mode_none_puts_everything_on_main_gpu():
    engine = EngineConfig(ctx_size=65536, cache_type_k="q8_0", cache_type_v="q8_0")
    p = place(CONFIG, LAYER_BYTES, engine, fake_devices(2, 22), "all", "none", [1, 1], main_gpu=1)
    assert p.layer_ranges() == {"CPU": [], "CUDA0": [], "CUDA1": [(0, 65)]}
    assert p.use("CUDA0").total_bytes == 0
    # Without draft-mtp the MTP block's tensors and KV are not loaded (llama.cpp's load_mtp).
    g1 = p.use("CUDA1")
    assert g1.weights_bytes == FILE_BYTES - LAYER_BYTES["token_embd"] - LAYER_BYTES["mtp"] and g1.mtp_kv_bytes == 0
    with pytest.raises(ValueError, match="invalid value for --main-gpu: 2"):
        place(CONFIG, LAYER_BYTES, engine, fake_devices(2, 22), "all", "none", main_gpu=2)


def test_split_mode_row_splits_every_layer_by_ratio():
    """Tensor parallelism (issue 40): each GPU holds its share of every layer's weights, KV heads and recurrent
    heads, and runs every layer (a compute reserve on each, with the whole logits); homes stay on the main GPU."""
    gpus = fake_devices(2, 22)
    p = place(CONFIG, LAYER_BYTES, DEPLOY, gpus, "all", "row", [3, 1], main_gpu=1)
    assert p.row_shares == (0.75, 0.25)
    assert p.layer_ranges() == {"CPU": [], "CUDA0": [], "CUDA1": [(0, 65)]}
    g0, g1 = p.use("CUDA0"), p.use("CUDA1")
    offloaded = FILE_BYTES - LAYER_BYTES["token_embd"]
    parts = {
        "weights_bytes": offloaded,
        "kv_bytes": 16 * KV_LAYER,
        "mtp_kv_bytes": KV_LAYER,
        "recurrent_bytes": 48 * STATE_LAYER,
    }
    for part, total in parts.items():
        assert getattr(g0, part) + getattr(g1, part) == total, part
        assert abs(getattr(g0, part) - 0.75 * total) <= 66, part  # one byte of rounding a layer at most
    assert g0.compute_bytes > g1.compute_bytes > 0 and g0.output and g1.output  # 3:1 of a prompt's dequantized KV
    assert p.fits


def test_bad_flags():
    gpus = fake_devices(2, 22)
    with pytest.raises(ValueError, match="--split-mode 'tensor' is not supported"):
        place(CONFIG, LAYER_BYTES, DEPLOY, gpus, "all", "tensor")
    with pytest.raises(ValueError, match="--tensor-split values must be >= 0"):
        place(CONFIG, LAYER_BYTES, DEPLOY, gpus, "all", "layer", [1, -1])
    with pytest.raises(ValueError, match="--gpu-layers must be"):
        place(CONFIG, LAYER_BYTES, DEPLOY, gpus, -1)
    # Extra --tensor-split entries are ignored, as llama.cpp copies only one per device.
    p = place(CONFIG, LAYER_BYTES, EngineConfig(ctx_size=4096), gpus[:1], "all", "layer", [1, 1])
    assert p.layer_ranges()["CUDA0"] == [(0, 65)] and "ignored" in p.notes[0]


def test_layer_bytes_from_gguf():
    gguf = open_gguf(tinyqwen_path("Q4_K_M"))
    config = config_from_gguf(gguf)
    lb = layer_bytes_from_gguf(gguf, config)
    total, mtp = weight_bytes(gguf, config)
    assert set(lb) == {*range(config.n_layer), "mtp", "output", "token_embd"} and lb["mtp"] == mtp
    tied = "output.weight" not in gguf.tensors
    assert sum(lb.values()) == total + (lb["token_embd"] if tied else 0)
    assert compute_reserve_bytes(config, EngineConfig(), output=True) > compute_reserve_bytes(
        config, EngineConfig(), output=False
    )


def test_placements_map_to_torch_devices():
    """What the loader is given: the 2 x 22 GB deployment loads blocks 0-32 on cuda:0, the rest with the output
    layer on cuda:1, the embedding table on the host; a partial offload keeps its first blocks on the CPU."""
    split = to_torch(place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "layer", [1, 1]))
    assert split.device == "cuda:1" and split.token_embd_device == "cpu"
    assert split.layer_devices == {i: "cuda:0" for i in range(33)}
    partial = to_torch(place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), 40, "layer", [1, 1]))
    assert partial.device == "cuda:1"
    assert partial.layer_devices == {**{i: "cpu" for i in range(26)}, **{i: "cuda:0" for i in range(26, 46)}}
    assert torch_device_name("CUDA1") == "cuda:1" and torch_device_name("CPU0") == "cpu"


def test_device_selects_and_orders_the_offload_targets():
    """--device: every GPU when absent, none for "none", else the named ones in the order given (their names
    keep their numbers); an unknown or repeated name is a clear error naming what there is."""
    gpus = fake_devices(3, 22)
    assert select_devices(None, gpus) == gpus
    assert select_devices("none", gpus) == []
    assert [d.name for d in select_devices("CUDA2,CUDA0", gpus)] == ["CUDA2", "CUDA0"]
    with pytest.raises(ValueError, match=r"invalid device: CUDA7 \(available: CUDA0, CUDA1, CUDA2"):
        select_devices("CUDA0,CUDA7", gpus)
    with pytest.raises(ValueError, match="twice"):
        select_devices("CUDA1,CUDA1", gpus)
    with pytest.raises(ValueError, match="no devices"):
        select_devices(",", gpus)
    text = list_devices_text(gpus[:1], {"CUDA0": "NVIDIA GeForce RTX 2080 Ti"})
    assert text == "Available devices:\n  CUDA0: NVIDIA GeForce RTX 2080 Ti (22528 MiB, 22228 MiB free)"
    assert list_devices_text([]) == "Available devices:\n  (none)"


def test_a_gpu_request_plans_a_file_on_the_selected_devices():
    """GpuRequest.plan on a real GGUF: `--device CUDA1 -ngl all` puts every block and the output layer on the
    second GPU (the embedding stays on the host); `--device none` offloads nothing; `-mg` indexes the selection."""
    path, engine, gpus = tinyqwen_path("Q4_K_M"), EngineConfig(ctx_size=1024), fake_devices(2, 22)
    one = to_torch(GpuRequest("all", devices="CUDA1").plan(path, engine, gpus))
    assert one.device == "cuda:1" and one.layer_devices == {} and one.token_embd_device == "cpu"
    nothing = GpuRequest("all", devices="none").plan(path, engine, gpus)
    assert set(nothing.block_device) == {"CPU"} and nothing.output_device == "CPU"
    main = GpuRequest("all", split_mode="none", main_gpu=1, devices="CUDA1,CUDA0").plan(path, engine, gpus)
    assert set(main.block_device) == {"CUDA0"}


def test_serve_flags_become_gpu_requests():
    """llama-server's flags as `serve` turns them into requests for the target and draft-simple's model (on a
    CUDA machine; without CUDA, or without -ngl/-ngld, nothing is offloaded). A draft pinned to one device is
    laid out by layers; draft-mtp has no separate draft model, so -ngld makes no request for it."""
    from mtpserve.cli import build_parser
    from mtpserve.cli.serve import draft_gpu_request, gpu_request

    def parse(line: str):
        return build_parser().parse_args(["serve", "-m", "x.gguf", *line.split()])

    args = parse(
        "-ngl all -sm row -ts 3,1 -mg 1 -dev CUDA1,CUDA0 --spec-type draft-simple -md d.gguf -ngld 8 -devd CUDA0"
    )
    assert gpu_request(args, cuda=True) == GpuRequest("all", "row", (3.0, 1.0), 1, "CUDA1,CUDA0")
    assert draft_gpu_request(args, cuda=True) == GpuRequest("8", "layer", (3.0, 1.0), 1, "CUDA0")
    assert gpu_request(args, cuda=False) is None and draft_gpu_request(args, cuda=False) is None
    assert draft_gpu_request(parse("-ngl all -dev CUDA1 --spec-type draft-simple -md d.gguf -ngld all"), cuda=True) == (
        GpuRequest("all", "layer", None, 0, "CUDA1")
    )
    assert draft_gpu_request(parse("-ngl all --spec-type draft-mtp -ngld all"), cuda=True) is None
    assert gpu_request(parse(""), cuda=True) is None


def test_the_engine_plans_each_model_right_before_loading_it(caplog: pytest.LogCaptureFixture):
    """Engine.from_file with requests for the target and draft-simple's model: each is planned (and its plan
    logged) before it loads, the draft after the target. On a machine without GPUs the plans keep everything on
    the host, which is what runs here; the engine then drafts with that model."""
    import logging

    from mtpserve.engine import Engine, Request, SamplingParams
    from mtpserve.engine.drafters import DraftModelDrafter

    spec = SpecConfig("draft-simple", n_max=2, draft_model=str(tinyqwen_path("Q8_0")))
    config = EngineConfig(ctx_size=512, spec=spec)
    request = GpuRequest("all", devices="none")
    with caplog.at_level(logging.INFO, logger="mtpserve.engine"):
        engine = Engine.from_file(tinyqwen_path("Q4_K_M"), config, gpu=request, draft_gpu=request)
    with engine:
        assert isinstance(engine.drafter, DraftModelDrafter) and engine.drafter.model.device.type == "cpu"
        result = engine.submit(Request([1, 2, 3, 4], SamplingParams(temperature=0.0), n_predict=6)).result()
    assert len(result.tokens) == 6 and result.timings.draft_n > 0
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("load_tensors: CPU")]
    assert len(planned) == 2


def test_the_deployment_fits_two_22_gb_cards_tensor_parallel():
    """Issue 40's line: 262144 tokens of q8_0 KV with draft-mtp, -sm row -ts 1,1 on 2 x 22 GB: each card holds half
    of everything a layer has (weights, KV heads, DeltaNet heads, the MTP block's), and both run every layer."""
    p = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "row", [1, 1])
    g0, g1 = p.use("CUDA0"), p.use("CUDA1")
    assert p.fits and p.row_shares == (0.5, 0.5)
    for part, total in {"kv_bytes": 16 * KV_LAYER, "recurrent_bytes": 48 * STATE_LAYER}.items():
        assert getattr(g0, part) == getattr(g1, part) == total // 2, part
    assert abs(g0.weights_bytes - g1.weights_bytes) <= 66
    layer = place(CONFIG, LAYER_BYTES, DEPLOY, fake_devices(2, 22), "all", "layer", [1, 1])
    assert max(g0.total_bytes, g1.total_bytes) < max(u.total_bytes for u in layer.uses[1:])  # evener than layers
