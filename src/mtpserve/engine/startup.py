"""What happens before an engine serves: plan, place and load its models, and say so in llama-server's words."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..models.base import CausalLM
from ..models.loader import load
from ..tokenizer import Tokenizer
from .config import EngineConfig
from .devices import GpuRequest, to_torch
from .errors import InvalidRequest
from .planner import MemoryPlan, plan_for_file

log = logging.getLogger("mtpserve.engine")


@dataclass
class Loaded:
    """An engine's parts, loaded: what `Engine(...)` takes."""

    model: CausalLM
    tokenizer: Tokenizer
    plan: MemoryPlan
    draft_model: CausalLM | None = None


def load_for_engine(
    path: str | Path,
    config: EngineConfig,
    device: str = "cpu",
    gpu: GpuRequest | None = None,
    draft_gpu: GpuRequest | None = None,
) -> Loaded:
    """Plan first (from the GGUF's metadata: nothing loaded), refuse what does not fit, then load. With `gpu`
    (llama-server's placement flags) the layers go where engine.placement plans them against the GPUs' free
    memory; the host-memory plan then only sizes the slots. `draft_gpu` places draft-simple's model the same way,
    planned after the target has loaded (else the drafter loads it on the CPU)."""
    plan = plan_for_file(path, config, "cpu" if gpu else device)
    if gpu is None:
        plan.check()
        for warning in plan.warnings():
            log.warning("srv    load_model: %s", warning)
        model = load(path, device=device, use_mmap=config.use_mmap, use_mlock=config.use_mlock)
    else:
        warn_residency(config, "the layers on GPUs are copied from the file's mapping")
        model = _load_placed(path, config, gpu)
    draft_model = None
    if config.spec.type == "draft-simple" and config.spec.draft_model and draft_gpu is not None:
        draft_model = _load_placed(config.spec.draft_model, config, draft_gpu)
    return Loaded(model, Tokenizer.from_gguf(path), plan, draft_model)


def keeps_resident(config: EngineConfig, gpu: GpuRequest | None = None, tensor_parallel: bool = False) -> bool:
    """Whether --no-mmap or --mlock apply: asked for, and the model loads whole in this process on the CPU (it then
    reads the whole file while loading)."""
    return config.resident_weights and gpu is None and not tensor_parallel


def warn_residency(config: EngineConfig, why: str) -> None:
    """--no-mmap and --mlock keep a model on the CPU in RAM; elsewhere they are not applied, and say so."""
    flags = [f for f, on in (("--no-mmap", not config.use_mmap), ("--mlock", config.use_mlock)) if on]
    if flags:
        log.warning("srv    load_model: %s not applied: %s", " and ".join(flags), why)


def _load_placed(path: str | Path, config: EngineConfig, gpu: GpuRequest) -> CausalLM:
    if gpu.split_mode == "row":  # planned as tensor parallelism (engine.placement), which runs on CPU ranks only
        raise InvalidRequest(
            "--split-mode row is tensor parallelism: built on CPU ranks (--device cpu,cpu), not over CUDA GPUs yet; "
            "use --split-mode layer"
        )
    planned = gpu.plan(path, config)
    for use in planned.uses:
        log.info("load_tensors: %s: %s", use.device.name, use.describe())
    placement = to_torch(planned)
    return load(path, placement.device, placement.layer_devices, placement.token_embd_device)


def log_start(config: EngineConfig, plan: MemoryPlan, name: str, n_embd: int) -> None:
    """llama-server's start-up lines."""
    spec = config.spec
    if spec.draft_mtp:
        log.info("common_speculative_init_result: creating MTP draft context against the target model '%s'", name)
    if spec.enabled and spec.type == "draft-simple":
        log.info("srv    load_model: loaded draft model '%s'", spec.draft_model)
    log.info(
        "srv    load_model: initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = '%s'",
        config.n_parallel,
        plan.slot_ctx,
        str(config.kv_unified).lower(),
    )
    if spec.enabled:
        log.info("spec common_specu: adding speculative implementation '%s'", spec.type)
        log.info(
            "spec common_specu: - n_max=%s, n_min=%d, p_min=%.2f, n_embd=%d",
            "auto" if spec.auto else spec.n_max,
            spec.n_min,
            spec.p_min,
            n_embd,
        )
        log.info("srv    load_model: speculative decoding context initialized")
    log.info("srv    load_model: memory: %s", plan.prompt_cache_text)
