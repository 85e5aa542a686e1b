"""Memory planning before anything is loaded: what a configuration costs (the same arithmetic as
`mtpserve inspect`), whether it fits the device, and what to lower when it does not."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..gguf import open_gguf
from ..kernels.cpu import kept_tiles_limit
from ..models import config_from_gguf, estimate_memory
from ..models.config import AttentionCacheSpec, ModelConfig
from ..models.memory import CTX_PAD, MemoryEstimate, kv_bytes_per_cell, weight_bytes
from .config import EngineConfig
from .errors import InsufficientMemory

GIB = 1024**3
# kept GEMM tiles (--repack) take at most this many times the weights' GGUF bytes: ~1.2-1.3 bytes a weight against
# Q4_K's 0.56 and Q4_0's 0.5625 (Q6_K 1.56x, Q8_0 1.18x)
KEPT_TILES_PER_WEIGHT_BYTE = 2.2
HOST_RESERVE = GIB  # host memory what grows as it is used (checkpoints, the prompt cache) always leaves free


@dataclass(frozen=True)
class MemoryPlan:
    """What a configuration costs on a device, in two parts: what must stay resident (the KV caches, recurrent
    state and its rollback copies, and weights held in anonymous memory), which start-up refuses when it exceeds
    free memory; and what can give way (weights memory-mapped from the file, which the kernel drops and reads
    again, and recurrent-state checkpoints, made as prompts are read), which start-up only warns about."""

    estimate: MemoryEstimate  # weights, KV, recurrent state of all slots
    slot_ctx: int  # cells per slot
    kv_bytes_per_token: float  # one token in every attention layer of one slot
    checkpoint_bytes: int  # one recurrent-state checkpoint of one slot
    max_checkpoints: int  # per slot
    device: str
    available_bytes: int | None  # free memory on the device when planned
    mtp: bool = False  # the MTP block's KV cache is allocated (draft-mtp)
    prompt_cache_bytes: int = 0  # --cache-ram: host memory the prompt cache may fill (-1: no limit); not reserved
    rollback_bytes: int = 0  # speculative verification: the recurrent state after each verified token, all slots
    weights_mapped: bool = False  # the weights are pages of the memory-mapped file (the CPU path)
    kept_tiles_bytes: int = 0  # the CPU kernels' kept GEMM tiles (--repack) at most: made as used, not reserved

    @property
    def checkpoints_bytes_max(self) -> int:
        return self.estimate.parallel * self.max_checkpoints * self.checkpoint_bytes

    @property
    def mtp_kv_bytes(self) -> int:
        return self.estimate.mtp_kv_bytes if self.mtp else 0

    @property
    def prompt_cache_text(self) -> str:
        if self.prompt_cache_bytes == 0:
            return "no prompt cache (--cache-ram 0)"
        if self.prompt_cache_bytes < 0:
            return "a prompt cache without a limit in host memory (--cache-ram -1)"
        return f"a prompt cache of up to {self.prompt_cache_bytes / GIB:.2f} GiB in host memory (--cache-ram)"

    @property
    def required_bytes(self) -> int:
        """What must stay resident: the caches, the recurrent state and its rollback copies, and the weights
        unless they are file-backed pages."""
        e = self.estimate
        weights = 0 if self.weights_mapped else e.weights_bytes
        return weights + e.kv_bytes + self.mtp_kv_bytes + e.recurrent_bytes + self.rollback_bytes

    def parts_text(self) -> str:
        """Every part that was added up, with the flags that size it."""
        e = self.estimate
        weights = "memory-mapped, not counted as resident" if self.weights_mapped else "resident"
        mtp = f", MTP KV cache {self.mtp_kv_bytes / GIB:.2f} GiB" if self.mtp else ""
        rollback = f", rollback states {self.rollback_bytes / GIB:.2f} GiB" if self.rollback_bytes else ""
        tiles = (
            f", kept weight tiles up to {self.kept_tiles_bytes / GIB:.2f} GiB (--repack)"
            if self.kept_tiles_bytes
            else ""
        )
        return (
            f"weights {e.weights_bytes / GIB:.2f} GiB ({weights}), KV cache {e.kv_bytes / GIB:.2f} GiB (-c "
            f"{e.ctx_size} over -np {e.parallel}, -ctk {e.cache_type_k} -ctv {e.cache_type_v}, "
            f"{self.kv_bytes_per_token / 1024:.1f} KiB per token and slot){mtp}, recurrent state "
            f"{e.recurrent_bytes / GIB:.2f} GiB{rollback}; checkpoints up to {self.checkpoints_bytes_max / GIB:.2f} "
            f"GiB{tiles} and {self.prompt_cache_text}, made as used and not reserved"
        )

    def check(self) -> None:
        """Raise InsufficientMemory, listing every part and saying what to lower, when the resident part does not
        fit."""
        if self.available_bytes is None or self.required_bytes <= self.available_bytes:
            return
        e = self.estimate
        changes = []
        if (e.cache_type_k, e.cache_type_v) != ("q8_0", "q8_0") and e.kv_bytes:
            changes.append("-ctk q8_0 -ctv q8_0")
        if e.kv_bytes:
            changes.append("a smaller --ctx-size")
        if e.parallel > 1:
            changes.append("fewer --parallel slots")
        if self.rollback_bytes:
            changes.append("a smaller --spec-draft-n-max")
        advice = f" Use {', '.join(changes)}." if changes else ""
        raise InsufficientMemory(
            f"this configuration needs {self.required_bytes / GIB:.2f} GiB resident on {self.device} but "
            f"{self.available_bytes / GIB:.2f} GiB is free: {self.parts_text()}.{advice}"
        )

    def warnings(self) -> list[str]:
        """What may not fit beside the resident part, with the numbers: it runs, more slowly."""
        if self.available_bytes is None:
            return []
        out = []
        left = self.available_bytes - self.required_bytes  # beside the resident part
        weights = self.estimate.weights_bytes if self.weights_mapped else 0  # resident weights are counted already
        if weights and weights > left:
            out.append(
                f"the weights ({weights / GIB:.2f} GiB, memory-mapped) stay in memory while the context is short "
                "(the caches take memory as positions are written); with every position written, "
                f"{max(left, 0) / GIB:.2f} GiB is left for them, and the kernel reads evicted pages from the file "
                "again: decoding then slows toward the disk's speed"
            )
        left = max(left - weights, 0)
        if self.kept_tiles_bytes > left:
            out.append(
                f"the kernels' kept weight tiles (up to {self.kept_tiles_bytes / GIB:.2f} GiB, --repack) are made as "
                f"batches use them, in the {left / GIB:.2f} GiB left; --no-repack packs them on every call instead"
            )
        left = max(left - self.kept_tiles_bytes, 0)
        if self.checkpoints_bytes_max > left:
            out.append(
                f"recurrent-state checkpoints (up to {self.checkpoints_bytes_max / GIB:.2f} GiB: --ctx-checkpoints "
                f"{self.max_checkpoints} of {self.checkpoint_bytes / 2**20:.0f} MiB per slot) are made as prompts "
                f"are read, in the {left / GIB:.2f} GiB left; each takes memory from the weights' pages"
            )
        return out


def available_memory(device: str) -> int | None:
    """Free bytes on the device (CUDA: the driver's count; CPU: MemAvailable), None if unknown."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def slot_context(config: ModelConfig, engine: EngineConfig) -> int:
    """The context one slot may use: -c split over -np as llama-server splits it (each share padded to 256), or
    with --kv-unified all of it."""
    total = engine.ctx_size or config.context_length
    total = -(-total // CTX_PAD) * CTX_PAD
    if engine.kv_unified:
        return total
    return -(-(total // engine.n_parallel) // CTX_PAD) * CTX_PAD


def _unified_kv_bytes(specs: tuple[AttentionCacheSpec, ...], engine: EngineConfig, ctx: int) -> int:
    """--kv-unified as engine.slots allocates it: one pool of `ctx` cells per full-attention layer, and each slot's
    own sliding-window ring (the size `new_kv_caches` gives it)."""
    total = 0
    for spec in specs:
        cells = ctx
        if spec.sliding_window is not None:
            cells = engine.n_parallel * min(ctx, -(-(spec.sliding_window + engine.ubatch) // CTX_PAD) * CTX_PAD)
        total += round(cells * kv_bytes_per_cell(spec, engine.cache_type_k, engine.cache_type_v))
    return total


def plan(
    config: ModelConfig,
    weights_bytes: int,
    mtp_weights_bytes: int,
    engine: EngineConfig,
    device: str = "cpu",
    available_bytes: int | None = None,
) -> MemoryPlan:
    estimate = estimate_memory(
        config,
        weights_bytes,
        mtp_weights_bytes,
        engine.ctx_size,
        engine.n_parallel,
        engine.cache_type_k,
        engine.cache_type_v,
        ubatch=engine.ubatch,
    )
    layout = config.cache_layout()
    slot_ctx = slot_context(config, engine)
    if engine.kv_unified:
        kv, mtp_kv = (_unified_kv_bytes(specs, engine, slot_ctx) for specs in (layout.attention, layout.mtp_attention))
        estimate = replace(estimate, kv_bytes=kv, mtp_kv_bytes=mtp_kv)
    per_token = sum(kv_bytes_per_cell(s, engine.cache_type_k, engine.cache_type_v) for s in layout.attention)
    checkpoint = sum(4 * (r.conv_state_elements + r.ssm_state_elements) for r in layout.recurrent)
    return MemoryPlan(
        estimate=estimate,
        slot_ctx=slot_ctx,
        kv_bytes_per_token=per_token,
        checkpoint_bytes=checkpoint,
        max_checkpoints=engine.ctx_checkpoints if layout.recurrent else 0,
        device=device,
        available_bytes=available_bytes,
        mtp=engine.spec.draft_mtp,
        prompt_cache_bytes=engine.cache_ram * 1024**2 if engine.cache_ram >= 0 else -1,
        rollback_bytes=estimate.recurrent_bytes * engine.spec.verified_tokens,
        weights_mapped=device == "cpu" and not engine.resident_weights,
        kept_tiles_bytes=min(kept_tiles_limit(), round(KEPT_TILES_PER_WEIGHT_BYTE * weights_bytes))
        if device == "cpu"
        else 0,
    )


def plan_for_file(path: str | Path, engine: EngineConfig, device: str = "cpu") -> MemoryPlan:
    """The plan for a GGUF file, from its metadata alone (no weights read), against free memory now."""
    gguf = open_gguf(path)
    config = config_from_gguf(gguf)
    total, mtp = weight_bytes(gguf, config)
    return plan(config, total, mtp, engine, device, available_memory(device))


@dataclass(frozen=True)
class Recommendation:
    config: EngineConfig
    plan: MemoryPlan
    changes: tuple[str, ...]  # the flags changed from what was asked, as llama-server flags

    @property
    def fits(self) -> bool:
        return self.plan.available_bytes is None or self.plan.required_bytes <= self.plan.available_bytes


def recommend(
    path: str | Path, engine: EngineConfig, device: str = "cpu", available_bytes: int | None = None
) -> Recommendation:
    """The configuration to run `path` with: the one asked for if it fits, else the nearest that does, by
    the server's own planner -- first a q8_0 KV cache, then a halved context down to 4096 tokens per slot.
    `available_bytes` overrides the free memory measured now (for what-ifs)."""
    gguf = open_gguf(path)
    config = config_from_gguf(gguf)
    total, mtp = weight_bytes(gguf, config)
    free = available_memory(device) if available_bytes is None else available_bytes

    def attempt(candidate: EngineConfig) -> MemoryPlan:
        return plan(config, total, mtp, candidate, device, free)

    current, changes = engine, []
    best = attempt(current)
    steps: list[tuple[str, dict]] = []
    if (engine.cache_type_k, engine.cache_type_v) != ("q8_0", "q8_0"):
        steps.append(("-ctk q8_0 -ctv q8_0", {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}))
    ctx = slot_context(config, engine) * engine.n_parallel
    while ctx // 2 >= 4096 * engine.n_parallel:
        ctx //= 2
        steps.append((f"-c {ctx}", {"ctx_size": ctx}))
    for flag, change in steps:
        if best.available_bytes is None or best.required_bytes <= best.available_bytes:
            break
        current = replace(current, **change)
        best = attempt(current)
        changes = [c for c in changes if not (c.startswith("-c ") and flag.startswith("-c "))] + [flag]
    return Recommendation(current, best, tuple(changes))
