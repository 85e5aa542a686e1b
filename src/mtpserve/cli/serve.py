"""`mtpserve serve`: the OpenAI-compatible HTTP server, started with llama-server's command line.

Every flag of the deployment's llama-server command is accepted with llama-server's meaning. Flags that
place work on GPUs (`--gpu-layers`, `--split-mode`, `--tensor-split`, `--main-gpu`, `--device`,
`--spec-draft-ngl`, `--spec-draft-device`) are noted in one warning line and ignored on a machine without a
CUDA device (`--list-devices` then lists none); flags
that are llama-server defaults here anyway (`--jinja`, `--perf`, `--cont-batching`, `--flash-attn`,
`--no-mmproj`, `--cache-prompt`) are accepted as they are. Features that are not built
(`--context-shift`, `--embeddings`, `--lora`) stop the start with one line saying so, rather than serving
something else than asked.

Start-up runs as llama-server's does: the HTTP listener first (answering 503 `Loading model`), then the
model, then `model loaded` and `server is listening on http://HOST:PORT`. SIGINT/SIGTERM stop accepting
connections, let running requests finish for up to `--shutdown-timeout` seconds, cancel the rest and
free the model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engine import EngineConfig, SamplingParams
from ..engine.config import GrammarLimits
from ..engine.devices import GpuRequest, cuda_devices, list_devices_text
from ..engine.sampler_order import stage_names
from ..engine.sampling import RANDOM_SEED
from ..quant import CACHE_TYPES
from ..server.chat import REASONING_FORMATS, ChatSettings
from ..server.middleware import CorsSettings, resolve_origins
from ..server.state import DEFAULT_MAX_BODY, ServerSettings
from .common import (
    add_checkpoint_arguments,
    add_spec_arguments,
    add_threads_argument,
    apply_threads,
    engine_flags,
    model_path,
    non_negative,
    positive,
    tensor_split,
)

if TYPE_CHECKING:
    from ..cluster.app import ClusterOptions

log = logging.getLogger("mtpserve.server")

GPU_FLAGS = ("gpu_layers", "split_mode", "tensor_split", "main_gpu", "device", "spec_draft_ngl", "spec_draft_device")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI API, llama-server's flags)")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("-hf", "--hf-repo", help="pull REPO[:QUANT] from Hugging Face (cached), then serve it")
    p.add_argument("-hff", "--hf-file", help="with -hf: this file of the repo instead of choosing by QUANT")
    p.add_argument("-hft", "--hf-token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address(es) to listen on, comma-separated, or a path ending in .sock (default 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-a", "--alias", help="model name(s) for the API, comma-separated")
    p.add_argument(
        "--strict-model",
        action="store_true",
        help="answer 404 to a request naming another model (default: any name is served, as llama-server does)",
    )
    p.add_argument("--api-key", help="API key(s), comma-separated")
    p.add_argument("--api-key-file", help="a file with one API key per line")
    p.add_argument("--api-prefix", default="", help="prefix for every path (e.g. /llm)")
    p.add_argument("--tags", default="", help="model tags, comma-separated (informational: listed by /v1/models)")
    p.add_argument(
        "--cors-origins",
        default="auto",
        help="web pages that may call the server: auto (default: * with --api-key, else localhost), *, localhost, "
        "or a comma-separated list; other pages are refused (403)",
    )
    p.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", help="Access-Control-Allow-Methods")
    p.add_argument("--cors-headers", default="*", help="Access-Control-Allow-Headers")
    p.add_argument(
        "--cors-credentials", action=argparse.BooleanOptionalAction, default=True, help="allow credentials (default)"
    )
    # placement (GPU flags: CPU machines note and ignore them)
    p.add_argument(
        "-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", help="layers on the GPU: N, all or auto"
    )
    p.add_argument("-sm", "--split-mode", choices=["none", "layer", "row", "tensor"], help="how to split over GPUs")
    p.add_argument("-ts", "--tensor-split", help="share of each GPU, e.g. 1,1")
    p.add_argument("-mg", "--main-gpu", type=int, help="the GPU for split-mode none")
    p.add_argument("-dev", "--device", help="devices to offload to, comma-separated (CUDA0,CUDA1), or none")
    p.add_argument("--list-devices", action="store_true", help="print the available devices and exit")
    p.add_argument(
        "-ngld",
        "--spec-draft-ngl",
        "--gpu-layers-draft",
        "--n-gpu-layers-draft",
        dest="spec_draft_ngl",
        help="draft-simple: the draft model's layers on the GPU: N, all or auto",
    )
    p.add_argument(
        "-devd",
        "--spec-draft-device",
        "--device-draft",
        dest="spec_draft_device",
        help="draft-simple: devices for the draft model (default: --device)",
    )
    p.add_argument(
        "-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto", help="flash attention (CPU: always tiled)"
    )
    p.add_argument(
        "--no-mmproj", action="store_true", help="do not load a multimodal projector (none is loaded anyway)"
    )
    p.add_argument("--mmproj", help="multimodal projector (not supported)")
    # context and cache
    p.add_argument(
        "-c", "--ctx-size", type=int, default=4096, help="total context over all slots, 0 = the model's (default 4096)"
    )
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests served at once (default 1)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument(
        "-ctkd", "--cache-type-k-draft", default="f16", choices=sorted(CACHE_TYPES), help="(MTP cache: same as -ctk)"
    )
    p.add_argument(
        "-ctvd", "--cache-type-v-draft", default="f16", choices=sorted(CACHE_TYPES), help="(MTP cache: same as -ctv)"
    )
    p.add_argument(
        "-b",
        "--batch-size",
        type=positive,
        default=2048,
        help="logical batch: cuts /infill prompts (prompts go in -ub chunks)",
    )
    p.add_argument("--spm-infill", action="store_true", help="/infill prompts suffix first (Suffix/Prefix/Middle)")
    p.add_argument(
        "-ub",
        "--ubatch-size",
        type=non_negative,
        default=512,
        help="prompt tokens per forward pass (default 512; 0: -b)",
    )
    add_checkpoint_arguments(p)
    p.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.1)
    p.add_argument(
        "-kvu", "--kv-unified", action="store_true", help="one pool of --ctx-size KV cells shared by all slots"
    )
    p.add_argument(
        "--cache-idle-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save an idle slot's state to the prompt cache before --kv-unified takes its cells (needs --cache-ram)",
    )
    p.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cache-reuse", type=int, default=0, help="(KV shifting: not supported, 0)")
    p.add_argument(
        "--cache-ram",
        type=int,
        default=8192,
        help="MiB of prompt states kept in host memory beyond the slots (default 8192; 0: off, -1: no limit)",
    )
    p.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("-cb", "--cont-batching", action="store_true", default=True)
    p.add_argument("-nocb", "--no-cont-batching", dest="cont_batching", action="store_false")
    # speculative decoding
    add_spec_arguments(p)
    # chat
    p.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=True, help="Jinja chat templates (always)")
    p.add_argument("--chat-template", help="template name (chatml), file, or Jinja source")
    p.add_argument("--chat-template-file", help="a file with the chat template")
    p.add_argument("--chat-template-kwargs", default="{}", help="JSON object of template variables")
    p.add_argument("-rea", "--reasoning", choices=["on", "off", "auto"], default="auto")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="deepseek")
    p.add_argument(
        "--reasoning-budget", type=int, default=-1, help="thinking tokens per reply (-1: unlimited, 0: no thinking)"
    )
    p.add_argument(
        "--reasoning-budget-message", default="", help="text forced before </think> when the budget runs out"
    )
    p.add_argument(
        "--prefill-assistant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue a trailing assistant message (default) rather than answer after it",
    )
    p.add_argument(
        "--reasoning-preserve",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep history reasoning in Qwen3.6 templates (preserve_thinking)",
    )
    # constrained decoding: what one grammar (a response format, a tool set, a GBNF grammar) may cost to compile
    limits = GrammarLimits()
    p.add_argument(
        "--grammar-max-size", type=int, default=limits.max_bytes, help="largest schema or grammar, bytes (400 above)"
    )
    p.add_argument(
        "--grammar-timeout", type=float, default=limits.timeout_s, help="seconds a grammar may take to compile"
    )
    p.add_argument(
        "--grammar-max-memory", type=int, default=limits.max_memory >> 20, help="MiB a compile may use (Linux)"
    )
    p.add_argument(
        "--grammar-workers", type=int, default=limits.workers, help="grammar compiler processes (compiles at once)"
    )
    # sampling defaults
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="default generation limit (-1: none)")
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--typical", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("-s", "--seed", type=int, default=RANDOM_SEED, help="default seed of every request (-1: random)")
    p.add_argument("--samplers", help="default sampler stages in order, ';'-separated names (default: llama-server's)")
    p.add_argument("--sampler-seq", "--sampling-seq", help="the same as chars (e.g. 'kpi'; default: llama-server's)")
    p.add_argument(
        "-bs",
        "--backend-sampling",
        action="store_true",
        help="(llama-server's on-device sampling: accepted; the sampler's tokens and probabilities are the same)",
    )
    # server
    p.add_argument("--metrics", action="store_true", help="enable GET /metrics")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True, help="GET /slots")
    p.add_argument("--slot-save-path", metavar="DIR", help="directory of POST /slots/N?action=save|restore files")
    p.add_argument("--props", action="store_true", help="(POST /props: accepted, changes nothing)")
    p.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True, help="the chat page at /")
    p.add_argument("--no-ui", dest="webui", action="store_false")
    p.add_argument("--embeddings", action="store_true", help="(not supported)")
    p.add_argument("--tools", help="(llama-server's experimental built-in agent tools: not built)")
    p.add_argument("--ui-mcp-proxy", action="store_true", help="(llama-server's web-UI MCP proxy: not built)")
    p.add_argument("-to", "--timeout", type=int, default=3600, help="idle connection timeout, seconds")
    p.add_argument("--threads-http", type=int, default=-1, help="(accepted: one event loop serves HTTP)")
    p.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds running requests get to finish on SIGTERM"
    )
    p.add_argument("--max-body-size", type=int, default=DEFAULT_MAX_BODY, help="largest request body, bytes")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 503 (0: no limit)")
    p.add_argument("--max-predict", type=int, default=0, help="most tokens one request may generate (0: the context)")
    p.add_argument("--sse-ping-interval", type=float, default=30.0, help="keep-alive comment while a stream is silent")
    p.add_argument("--perf", action=argparse.BooleanOptionalAction, default=True, help="per-request timing lines")
    p.add_argument("--no-warmup", action="store_true", help="do not read the model file ahead of the first request")
    p.add_argument("--mlock", action="store_true", help="pin the weights in RAM (a model on the CPU)")
    p.add_argument(
        "--no-mmap", action="store_true", help="read the weights into memory rather than mapping the file (CPU)"
    )
    p.add_argument("-fit", "--fit", choices=["on", "off"], default="on")
    add_threads_argument(p)
    p.add_argument("-tb", "--threads-batch", type=int, default=0, help="(the same threads serve prompts)")
    # logging
    p.add_argument(
        "-lv", "--log-verbosity", "--verbosity", dest="verbosity", type=int, default=3, help="1 errors .. 4 debug"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="= -lv 4, and answers carry __verbose (debugging)")
    p.add_argument("--log-file", help="also write the log to this file")
    p.add_argument("--log-disable", action="store_true")
    p.add_argument("--log-prefix", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-timestamps", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    # replicas on Ray Serve (mtpserve[cluster]; docs/cluster.md)
    cluster = p.add_argument_group("replicas on Ray Serve (pip install 'mtpserve[cluster]')")
    cluster.add_argument("--replicas", type=int, default=0, help="engine replicas behind one gateway (0: no cluster)")
    cluster.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs each replica holds (Ray num_gpus)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica holds (Ray num_cpus)")
    cluster.add_argument(
        "--router", default="prefix", choices=["prefix", "pow2", "session"], help="how requests pick a replica"
    )
    cluster.add_argument("--ray-address", help="a running Ray cluster: auto or ADDR (default: start Ray here)")
    p.set_defaults(func=run)


def parsed_serve_args(argv: list[str]) -> argparse.Namespace:
    """`mtpserve serve`'s flags parsed from argv (Ray's app builder: cli.ray_app.build_app)."""
    parser = argparse.ArgumentParser(prog="mtpserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    """--replicas and the flags around it, for mtpserve.cluster."""
    from ..cluster.app import ClusterOptions

    return ClusterOptions(
        replicas=max(1, args.replicas),
        replica_gpus=args.replica_gpus,
        replica_cpus=args.replica_cpus,
        router=args.router,
        threads=args.threads,
        poll=args.poll,
    )


def refuse_unbuilt(args: argparse.Namespace) -> None:
    problems = {
        "--context-shift is not supported (qwen35's cache cannot be shifted either); drop it": args.context_shift,
        "--embeddings is not supported by this server": args.embeddings,
        "--tools (llama-server's built-in agent tools: shell, files) is not built here": args.tools,
        "--ui-mcp-proxy (llama-server's web-UI MCP proxy) is not built here; our page has no MCP client": (
            args.ui_mcp_proxy
        ),
        "--reasoning-budget must be -1 (unlimited) or a number of tokens >= 0": args.reasoning_budget < -1,
        "--mmproj: multimodal models are not supported": args.mmproj,
        "--cache-reuse (KV shifting) is not supported; use 0": args.cache_reuse != 0,
    }
    for message, present in problems.items():
        if present:
            raise ValueError(message)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    refuse_unbuilt(args)
    api_keys = [k for k in (args.api_key or "").split(",") if k]
    if args.api_key_file:
        api_keys += [line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip()]
    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    if args.reasoning_preserve:
        kwargs.setdefault("preserve_reasoning", True)
    template = args.chat_template
    if args.chat_template_file:
        template = args.chat_template_file
    engine = EngineConfig(
        **engine_flags(args),
        n_parallel=args.parallel,
        ubatch=min(args.ubatch_size or args.batch_size, args.batch_size),  # llama.cpp's: at most the logical batch
        n_predict=args.n_predict,
        slot_prompt_similarity=args.slot_prompt_similarity,
        kv_unified=args.kv_unified,
        cache_ram=args.cache_ram,
        cache_idle_slots=args.cache_idle_slots,
        use_mmap=not args.no_mmap,
        use_mlock=args.mlock,
        grammar=GrammarLimits(
            args.grammar_max_size, args.grammar_timeout, args.grammar_max_memory << 20, args.grammar_workers
        ),
    )
    sampling = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical,
        repeat_last_n=args.repeat_last_n,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        samplers=default_samplers(args),
    )
    return ServerSettings(
        model=model_path(args),
        engine=engine,
        aliases=[a for a in (args.alias or "").split(",") if a],
        strict_model=args.strict_model,
        api_keys=api_keys,
        cors=CorsSettings(
            resolve_origins(args.cors_origins, bool(api_keys)),
            args.cors_methods,
            args.cors_headers,
            args.cors_credentials,
        ),
        tags=[t.strip() for t in args.tags.split(",") if t.strip()],
        host=args.host,
        port=args.port,
        api_prefix=args.api_prefix,
        sampling=sampling,
        chat=ChatSettings(
            reasoning=args.reasoning,
            reasoning_format=args.reasoning_format,
            template_kwargs=kwargs,
            reasoning_budget=args.reasoning_budget,
            reasoning_budget_message=args.reasoning_budget_message,
            prefill_assistant=args.prefill_assistant,
        ),
        chat_template=template,
        webui=args.webui,
        metrics=args.metrics,
        slots_endpoint=args.slots,
        slot_save_path=slot_save_path(args.slot_save_path),
        perf=args.perf,
        verbose=args.verbose,
        max_body_bytes=args.max_body_size,
        max_queue=args.max_queue,
        max_predict=args.max_predict,
        batch_size=args.batch_size,
        spm_infill=args.spm_infill,
        sse_ping_interval=args.sse_ping_interval,
        warm_page_cache=not args.no_warmup,
        gpu=gpu_request(args),
        draft_gpu=draft_gpu_request(args),
        tensor_parallel=cpu_ranks(args),
        tensor_split=tensor_split(args) or (),
    )


def default_samplers(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--samplers (names, ';'-separated) or --sampler-seq (chars): every request's stage order unless it names its
    own (engine/sampler_order.py); None: llama-server's default order."""
    value = args.samplers.split(";") if args.samplers is not None else args.sampler_seq
    if value is None:
        return None
    try:
        return stage_names(value)
    except ValueError as e:
        raise ValueError(f"--samplers / --sampler-seq: {e}") from None


