"""Request bodies -> the engine's `Request`: llama-server's completion fields (../shared/spec/server-api.md
§5), accepted on every generation endpoint, checked field by field.

Decisions:
* Unknown fields are ignored, as llama-server and vLLM do (clients send vendor extras). Fields we know
  but do not implement (lazy grammars with triggers, mirostat, DRY, XTC, dynamic temperature, custom sampler
  orders, several choices) are refused with a 400 that names them, unless they carry their no-op
  default: a client never gets output that silently ignores what it asked for.
* `max_tokens` / `max_completion_tokens` (OpenAI's names) must be >= 1; llama-server's own `n_predict`
  keeps its meaning (-1 = until the end, 0 = evaluate the prompt only).
* `json_schema` / `grammar` (GBNF) constrain the output (engine.grammar); a schema or grammar that does not
  compile is a 400 naming the problem.
* A number where a number belongs: NaN, infinities, booleans and strings are refused, not coerced.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from ..engine import GrammarSpec, Request, SamplingParams
from ..engine.sampler_order import stage_names
from ..engine.sampling import RANDOM_SEED
from ..tokenizer import Tokenizer
from .errors import invalid, unsupported

MAX_N_PROBS = 100  # top probabilities per token a request may ask for
MAX_STOP_STRINGS = 16


class Body:
    """A JSON object with typed, named reads: every wrong type is a 400 naming the field."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise invalid("the request body must be a JSON object")
        self.data = data

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise invalid(f"Field '{key}': expected a boolean, got {_kind(value)}")
        return value

    def int(self, key: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        value = self.raw(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"Field '{key}': expected an integer, got {_kind(value)}")
        _check_range(key, value, lo, hi)
        return value

    def float(self, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"Field '{key}': expected a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise invalid(f"Field '{key}': expected a finite number, got {value}")
        _check_range(key, value, lo, hi)
        return float(value)

    def str(self, key: str, default: str) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise invalid(f"Field '{key}': expected a string, got {_kind(value)}")
        return value

    def dict(self, key: str) -> dict[str, Any]:
        value = self.raw(key, {})
        if not isinstance(value, dict):
            raise invalid(f"Field '{key}': expected an object, got {_kind(value)}")
        return value


def _kind(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _check_range(key: str, value: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"between {lo} and {hi}"
        raise invalid(f"Field '{key}': must be {bounds}, got {value}")


# Known, not implemented: (field, its no-op default). A request may send the default.
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "mirostat": 0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "dynatemp_range": 0.0,
    "dry_multiplier": 0.0,
    "grammar_lazy": False,
    "best_of": 1,
    "lora": None,
    "n_keep": 0,
    "n_discard": 0,
    "n_cache_reuse": 0,
    "suffix": None,
    "echo": False,
}


def check_unsupported(body: Body) -> None:
    for key, default in UNSUPPORTED_DEFAULTS.items():
        value = body.raw(key)
        if value is None or value == default or (key == "lora" and value == []):
            continue
        if key == "best_of":
            raise unsupported(f"Field '{key}': only one candidate per choice is supported (send {value} requests)")
        raise unsupported(f"Field '{key}' is not supported by this server (remove it or send {default!r})")


def sampling_params(body: Body, tokenizer: Tokenizer, defaults: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=body.float("temperature", defaults.temperature),  # <= 0: greedy, as llama-server
        top_k=body.int("top_k", defaults.top_k),
        top_p=body.float("top_p", defaults.top_p),
        min_p=body.float("min_p", defaults.min_p),
        typical_p=body.float("typical_p", defaults.typical_p),
        repeat_last_n=body.int("repeat_last_n", defaults.repeat_last_n, lo=-1),
        repeat_penalty=body.float("repeat_penalty", defaults.repeat_penalty, lo=0.0),
        presence_penalty=body.float("presence_penalty", defaults.presence_penalty),
        frequency_penalty=body.float("frequency_penalty", defaults.frequency_penalty),
        min_keep=body.int("min_keep", defaults.min_keep, lo=0),
        seed=_seed(body, defaults.seed),
        logit_bias=logit_bias(body.raw("logit_bias"), tokenizer),
        samplers=samplers(body.raw("samplers"), defaults.samplers),
    )


def samplers(value: Any, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """llama-server's `samplers`: the chain's stage order, names or chars (engine/sampler_order.py)."""
    if value is None:
        return default
    if isinstance(value, list) and "adaptive_p" in [v.lower() for v in value if isinstance(v, str)]:
        raise unsupported("Field 'samplers': the adaptive_p sampler is not supported")
    try:
        return stage_names(value)
    except ValueError as e:
        raise invalid(f"Field 'samplers': {e}") from None


def _seed(body: Body, server_seed: int) -> int:
    """The request's seed, else the server's --seed (llama-server's default for every request); -1: random."""
    seed = body.int("seed", server_seed)
    return RANDOM_SEED if seed == -1 else seed & 0xFFFFFFFF


def logit_bias(value: Any, tokenizer: Tokenizer) -> dict[int, float]:
    """OpenAI's `{"token_id": bias}` or llama-server's `[[token|"text", bias|false], ...]`."""
    if value is None:
        return {}
    out: dict[int, float] = {}

    def add(token: Any, bias: Any) -> None:
        if bias is False:
            bias = float("-inf")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
            raise invalid("Field 'logit_bias': a bias must be a number or false")
        if isinstance(token, str) and not token.lstrip("-").isdigit():
            ids = tokenizer.encode(token, add_special=False)
        else:
            try:
                ids = [int(token)]
            except (TypeError, ValueError):
                raise invalid(f"Field 'logit_bias': bad token {token!r}") from None
        for i in ids:
            if not 0 <= i < tokenizer.n_vocab:
                raise invalid(
                    f"Field 'logit_bias': token id {i} is outside the vocabulary (0..{tokenizer.n_vocab - 1})"
                )
            out[i] = float(bias)

    if isinstance(value, dict):
        for token, bias in value.items():
            add(token, bias)
    elif isinstance(value, list):
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise invalid("Field 'logit_bias': expected [[token, bias], ...] or {\"token\": bias}")
            add(*pair)
    else:
        raise invalid("Field 'logit_bias': expected an object or an array")
    return out


def stop_strings(body: Body) -> list[str]:
    stop = body.raw("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("Field 'stop': expected a string or an array of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"Field 'stop': at most {MAX_STOP_STRINGS} stop strings")
    return [s for s in stop if s]


def n_predict(body: Body, server_default: int, cap: int = 0) -> int:
    """llama-server's n_predict (-1 = unlimited), or OpenAI's max_tokens / max_completion_tokens (>= 1);
    at most `cap` when the server sets one (--max-predict: then -1 means the cap)."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.has(key):
            return _capped(key, body.int(key, 0, lo=1), cap)
    return _capped("n_predict", body.int("n_predict", server_default, lo=-1), cap)


def _capped(key: str, value: int, cap: int) -> int:
    if cap and value > cap:
        raise invalid(f"Field '{key}': {value} is over this server's limit of {cap} tokens per request (--max-predict)")
    return cap if cap and value < 0 else value


MAX_PROMPTS = 64  # prompts one /completion request may batch
MAX_CHOICES = 16  # `n` / `n_cmpl`: completions per prompt


def n_choices(body: Body) -> int:
    """OpenAI's `n` (llama-server's `n_cmpl`): completions of each prompt."""
    key = "n_cmpl" if body.has("n_cmpl") else "n"
    return body.int(key, 1, lo=1, hi=MAX_CHOICES)


def choices(job: Completion, n: int) -> list[Completion]:
    """`job` and n - 1 copies, each a request of its own; with a fixed seed, copy i draws with seed + i (as
    llama-server's child tasks), so the choices differ at a temperature and stay reproducible."""
    out = [job]
    for i in range(1, n):
        sampling = job.request.sampling
        seed = sampling.seed if sampling.seed == RANDOM_SEED else (sampling.seed + i) & 0xFFFFFFFF
        request = replace(job.request, sampling=replace(sampling, seed=seed))
        out.append(replace(job, request=request))
    return out


def prompts(value: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """/completion's `prompt`, llama-server's forms: one prompt (a string, token ids, strings and ids mixed, or
    `{"prompt_string": ...}`), or an array of them without bare numbers at its top level: several prompts,
    each answered in its own result."""
    if isinstance(value, list) and value and not any(isinstance(v, int | float) for v in value):
        if len(value) > MAX_PROMPTS:
            raise invalid(f"Field 'prompt': at most {MAX_PROMPTS} prompts in one request")
        return [prompt_tokens(v, tokenizer) for v in value]
    return [prompt_tokens(value, tokenizer)]


def prompt_tokens(value: Any, tokenizer: Tokenizer, field_name: str = "prompt", special: bool = True) -> list[int]:
    """One prompt: a string, token ids, a mix of both, or a JSON prompt `{"prompt_string": ...}` (whose
    `multimodal_data` is refused: no model served here takes images). `special`: BOS added before a leading string
    and special tokens parsed in strings (not in /infill's code: llama-server's tokenize_mixed without them)."""
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise invalid("Multimodal data provided, but model does not support multimodal requests.")
        if not isinstance(value.get("prompt_string"), str):
            raise invalid(f"Field '{field_name}': a JSON prompt needs a string 'prompt_string'")
        value = value["prompt_string"]
    if isinstance(value, str):
        return tokenizer.encode(value, add_special=special, parse_special=special)
    if isinstance(value, list) and value:
        out: list[int] = []
        for i, part in enumerate(value):
            if isinstance(part, bool):
                raise invalid(f"Field '{field_name}': expected token ids or strings")
            if isinstance(part, int):
                if not 0 <= part < tokenizer.n_vocab:
                    raise invalid(
                        f"Prompt contains invalid tokens: id {part} is outside the vocabulary "
                        f"(0..{tokenizer.n_vocab - 1})"
                    )
                out.append(part)
            elif isinstance(part, str):
                out += tokenizer.encode(part, add_special=special and i == 0, parse_special=special)
            else:
                raise invalid(f"Field '{field_name}': expected token ids or strings, got {_kind(part)}")
        return out
    if value is None:
        raise invalid(f"'{field_name}' is required")
    raise invalid(f"Field '{field_name}': expected a string or an array of token ids")


@dataclass
class Completion:
    """A parsed generation request: what the engine runs and how the answer is shaped."""

    request: Request
    stream: bool = False
    include_usage: bool = False
    n_probs: int = 0
    return_tokens: bool = False
    timings_per_token: bool = False  # timings with every streamed chunk, not only the last
    verbose: bool = False  # llama-server's `__verbose`: the native answer (prompt text included) beside the OpenAI one
    response_fields: tuple[str, ...] = ()  # the native answer's fields to keep (editor clients ask for a few)


def grammar_spec(body: Body) -> GrammarSpec | None:
    """llama-server's `json_schema` (an object) or `grammar` (GBNF text) as the request's constraint; both at
    once is refused, as llama-server does."""
    schema, grammar = body.raw("json_schema"), body.raw("grammar")
    if schema is not None and grammar not in (None, ""):
        raise invalid("Either 'json_schema' or 'grammar' can be specified, but not both")
    if schema is not None:
        if not isinstance(schema, dict | bool):
            raise invalid("Field 'json_schema': expected a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(schema))
    if grammar not in (None, ""):
        if not isinstance(grammar, str):
            raise invalid("Field 'grammar': expected a string (GBNF)")
        return GrammarSpec("gbnf", grammar)
    return None


def n_probs(body: Body, key: str = "n_probs") -> int:
    return body.int(key, 0, lo=0, hi=MAX_N_PROBS)


def completion(
    body: Body,
    prompt: list[int],
    tokenizer: Tokenizer,
    defaults: SamplingParams,
    server_n_predict: int,
    n_probs: int,
    max_predict: int = 0,
    verbose: bool = False,
) -> Completion:
    """The completion fields shared by /completion, /v1/completions and /v1/chat/completions; `n_probs`:
    top probabilities to report per token (the endpoints name that field differently); `verbose`: the server's
    default for `__verbose` (on with --verbose, as llama-server's verbosity above 9)."""
    check_unsupported(body)
    request = Request(
        prompt,
        sampling_params(body, tokenizer, defaults),
        n_predict=n_predict(body, server_n_predict, max_predict),
        stop=stop_strings(body),
        n_indent=body.int("n_indent", 0, lo=0),
        t_max_predict_ms=body.int("t_max_predict_ms", 0, lo=-1),
        ignore_eos=body.bool("ignore_eos", False),
        cache_prompt=body.bool("cache_prompt", True),
        n_probs=n_probs,
        id_slot=body.int("id_slot", -1, lo=-1),
        grammar=grammar_spec(body),
        post_sampling_probs=body.bool("post_sampling_probs", False),
        return_progress=body.bool("return_progress", False),
        incremental=body.bool("stream", False),
    )
    stream_options = body.dict("stream_options")
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("Field 'stream_options.include_usage': expected a boolean")
    return Completion(
        request,
        stream=body.bool("stream", False),
        include_usage=include_usage,
        n_probs=n_probs,
        return_tokens=body.bool("return_tokens", False),
        timings_per_token=body.bool("timings_per_token", False),
        verbose=body.bool("verbose", verbose),
        response_fields=response_fields(body),
    )


def response_fields(body: Body) -> tuple[str, ...]:
    """llama-server's `response_fields`: the native answer's fields to return ("a/b" for a nested one)."""
    fields = body.raw("response_fields")
    if fields is None:
        return ()
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise invalid("Field 'response_fields': expected an array of field names (strings)")
    return tuple(fields)
