"""The machine's devices as llama-server names them (`--device`, `--list-devices`), a model's placement flags
(`GpuRequest`, planned by engine.placement right before the model loads), and a placement turned into the torch
devices `models.loader.load` puts tensors on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..gguf import open_gguf
from ..models.registry import config_from_gguf
from .config import EngineConfig
from .placement import Device, GpuLayers, Placement, layer_bytes_from_gguf, place


@dataclass(frozen=True)
class TorchPlacement:
    """Where `models.loader.load` puts things for a placement: `device` holds the output layer (final norm, LM
    head) and every tensor outside the blocks; `layer_devices` each block (trunk and MTP) whose home differs;
    `token_embd_device` the embedding table (llama.cpp keeps it on the host)."""

    device: str
    layer_devices: dict[int, str]
    token_embd_device: str


def torch_device_name(name: str) -> str:
    """A planner device name ("CPU", "CUDA1") as torch's ("cpu", "cuda:1")."""
    if name.upper().startswith("CUDA"):
        return f"cuda:{int(name[4:] or 0)}"
    if name.upper().startswith("CPU"):
        return "cpu"
    raise ValueError(f"no torch device for '{name}'")


def to_torch(placement: Placement) -> TorchPlacement:
    device = torch_device_name(placement.output_device)
    layers = {i: torch_device_name(name) for i, name in enumerate(placement.block_device)}
    return TorchPlacement(
        device, {i: d for i, d in layers.items() if d != device}, torch_device_name(placement.token_embd_device)
    )


def cuda_devices() -> list[Device]:
    """The CUDA GPUs torch sees, with their free memory now, named as llama.cpp logs them."""
    import torch

    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        out.append(Device(f"CUDA{i}", "cuda", total, free))
    return out


def select_devices(spec: str | None, available: Sequence[Device]) -> list[Device]:
    """llama-server's `--device`: None (not given) -> every GPU; "none" -> no offload; else the named devices,
    in the order given (`--main-gpu` and `--tensor-split` then index this list; names keep their numbers, so
    `--device CUDA1` puts the layers on the second GPU)."""
    if spec is None:
        return list(available)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError("--device: no devices specified")
    if names == ["none"]:
        return []
    by_name = {d.name: d for d in available}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        have = ", ".join(by_name) or "none"
        raise ValueError(f"invalid device: {unknown[0]} (available: {have}; see --list-devices)")
    if len(set(names)) != len(names):
        raise ValueError(f"--device names a device twice: {spec}")
    return [by_name[n] for n in names]


def _gpu_layers(value: str) -> GpuLayers:
    if value == "all" or value == "auto":
        return value
    return int(value)


def list_devices_text(available: Sequence[Device], descriptions: Mapping[str, str] | None = None) -> str:
    """`--list-devices`, as llama-server prints it."""
    lines = ["Available devices:"]
    for d in available:
        what = (descriptions or {}).get(d.name, d.kind)
        lines.append(f"  {d.name}: {what} ({d.total_bytes >> 20} MiB, {d.free_bytes >> 20} MiB free)")
    return "\n".join(lines if available else [*lines, "  (none)"])


@dataclass(frozen=True)
class GpuRequest:
    """llama-server's placement flags for one model, planned (`place`) right before that model loads, against
    the free memory then (a draft model is planned after the target has taken its share, as llama.cpp does)."""

    gpu_layers: str = "auto"  # N | all | auto
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] | None = None
    main_gpu: int = 0
    devices: str | None = None  # --device: None (every GPU), "none", or names "CUDA0,CUDA1"

    def plan(self, path: str | Path, engine: EngineConfig, available: Sequence[Device] | None = None) -> Placement:
        """`place` for the GGUF file over `available` (default: the CUDA GPUs torch sees now, with their free
        memory), narrowed by `devices`; raises InsufficientMemory (naming what to lower) when it does not fit."""
        gguf = open_gguf(path)
        config = config_from_gguf(gguf)
        devices = select_devices(self.devices, cuda_devices() if available is None else available)
        ngl = _gpu_layers(self.gpu_layers)
        planned = place(
            config,
            layer_bytes_from_gguf(gguf, config),
            engine,
            devices,
            ngl,
            self.split_mode,
            self.tensor_split,
            self.main_gpu,
        )
        planned.check()
        return planned