def slot_save_path(value: str | None) -> Path | None:
    """--slot-save-path: an existing directory, as llama-server requires ("not a directory")."""
    if value is None:
        return None
    path = Path(value)
    if not path.is_dir():
        raise ValueError(f"--slot-save-path: not a directory: {value}")
    return path


def cpu_ranks(args: argparse.Namespace) -> tuple[str, ...]:
    """`-sm row --device cpu,cpu`: tensor parallelism over ranks on the CPU (engine.tensor_parallel), one a device
    named; () otherwise."""
    names = tuple(n.strip() for n in (args.device or "").split(",") if n.strip())
    if args.split_mode == "row" and len(names) > 1 and all(n.lower() == "cpu" for n in names):
        return names
    return ()


def gpu_request(args: argparse.Namespace, cuda: bool | None = None) -> GpuRequest | None:
    """The layers go on the GPUs when CUDA is available and --gpu-layers asks for any (N > 0, all, auto); without
    --gpu-layers everything stays on the CPU (a decision: llama-server's own default offloads, but the CUDA
    path is new and opt-in until it has been measured on the deployment's GPUs). `--device` narrows the GPUs."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda or args.gpu_layers in (None, "0") or cpu_ranks(args):
        return None
    return GpuRequest(args.gpu_layers, args.split_mode or "layer", tensor_split(args), args.main_gpu or 0, args.device)


def draft_gpu_request(args: argparse.Namespace, cuda: bool | None = None) -> GpuRequest | None:
    """draft-simple's model by --spec-draft-ngl on --spec-draft-device (default --device), with the target's
    split flags, as llama-server does; opt-in like the target's. draft-mtp has no separate model: its MTP block
    is a layer of the target's file and goes where --gpu-layers puts it."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda or args.spec_draft_ngl in (None, "0") or args.spec_type != "draft-simple":
        return None
    split_mode = args.split_mode or "layer"
    if args.spec_draft_device and args.spec_draft_device != "none" and len(args.spec_draft_device.split(",")) == 1:
        split_mode = "layer"  # a draft pinned to one device needs no split (llama.cpp does the same)
    devices = args.spec_draft_device or args.device
    return GpuRequest(args.spec_draft_ngl, split_mode, tensor_split(args), args.main_gpu or 0, devices)


