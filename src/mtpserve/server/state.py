"""What the HTTP layer serves from: the settings, and the model once it is loaded.

The listener starts before the model loads (as llama-server's): until `load()` finishes every endpoint but
the web page answers 503 `Loading model`. Loading runs on its own thread; the engine then does all model
work on the engine thread.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .. import __version__
from ..chat import ChatTemplate
from ..engine import Engine, EngineClient, EngineConfig, SamplingParams
from ..engine.devices import GpuRequest
from ..engine.planner import plan_for_file
from ..engine.startup import keeps_resident
from ..engine.tensor_parallel import start_tensor_parallel
from ..tokenizer import Tokenizer
from .chat import ChatSettings, keep_special_ids
from .errors import LOADING
from .metrics import ServerMetrics
from .middleware import CorsSettings

log = logging.getLogger("mtpserve.server")

DEFAULT_MAX_BODY = 8 << 20  # bytes: a full 262144-token prompt as JSON token ids (~2 MB) fits several times


@dataclass
class ServerSettings:
    """llama-server's flags as the HTTP layer and the engine need them."""

    model: Path
    engine: EngineConfig = field(default_factory=EngineConfig)
    aliases: list[str] = field(default_factory=list)
    strict_model: bool = False  # --strict-model: a request naming another model gets 404
    api_keys: list[str] = field(default_factory=list)
    cors: CorsSettings = field(default_factory=CorsSettings)
    tags: list[str] = field(default_factory=list)  # --tags: informational, listed by /v1/models
    host: str = "127.0.0.1"
    port: int = 8080
    api_prefix: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: ChatSettings = field(default_factory=ChatSettings)
    chat_template: str | None = None
    webui: bool = True
    metrics: bool = False
    slots_endpoint: bool = True
    slot_save_path: Path | None = None  # --slot-save-path: the directory of slot files (None: actions refused)
    perf: bool = True
    verbose: bool = False  # --verbose: answers carry `__verbose` (the native result, prompt text included)
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 256  # requests waiting for a slot before new ones get 503 (0: no limit)
    max_predict: int = 0  # tokens one request may ask for (0: no limit but the context)
    batch_size: int = 2048  # -b: the logical batch, which cuts an /infill prompt's prefix and suffix (infill.py)
    spm_infill: bool = False  # --spm-infill: /infill prompts suffix first
    sse_ping_interval: float = 30.0
    warm_page_cache: bool = True
    gpu: GpuRequest | None = None  # GPU flags given on a machine with CUDA: the layers go on the GPUs
    draft_gpu: GpuRequest | None = None  # the same for draft-simple's model (--spec-draft-ngl, --spec-draft-device)
    tensor_parallel: tuple[str, ...] = ()  # -sm row --device cpu,cpu: a rank on each (engine.tensor_parallel)
    tensor_split: tuple[float, ...] = ()  # --tensor-split: the ranks' shares

    @property
    def reads_ahead(self) -> bool:
        """Whether the file is read into the page cache in the background while the server starts: not when
        --no-mmap or --mlock read it whole while loading."""
        return self.warm_page_cache and not keeps_resident(self.engine, self.gpu, bool(self.tensor_parallel))

    @property
    def model_name(self) -> str:
        """What responses and /v1/models call the model: the first alias, else the file name."""
        return min(self.aliases) if self.aliases else self.model.name

    def accepts_model(self, name: str) -> bool:
        """A request's `model`: any name (llama-server serving one model ignores it; agents send their own, e.g.
        `claude-*`), or with --strict-model only an alias, the file (with or without .gguf) or its path."""
        if not self.strict_model:
            return True
        return name in {*self.aliases, self.model.name, self.model.stem, str(self.model), self.model_name}


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: EngineClient | None = None
        self.tokenizer: Tokenizer | None = None
        self.template: ChatTemplate | None = None
        self.keep_special: frozenset[int] = frozenset()
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.metrics = ServerMetrics(lambda: self.engine)
        self.fingerprint = f"b{__version__}-mtpserve"

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def loaded_engine(self) -> EngineClient:
        """The engine; 503 `Loading model` until it is loaded."""
        if self.engine is None:
            raise LOADING
        return self.engine

    def loaded_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise LOADING
        return self.tokenizer

    def loaded_template(self) -> ChatTemplate:
        if self.template is None:
            raise LOADING
        return self.template

    def load(self) -> None:
        """Load the model and start the engine; on failure remember why (the server then exits)."""
        s = self.settings
        try:
            log.info("srv    load_model: loading model '%s'", s.model)
            tokenizer = Tokenizer.from_gguf(s.model)
            template = ChatTemplate.for_tokenizer(tokenizer, s.chat_template)
            engine = self.start_engine(tokenizer)
            self.tokenizer, self.template = tokenizer, template
            self.keep_special = keep_special_ids(tokenizer)
            example = template.apply([{"role": "user", "content": "Hello"}], add_generation_prompt=True).prompt
            log.info("srv          init: chat template, example_format: %r", example)
            log.info(
                "srv          init: chat template, thinking = %d",
                int(template.supports_thinking and s.chat.reasoning != "off"),
            )
            self.engine = engine
            # The model's objects live as long as the process: out of the collector's sight, its full passes during
            # decode (each step allocates short-lived tensors) no longer walk them all (~7% of a small model's step).
            gc.collect()
            gc.freeze()
        except BaseException as e:  # noqa: BLE001 - reported by the caller, which exits
            self.load_error = e
        finally:
            self.loaded.set()

    def start_engine(self, tokenizer: Tokenizer) -> EngineClient:
        """The engine this server hands requests to: here, one on this machine (a cluster's gateway overrides it)."""
        s = self.settings
        plan = plan_for_file(s.model, s.engine)
        plan.check()  # refuse before reading gigabytes
        if s.reads_ahead:  # in the background: the server answers meanwhile, its first pages read on demand
            threading.Thread(target=warm_page_cache, args=(s.model,), name="warm-page-cache", daemon=True).start()
        if s.tensor_parallel:
            return start_tensor_parallel(s.model, s.engine, s.tensor_parallel, s.tensor_split)
        return Engine.from_file(s.model, s.engine, gpu=s.gpu, draft_gpu=s.draft_gpu)

    def stop_compiling(self) -> None:
        """SIGTERM: requests still compiling their grammar are refused (503) rather than waited for."""
        if self.engine is not None:
            self.engine.stop_compiling()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def warm_page_cache(path: Path, chunk: int = 64 << 20) -> None:
    """Read the file once, showing progress: the weights are memory-mapped, and requests would otherwise wait on
    the disk page by page. A terminal gets a bar; a log gets a line per quarter. Runs beside the loading and
    serving (a 16.8 GB file takes ~40 s here, where /health is ready in ~9 s): llama-server reads the whole file
    before /health answers."""
    size = path.stat().st_size
    tty = os.isatty(2)
    done, quarter = 0, 0
    with (
        open(path, "rb", buffering=0) as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="reading the weights ahead",
            leave=False,
            disable=not tty,
        ) as bar,
    ):
        while data := f.read(chunk):
            bar.update(len(data))
            done += len(data)
            if not tty and size and done * 4 // size > quarter:
                quarter = done * 4 // size
                log.info("srv    load_model: reading the weights ahead: %3d%% of %.1f MiB", 25 * quarter, size / 2**20)
