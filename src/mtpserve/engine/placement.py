"""Which device holds each layer: llama-server's `--gpu-layers`, `--split-mode`, `--tensor-split` and `--main-gpu`,
planned before anything is loaded, for any list of devices (CUDA GPUs, or CPU "devices" in tests).

Layers 0..n-1 are the trunk and MTP blocks, layer n the output layer; the token embedding stays on the host. The
layer rule is llama.cpp's: the last N = --gpu-layers layers are offloaded (from i_gpu_start = max(n + 1 - N, 0),
act = min(N, n + 1)), layer il to the first device d whose cumulative split share s_d exceeds
(il - i_gpu_start) / act. Split modes: `layer` (whole layers), `none` (every offloaded layer on --main-gpu), `row`
(tensor parallelism: each device its share of every offloaded layer's weights, KV heads and recurrent heads, and
a compute reserve with the whole logits; homes on --main-gpu). A device counts weights, KV, recurrent state, the
MTP block, the states a verification keeps and a compute reserve (`DeviceUse`). `auto`: (1) `all` if it leaves a
1 GiB margin;
(2) with `layer` and no --tensor-split, fill the devices back to front; (3) else the largest N that fits.

Details: docs/gpu-placement.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..gguf import GGUFFile
from ..models.config import ModelConfig
from ..models.draft_head import copy_pays, copy_row_bytes
from ..models.memory import CTX_PAD, kv_bytes_per_cell, kv_cells
from ..quant.types import bytes_per_element, parse_cache_type
from .planner import GIB, EngineConfig, InsufficientMemory

FIT_MARGIN_BYTES = 1024**3  # llama.cpp's --fit-target default: memory `auto` leaves free on each device
SPLIT_MODES = ("none", "layer", "row")

LayerKey = int | str  # a trunk block index, "mtp", "output" or "token_embd"
GpuLayers = int | Literal["all", "auto"]


@dataclass(frozen=True)
class Device:
    name: str  # as logged: "CUDA0", "CPU0", ...
    kind: str  # "cpu" | "cuda"
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class DeviceUse:
    """What one device holds under a placement, in bytes."""

    device: Device
    blocks: tuple[int, ...]  # block indices (trunk and MTP) whose home is this device
    output: bool  # the output layer (final norm + LM head)
    token_embd: bool
    weights_bytes: int
    kv_bytes: int  # trunk attention blocks
    recurrent_bytes: int
    mtp_kv_bytes: int
    compute_bytes: int
    checkpoint_bytes: int = 0  # recurrent-state checkpoints (host only)
    rollback_bytes: int = 0  # the per-token recurrent states a speculative verification keeps
    limit_bytes: int | None = None  # free memory checked against; None: not checked
    draft_copy_bytes: int = 0  # of weights_bytes: the MTP drafts' Q4_0 copy of the output layer (models.draft_head)

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.recurrent_bytes
            + self.mtp_kv_bytes
            + self.compute_bytes
            + self.checkpoint_bytes
            + self.rollback_bytes
        )

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.total_bytes <= self.limit_bytes

    def describe(self) -> str:
        parts = [
            f"weights {self.weights_bytes / GIB:.2f} GiB ({_what(self)})",
            f"KV cache {self.kv_bytes / GIB:.2f} GiB",
        ]
        if self.recurrent_bytes:
            parts.append(f"recurrent state {self.recurrent_bytes / GIB:.2f} GiB")
        if self.mtp_kv_bytes:
            parts.append(f"MTP KV {self.mtp_kv_bytes / GIB:.2f} GiB")
        if self.rollback_bytes:
            parts.append(f"verification states {self.rollback_bytes / GIB:.2f} GiB")
        if self.checkpoint_bytes:
            parts.append(f"checkpoints {self.checkpoint_bytes / GIB:.2f} GiB")
        parts.append(f"compute reserve {self.compute_bytes / GIB:.2f} GiB")
        return ", ".join(parts)


@dataclass(frozen=True)
class Placement:
    n_layer_all: int  # trunk + MTP blocks; the output layer is index n_layer_all
    n_gpu_layers: int  # as resolved (`all` -> n_layer_all + 1, `auto` -> what fits), output counted
    i_gpu_start: int
    split_mode: str
    main_gpu: int
    splits: tuple[float, ...]  # cumulative split points s_d of the devices layers were assigned over
    block_device: tuple[str, ...]  # per block index: the home device's name
    output_device: str
    token_embd_device: str
    uses: tuple[DeviceUse, ...]  # the host first, then the devices in the order given
    row_shares: tuple[float, ...] | None = None  # `row`: each device's fraction of the split weights
    notes: tuple[str, ...] = ()

    def use(self, name: str) -> DeviceUse:
        for u in self.uses:
            if u.device.name == name:
                return u
        raise KeyError(name)

    def layer_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Inclusive ranges of layer indices per device (the output layer is index n_layer_all)."""
        ranges: dict[str, list[tuple[int, int]]] = {u.device.name: [] for u in self.uses}
        for il, name in enumerate((*self.block_device, self.output_device)):
            r = ranges[name]
            if r and r[-1][1] == il - 1:
                r[-1] = (r[-1][0], il)
            else:
                r.append((il, il))
        return ranges

    @property
    def fits(self) -> bool:
        return all(u.fits for u in self.uses)

    @property
    def devices_fit(self) -> bool:
        """Every offload device fits (the host aside)."""
        return all(u.fits for u in self.uses[1:])

    def check(self, advice: str = "") -> None:
        """Raise InsufficientMemory naming each device that overflows, what it needs and has, and `advice`
        (what to lower; `place` words it for the flags given)."""
        over = [u for u in self.uses if not u.fits]
        if not over:
            return
        problems = "; ".join(
            f"{u.device.name} ({u.device.kind}) needs {u.total_bytes / GIB:.2f} GiB but has "
            f"{(u.limit_bytes or 0) / GIB:.2f} GiB free: {u.describe()}"
            for u in over
        )
        advice = advice or "Lower --gpu-layers (or use auto), --ctx-size or --parallel, or use a smaller KV cache type."
        raise InsufficientMemory(
            f"the model does not fit (--gpu-layers {self.n_gpu_layers} of {self.n_layer_all + 1}, --split-mode "
            f"{self.split_mode}): {problems}. {advice}"
        )