def _n_cuda() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server.app import create_app
    from ..server.logs import setup_logging
    from ..server.state import ServerState

    if args.list_devices:
        print(list_devices_text(cuda_devices(), {f"CUDA{i}": torch.cuda.get_device_name(i) for i in range(_n_cuda())}))
        return 0
    verbosity = 0 if args.log_disable else 4 if args.verbose else args.verbosity
    setup_logging(verbosity, args.log_file, args.log_prefix, args.log_timestamps, args.log_format == "json")
    if args.hf_repo:
        if args.model:
            raise ValueError("give either -m FILE or -hf REPO[:QUANT], not both")
        from .. import hub

        hub.quiet_library_logs()
        log.info("srv  llama_server: pulling '%s' from Hugging Face", args.hf_repo)
        files = [args.hf_file] if args.hf_file else []
        args.model = str(hub.pull(args.hf_repo, files, token=args.hf_token)[0])
    settings = settings_from_args(args)
    if args.replicas:  # a cluster: the replicas set their own threads (cluster.replica)
        if importlib.util.find_spec("ray") is None:
            raise SystemExit("--replicas runs on Ray Serve, which is not installed: pip install 'mtpserve[cluster]'")
        from ..cluster.launch import serve_cluster

        return serve_cluster(settings, cluster_options(args), args.ray_address)
    apply_threads(args)
    log.info("log_info: verbosity = %d (adjust with the `-lv N` CLI arg)", verbosity)
    _log_devices(args)
    log.info("srv  llama_server: initializing ...")
    if settings.api_keys:
        log.info("srv          init: api_keys: %s", ", ".join("****" + k[-4:] for k in settings.api_keys))
    state = ServerState(settings)
    uds = args.host if args.host.endswith(".sock") else None
    hosts = [h.strip() for h in args.host.split(",") if h.strip()] if not uds else []
    app = create_app(state)
    config = uvicorn.Config(
        app,
        host=hosts[0] if hosts else args.host,
        port=args.port,
        uds=uds,
        log_config=None,
        access_log=verbosity >= 4,
        timeout_keep_alive=min(args.timeout, 3600),
        timeout_graceful_shutdown=args.shutdown_timeout,
        server_header=False,
        lifespan="on",
        # the pure-Python loop and HTTP parser whatever else is installed (mtpserve[cluster] brings uvloop and
        # httptools, which uvicorn would otherwise switch to): one server behaviour, the one the tests hold
        loop="asyncio",
        http="h11",
    )
    server = _server_class(state.stop_compiling)(config)  # a compile is not a running request: not waited for
    address = f"unix:{uds}" if uds else ", ".join(f"http://{_bracketed(h)}:{args.port}" for h in hosts)

    def load() -> None:
        state.load()
        if state.load_error is not None:
            log.error("srv    load_model: failed to load model '%s': %s", settings.model, state.load_error)
            server.should_exit = True
            return
        if args.cache_ram:
            limit = "no limit" if args.cache_ram < 0 else f"{args.cache_ram} MiB"
            log.info("srv    load_model: prompt cache is enabled, size limit: %s", limit)
            log.info("srv    load_model: use `--cache-ram 0` to disable the prompt cache")
        else:
            log.info("srv    load_model: prompt cache is disabled - use `--cache-ram N` to enable it")
        if args.cache_idle_slots and not args.kv_unified:  # llama-server's default, refused without unified KV
            log.warning("srv          init: --cache-idle-slots requires --kv-unified, disabling")
        elif args.cache_idle_slots and not args.cache_ram:
            log.warning("srv          init: --cache-idle-slots requires --cache-ram, disabling")
        log.info("srv  llama_server: model loaded")
        log.info("srv  llama_server: server is listening on %s", address)
        log.info("srv  update_slots: all slots are idle")

    def stop() -> None:
        log.info("srv  llama_server: cleaning up before exit...")
        state.close()

    # The lifespan starts loading; uvicorn binds the socket right after, so /health answers 503 meanwhile.
    app.router.lifespan_context = lifespan(
        lambda: threading.Thread(target=load, name="mtpserve-load", daemon=True).start(), stop
    )
    server.run(sockets=listening_sockets(hosts, args.port) if len(hosts) > 1 else None)
    if state.load_error is not None:
        return 1  # the log said why, in one line
    if not server.started:
        raise ValueError(f"could not listen on {address} (is the port in use?)")
    return 0