def _what(u: DeviceUse) -> str:
    items = []
    if u.token_embd:
        items.append("token embedding")
    if u.blocks:
        items.append("layers " + _ranges_text(u.blocks))
    if u.output:
        items.append("output layer" + (" and its Q4_0 copy for drafts" if u.draft_copy_bytes else ""))
    return ", ".join(items) or "nothing"


def _ranges_text(ids: Sequence[int]) -> str:
    out: list[str] = []
    start = prev = ids[0]
    for i in (*ids[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


# --- per-layer bytes --------------------------------------------------------------------------------


def layer_bytes_from_sizes(sizes: Mapping[str, int], config: ModelConfig) -> dict[LayerKey, int]:
    """Group tensor sizes {name: bytes} by layer: trunk block index -> bytes, "mtp" (all MTP blocks),
    "output" (output norm, LM head and any other global tensor) and "token_embd". A file without
    `output.weight` ties the LM head to the embedding, which llama.cpp then duplicates onto the output
    layer's device: its bytes count in both "token_embd" and "output"."""
    mtp = set(config.mtp_layers())
    out: dict[LayerKey, int] = {i: 0 for i in range(config.n_layer)}
    out.update({"mtp": 0, "output": 0, "token_embd": 0})
    for name, n in sizes.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if il in mtp:
                out["mtp"] += n
            elif 0 <= il < config.n_layer:
                out[il] += n
            else:
                raise ValueError(f"tensor '{name}': block {il} is outside the model's {config.n_layer} layers")
        elif name.startswith("token_embd"):
            out["token_embd"] += n
        else:
            out["output"] += n
    if "output.weight" not in sizes:
        out["output"] += sizes.get("token_embd.weight", 0)
    return out


def layer_bytes_from_gguf(gguf: GGUFFile, config: ModelConfig) -> dict[LayerKey, int]:
    """Per-layer weight bytes as stored in the file (see `layer_bytes_from_sizes`)."""
    return layer_bytes_from_sizes({t.name: t.n_bytes for t in gguf.tensors.values()}, config)


# --- the rule -------------------------------------------------------------------------------------


def split_points(weights: Sequence[float]) -> tuple[float, ...]:
    """llama.cpp's cumulative, normalized split points, computed in float32 as it does."""
    f32 = np.float32
    acc, cum = f32(0), []
    for w in weights:
        acc = f32(acc + f32(w))
        cum.append(acc)
    if not acc > 0:
        raise ValueError(f"the split proportions {list(weights)} must have a positive sum")
    return tuple(float(f32(c / acc)) for c in cum)


def assign_layers(n_layer_all: int, n_gpu_layers: int, splits: Sequence[float]) -> list[int | None]:
    """Device index (None: host) of layers 0..n_layer_all, the last being the output layer (module docstring)."""
    i_gpu_start = max(n_layer_all + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer_all + 1) if splits else 0
    out: list[int | None] = []
    for il in range(n_layer_all + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        frac = float(np.float32(il - i_gpu_start) / np.float32(act))
        out.append(min(bisect.bisect_right(splits, frac), len(splits) - 1))
    return out


def _padded_ctx(config: ModelConfig, engine: EngineConfig) -> int:
    return -(-(engine.ctx_size or config.context_length) // CTX_PAD) * CTX_PAD


# A prompt's attention on a GPU reads its layer's K and V of one slot dequantized to a half type
# (ops.attention.prompt_attention_dtype); the CPU path reads them as float32.
PROMPT_KV_BYTES = 2
HOST_PROMPT_KV_BYTES = 4


def compute_reserve_bytes(config: ModelConfig, engine: EngineConfig, output: bool) -> int:
    """Compute buffers a device running part of the graph keeps: f32 activations of one micro-batch
    (FFN gate/up/product and a few hidden-state tensors), plus a micro-batch of logits on the output device."""
    n_ff = getattr(config, "n_ff", 4 * config.n_embd)
    reserve = 4 * engine.ubatch * (3 * n_ff + 4 * config.n_embd)
    return reserve + (4 * config.n_vocab * engine.ubatch if output else 0)


# --- placing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    n_layer_all: int
    weights: tuple[int, ...]  # per block
    kv: tuple[int, ...]
    state: tuple[int, ...]
    mtp_kv: tuple[int, ...]
    rollback: tuple[int, ...]
    prompt_kv: tuple[int, ...]  # elements of one slot's K and V a prompt's attention reads dequantized, per block
    output: int
    draft_copy: int  # the MTP draft head's Q4_0 copy (models.draft_head), next to the output layer
    draft_copy_on_host: bool  # made for a head in host memory too (asked for by name, not `auto`)
    token_embd: int
    checkpoints: int
    reserve: int
    reserve_output: int

    def span(self, layers: Sequence[int]) -> int:
        """Bytes of the given layer indices (the output layer = n_layer_all) with their caches and reserve."""
        if not layers:
            return 0
        n = self.n_layer_all
        total = sum(
            self.weights[i] + self.kv[i] + self.state[i] + self.mtp_kv[i] + self.rollback[i] for i in layers if i < n
        )
        total += PROMPT_KV_BYTES * max((self.prompt_kv[i] for i in layers if i < n), default=0)
        return total + (self.output + self.draft_copy + self.reserve_output if n in layers else self.reserve)


def _costs(config: ModelConfig, layer_bytes: Mapping[LayerKey, int], engine: EngineConfig) -> _Costs:
    mtp_blocks = config.mtp_layers()
    n_all = config.n_layer + len(mtp_blocks)
    missing = [k for k in (*range(config.n_layer), "output", "token_embd") if k not in layer_bytes]
    if missing:
        raise ValueError(f"layer_bytes lacks {missing[:5]}: expected every trunk block, 'output' and 'token_embd'")
    mtp_on = bool(mtp_blocks) and engine.spec.draft_mtp
    weights = [int(layer_bytes[i]) for i in range(config.n_layer)]
    mtp_total = int(layer_bytes.get("mtp", 0)) if mtp_on else 0
    for j in range(len(mtp_blocks)):  # "mtp" holds all MTP blocks: share it evenly (qwen35 has at most one)
        weights.append(mtp_total // len(mtp_blocks) + (mtp_total % len(mtp_blocks) if j == 0 else 0))

    ctx = _padded_ctx(config, engine)
    layout = config.cache_layout()
    kv, state, mtp_kv, rollback, prompt_kv = [0] * n_all, [0] * n_all, [0] * n_all, [0] * n_all, [0] * n_all

    def kv_of(spec) -> int:
        cells = kv_cells(spec, ctx, engine.n_parallel, False, engine.ubatch)
        return round(cells * kv_bytes_per_cell(spec, engine.cache_type_k, engine.cache_type_v))

    def prompt_kv_of(spec) -> int:
        cells = kv_cells(spec, ctx, engine.n_parallel, False, engine.ubatch) // engine.n_parallel
        return cells * spec.n_kv_heads * (spec.k_dim + spec.v_dim)

    for s in layout.attention:
        kv[s.layer] += kv_of(s)
        prompt_kv[s.layer] = prompt_kv_of(s)
    if mtp_on:
        for s in layout.mtp_attention:
            mtp_kv[s.layer] += kv_of(s)
            prompt_kv[s.layer] = prompt_kv_of(s)
    checkpoint = 0
    for r in layout.recurrent:
        one = 4 * (r.conv_state_elements + r.ssm_state_elements)
        state[r.layer] += one * engine.n_parallel
        rollback[r.layer] += one * engine.n_parallel * engine.spec.verified_tokens
        checkpoint += one
    n_checkpoints = engine.ctx_checkpoints if layout.recurrent else 0
    return _Costs(
        n_layer_all=n_all,
        weights=tuple(weights),
        kv=tuple(kv),
        state=tuple(state),
        mtp_kv=tuple(mtp_kv),
        rollback=tuple(rollback),
        prompt_kv=tuple(prompt_kv),
        output=int(layer_bytes["output"]),
        draft_copy=_draft_copy_bytes(config, engine, int(layer_bytes["output"])) if mtp_on else 0,
        draft_copy_on_host=engine.spec.draft_head == "q4_0",
        token_embd=int(layer_bytes["token_embd"]),
        checkpoints=engine.n_parallel * n_checkpoints * checkpoint,
        reserve=compute_reserve_bytes(config, engine, output=False),
        reserve_output=compute_reserve_bytes(config, engine, output=True),
    )


def _draft_copy_bytes(config: ModelConfig, engine: EngineConfig, output_bytes: int) -> int:
    """The Q4_0 copy --spec-draft-head makes of the draft's head rows, where it is made: asked for, or `auto` where
    it reads a quarter fewer bytes than the head (models.draft_head.copy_pays)."""
    row = copy_row_bytes(config.n_embd)
    if row is None or engine.spec.draft_head == "full":
        return 0
    made = engine.spec.draft_head == "q4_0" or copy_pays(output_bytes / config.n_vocab, config.n_embd)
    return min(engine.spec.draft_vocab or config.n_vocab, config.n_vocab) * row if made else 0


@dataclass
class _Tally:
    blocks: list[int] = field(default_factory=list)
    output: bool = False
    runs: bool = False  # runs part of the graph: keeps a compute reserve
    weights: int = 0
    kv: int = 0
    state: int = 0
    mtp_kv: int = 0
    rollback: int = 0
    prompt_kv: int = 0  # the largest of its blocks' (one layer is read at a time)
    draft_copy: int = 0


def _layout(
    c: _Costs,
    devices: Sequence[Device],
    host: Device,
    host_checked: bool,
    n_gpu_layers: int,
    split_mode: str,
    weights_split: Sequence[float] | None,
    main_gpu: int,
    margin: int,
    notes: tuple[str, ...],
) -> Placement:
    n = c.n_layer_all
    if not devices:
        targets: list[Device] = []
        splits: tuple[float, ...] = ()
    elif split_mode in ("none", "row"):  # every offloaded layer's home is the main GPU
        targets, splits = [devices[main_gpu]], (1.0,)
    else:
        targets = list(devices)
        splits = split_points(weights_split or [d.free_bytes for d in devices])
    home = [host if w is None else targets[w] for w in assign_layers(n, n_gpu_layers, splits)]

    row_shares: tuple[float, ...] | None = None
    if split_mode == "row" and devices:
        cum = split_points(weights_split or [d.total_bytes for d in devices])
        row_shares = tuple(b - a for a, b in zip((0.0, *cum[:-1]), cum))

    tally = {d.name: _Tally() for d in (host, *devices)}
    tally[host.name].weights = c.token_embd
    tally[host.name].runs = True  # the input embedding always runs on the host

    def shares_of(dev: Device, nbytes: int) -> list[tuple[_Tally, int]]:
        """Who holds nbytes of a layer at home on `dev`: `dev`, or under `row` (tensor parallelism) every device
        its share (of the weights, the KV heads, the recurrent heads alike)."""
        if row_shares is None or dev is host:
            return [(tally[dev.name], nbytes)]
        out, lo, cum = [], 0, 0.0
        for i, (d, share) in enumerate(zip(devices, row_shares)):
            cum += share
            hi = nbytes if i == len(devices) - 1 else round(nbytes * cum)
            out.append((tally[d.name], hi - lo))
            lo = hi
        return out

    for il in range(n):
        parts = ("weights", "kv", "state", "mtp_kv", "rollback")
        for part, nbytes in zip(parts, (c.weights[il], c.kv[il], c.state[il], c.mtp_kv[il], c.rollback[il])):
            for t, share in shares_of(home[il], nbytes):
                setattr(t, part, getattr(t, part) + share)
        for t, share in shares_of(home[il], c.prompt_kv[il]):  # the devices that run the block (a share of it)
            t.runs, t.prompt_kv = True, max(t.prompt_kv, share)
            t.blocks.append(il)
    out_dev = home[n]
    for t, share in shares_of(out_dev, c.output):
        t.weights += share
        t.output = t.runs = True  # row: every rank gathers the whole logits
    if row_shares is None and (out_dev is not host or c.draft_copy_on_host):
        tally[out_dev.name].weights += c.draft_copy
        tally[out_dev.name].draft_copy = c.draft_copy

    uses = []
    for d in (host, *devices):
        t, is_host = tally[d.name], d is host
        limit = None if is_host and not host_checked else d.free_bytes - (0 if is_host else margin)
        compute = (c.reserve_output if t.output else c.reserve) + t.prompt_kv * (
            HOST_PROMPT_KV_BYTES if is_host else PROMPT_KV_BYTES
        )
        uses.append(
            DeviceUse(
                device=d,
                blocks=tuple(t.blocks),
                output=t.output,
                token_embd=is_host,
                weights_bytes=t.weights,
                kv_bytes=t.kv,
                recurrent_bytes=t.state,
                mtp_kv_bytes=t.mtp_kv,
                compute_bytes=compute if t.runs else 0,
                checkpoint_bytes=c.checkpoints if is_host else 0,
                rollback_bytes=t.rollback,
                limit_bytes=limit,
                draft_copy_bytes=t.draft_copy,
            )
        )
    return Placement(
        n_layer_all=n,
        n_gpu_layers=n_gpu_layers,
        i_gpu_start=max(n + 1 - n_gpu_layers, 0),
        split_mode=split_mode,
        main_gpu=main_gpu,
        splits=splits,
        block_device=tuple(d.name for d in home[:n]),
        output_device=out_dev.name,
        token_embd_device=host.name,
        uses=tuple(uses),
        row_shares=row_shares,
        notes=notes,
    )


def _fill_back_to_front(c: _Costs, devices: Sequence[Device], margin: int) -> list[int]:
    """Layers per device for `auto` without a --tensor-split (module docstring, step 2)."""
    remaining = c.n_layer_all + 1  # layers 0..n_layer_all still unassigned, taken from the back
    counts = [0] * len(devices)
    for d in reversed(range(len(devices))):
        target = devices[d].free_bytes - margin
        k = 0
        while k < remaining and c.span(range(remaining - k - 1, remaining)) <= target:
            k += 1
        counts[d] = k
        remaining -= k
    return counts


def place(
    config: ModelConfig,
    layer_bytes: Mapping[LayerKey, int],
    engine: EngineConfig,
    devices: Sequence[Device],
    gpu_layers: GpuLayers = "all",
    split_mode: str = "layer",
    tensor_split: Sequence[float] | None = None,
    main_gpu: int = 0,
    *,
    host: Device | None = None,
    fit_margin_bytes: int = FIT_MARGIN_BYTES,
) -> Placement:
    """Place every layer of `config` on `devices` (the offload targets; the host keeps the rest) as
    llama-server would for these flags, and raise InsufficientMemory when a device would overflow.

    `layer_bytes`: `layer_bytes_from_gguf(...)`. `gpu_layers`: a count (the last N layers, the output layer
    counted), "all" or "auto". `host`: the CPU with its free memory, checked when given. The rule, the
    split modes and the `auto` search are in the module docstring."""
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"--split-mode '{split_mode}' is not supported (use one of {', '.join(SPLIT_MODES)})")
    host_dev = host or Device("CPU", "cpu", 0, 0)
    names = [host_dev.name] + [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique (the host included), got {names}")
    if devices and split_mode in ("none", "row") and not 0 <= main_gpu < len(devices):
        raise ValueError(f"invalid value for --main-gpu: {main_gpu} (available devices: {len(devices)})")
    c = _costs(config, layer_bytes, engine)
    n = c.n_layer_all
    notes: list[str] = []

    weights_split: list[float] | None = None
    if tensor_split is not None and split_mode != "none":
        if any(w < 0 for w in tensor_split):
            raise ValueError(f"--tensor-split values must be >= 0, got {list(tensor_split)}")
        if len(tensor_split) > len(devices):
            notes.append(
                f"--tensor-split has {len(tensor_split)} entries for {len(devices)} device(s): the extra are ignored"
            )
        padded = [float(w) for w in tensor_split[: len(devices)]] + [0.0] * max(len(devices) - len(tensor_split), 0)
        if any(padded):
            weights_split = padded

    def layout(ngl: int, split: Sequence[float] | None, margin: int, extra: tuple[str, ...] = ()) -> Placement:
        return _layout(
            c, devices, host_dev, host is not None, ngl, split_mode, split, main_gpu, margin, (*notes, *extra)
        )

    if gpu_layers == "all":
        ngl = n + 1
    elif gpu_layers == "auto":
        return _auto(c, devices, layout, split_mode, weights_split, fit_margin_bytes)
    elif isinstance(gpu_layers, int) and not isinstance(gpu_layers, bool) and gpu_layers >= 0:
        ngl = gpu_layers
    else:
        raise ValueError(f"--gpu-layers must be a count >= 0, 'all' or 'auto', got {gpu_layers!r}")
    p = layout(ngl, weights_split, 0)
    if not p.devices_fit:
        best = _largest_fitting(c, layout, weights_split, 0)
        advice = [
            f"Lower --gpu-layers to {best} or less (the most that fit with this split and context; the rest runs on"
            + " the CPU) or use --gpu-layers auto",
            f"lower --ctx-size (now {_padded_ctx(config, engine)}) or --parallel (now {engine.n_parallel})",
        ]
        now = max(bytes_per_element(parse_cache_type(t)) for t in (engine.cache_type_k, engine.cache_type_v))
        smaller = [t for t in ("q8_0", "q4_0") if bytes_per_element(parse_cache_type(t)) < now]
        if smaller:
            advice.append(
                f"use a smaller KV cache type (-ctk/-ctv {' or '.join(smaller)}; now -ctk {engine.cache_type_k} "
                f"-ctv {engine.cache_type_v})"
            )
        if len(devices) > 1 and split_mode == "layer":
            advice.append("shift --tensor-split toward the device with room")
        else:
            advice.append("add a GPU (--split-mode layer spreads the layers)")
        p.check("; ".join(advice) + ".")
    p.check()
    return p


_Layout = Callable[..., Placement]


def _largest_fitting(c: _Costs, layout: _Layout, weights_split: Sequence[float] | None, margin: int) -> int:
    """The largest --gpu-layers whose placement by the rule fits every device less `margin` (a linear scan)."""
    for ngl in range(c.n_layer_all + 1, -1, -1):
        if layout(ngl, weights_split, margin).devices_fit:
            return ngl
    return 0


def _auto(
    c: _Costs,
    devices: Sequence[Device],
    layout: _Layout,
    split_mode: str,
    weights_split: Sequence[float] | None,
    margin: int,
) -> Placement:
    n = c.n_layer_all
    if not devices or layout(n + 1, weights_split, margin).devices_fit:
        p = layout(n + 1, weights_split, 0)
        p.check()
        return p
    if split_mode == "layer" and weights_split is None:
        counts = _fill_back_to_front(c, devices, margin)
        ngl = sum(counts)
        split = [float(k) for k in counts] if ngl else None
    else:
        ngl, split = _largest_fitting(c, layout, weights_split, margin), weights_split
    note = f"--gpu-layers auto: {ngl} of {n + 1} layers fit (leaving {margin / GIB:.2f} GiB free per device)" + (
        f", --tensor-split {','.join(str(int(k)) for k in split)}" if split and len(split) > 1 else ""
    )
    p = layout(ngl, split, 0, (note,))
    p.check()  # the host, when given, may still overflow
    return p