def listening_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One bound socket per `--host` address (llama-server listens on each of a comma-separated list)."""
    sockets = []
    for host in hosts:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # ::1 and 127.0.0.1 on one port
        try:
            sock.bind(address)
        except OSError as e:
            sock.close()
            raise ValueError(f"could not listen on {host}:{port}: {e.strerror}") from None
        sockets.append(sock)
    return sockets


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _server_class(on_signal: Callable[[], None]) -> type:
    """uvicorn's server, calling `on_signal` at the first SIGINT/SIGTERM."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                log.info(
                    "srv  llama_server: received signal %d: no new connections, running requests get %.0f s",
                    sig,
                    self.config.timeout_graceful_shutdown or 0,
                )
                on_signal()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a graceful stop exits 0 (uvicorn would re-raise the signal)

    return Server


def lifespan(start: Callable[[], None], stop: Callable[[], None]) -> Callable[[Any], Any]:
    @contextlib.asynccontextmanager
    async def context(_: Any) -> AsyncIterator[None]:
        start()
        try:
            yield
        finally:
            stop()

    return context


def _log_devices(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            log.info(
                "device_info: CUDA%d: %s (%d MiB, %d MiB free)",
                i,
                torch.cuda.get_device_name(i),
                total >> 20,
                free >> 20,
            )
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_AVPHYS_PAGES")
    log.info("device_info: CPU: %d threads, %d MiB free", torch.get_num_threads(), page * pages >> 20)
    ranks = ("split_mode", "device", "tensor_split") if cpu_ranks(args) else ()  # they place the CPU ranks
    given = [
        f"--{name.replace('_', '-')}" for name in GPU_FLAGS if getattr(args, name) is not None and name not in ranks
    ]
    if given and not cuda:
        log.warning("main: %s ignored (no CUDA device: everything runs on the CPU)", ", ".join(given))
    draft = [
        f"--{n.replace('_', '-')}" for n in ("spec_draft_ngl", "spec_draft_device") if getattr(args, n) is not None
    ]
    if cuda and draft and args.spec_type != "draft-simple":
        log.warning(
            "main: %s ignored (they place draft-simple's model; %s)",
            ", ".join(draft),
            "draft-mtp's MTP block is a layer of the model: --gpu-layers places it"
            if args.spec_type == "draft-mtp"
            else f"--spec-type is {args.spec_type}",
        )
