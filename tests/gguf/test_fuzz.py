"""Hostile GGUF files (issue 10): a hypothesis fuzz harness over the GGUF reader and the model loader.

Every case starts from a real, valid file -- three tiny synthetic models written with gguf-py (llama with a
gpt2 vocabulary, gemma3 with a SentencePiece one, qwen35 with an MTP block) and the tinyqwen35 Q4_K_M
fixture of ../shared (skipped when absent) -- and breaks it: random truncations, flipped bits, overwritten
ranges of the header and key/value/tensor-info region, absurd counts, lengths and dimensions (up to 2**64 - 1,
which is also every negative offset), key/values of the wrong type for the keys the loader reads, dropped and
duplicated keys and tensors, tensors that alias or overlap each other, and tensor data past the end of the file.

Each case runs the whole loading path: `open_gguf`, every tensor's `raw()`/`numpy()` view,
`config_from_gguf`, `models.loader.load` and `Tokenizer.from_gguf` (then a short encode/decode). Each stage
must either succeed or end in a *clear* error: a `GGUFError` whose message starts with the file's path (what
the reader, the metadata getters, the configs and the vocabulary raise), or the dequantizer's
`UnsupportedQuantType` (a ValueError naming the tensor and its type). Anything else -- IndexError, KeyError,
struct.error, OverflowError, ZeroDivisionError, MemoryError, RecursionError, a bare ValueError from numpy --
is a bug and fails the test with the input that caused it. A case must also take under
`TIME_BUDGET_S` (a SIGALRM at `HANG_S` turns a hang into a failure) and allocate (tracemalloc peak, which
sees Python and numpy allocations; torch's are not traced, and the loader keeps weights in the memory map)
no more than the file's size plus `MEMORY_SLACK`.

Examples are derandomized (the same cases every run): 800 metadata + 300 tensor-info + 400 byte-level cases
on the synthetic files, 100 on the fixture, plus the regressions below, in about 25 s on a busy 2-core
machine. The number of cases tried per test is written to the terminal at the end ("fuzz: ...").
"""

from __future__ import annotations

import signal
import struct
import time
import tracemalloc
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.constants import GGUFValueType as V
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mtpserve.gguf import GGUFError, open_gguf
from mtpserve.models import config_from_gguf, config_from_metadata
from mtpserve.models.loader import load
from mtpserve.quant.dequant import UnsupportedQuantType
from mtpserve.tokenizer import Tokenizer

from ..conftest import FIXTURES, fuzz_examples
from ..support.ggufgen import tiny_llama_metadata, tiny_model_tensors, write_gguf

TIME_BUDGET_S = 2.0  # per case, the whole loading path
HANG_S = 10.0  # SIGALRM: a case still running after this is a hang
MEMORY_SLACK = 64 * 2**20  # allowed tracemalloc peak beyond the file's own size
CLEAR_ERRORS = (GGUFError, UnsupportedQuantType)
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
STATS: dict[str, Counter] = {}

# --- the valid files every case starts from -------------------------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's 256 byte-level characters: a byte-level BPE vocabulary that can encode any text."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + n) for n, b in enumerate(extra)}
    return [chars[b] for b in range(256)]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _gpt2_vocab(pre: str) -> dict[str, Any]:
    tokens = [*_byte_chars(), "Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [3, 3, 3],
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def _spm_vocab() -> dict[str, Any]:
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁a", "▁t", "he", "▁the", "<start_of_turn>", "<end_of_turn>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(pieces) - 2), 3, 3]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(i) for i in range(len(pieces)))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def _llama_metadata() -> dict[str, Any]:
    return {**tiny_llama_metadata(n_layer=1), "llama.rope.dimension_count": 16, **_gpt2_vocab("llama-bpe")}


def _gemma3_metadata() -> dict[str, Any]:
    return {
        "gemma3.block_count": 2,
        "gemma3.context_length": 256,
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 96,
        "gemma3.attention.head_count": 2,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.value_length": 32,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 16,
        "gemma3.attention.sliding_window_pattern": 2,
        **_spm_vocab(),
    }


def _qwen35_metadata() -> dict[str, Any]:
    return {
        "qwen35.block_count": 3,
        "qwen35.nextn_predict_layers": 1,
        "qwen35.context_length": 256,
        "qwen35.embedding_length": 64,
        "qwen35.feed_forward_length": 96,
        "qwen35.attention.head_count": 4,
        "qwen35.attention.head_count_kv": 2,
        "qwen35.attention.key_length": 16,
        "qwen35.attention.value_length": 16,
        "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen35.rope.dimension_count": 8,
        "qwen35.rope.freq_base": 1e7,
        "qwen35.rope.dimension_sections": [2, 2, 0, 0],
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.state_size": 16,
        "qwen35.ssm.group_count": 2,
        "qwen35.ssm.time_step_rank": 4,
        "qwen35.ssm.inner_size": 64,
        "qwen35.full_attention_interval": 2,  # blocks: recurrent, attention, MTP (the fixture lists them instead)
        **_gpt2_vocab("qwen35"),
    }


SYNTHETIC = {"llama": _llama_metadata, "gemma3": _gemma3_metadata, "qwen35": _qwen35_metadata}


def write_synthetic(path: Path, arch: str) -> None:
    """A tiny valid model of `arch`, every required tensor present (matrices Q8_0, vectors F32)."""
    md = SYNTHETIC[arch]()
    # As the reader returns them: numeric arrays as numpy arrays.
    values = {k: np.array(v) if isinstance(v, list) and not isinstance(v[0], str) else v for k, v in md.items()}
    specs = config_from_metadata({"general.architecture": arch, **values}).tensor_specs()
    write_gguf(path, arch, md, tiny_model_tensors(specs, np.random.default_rng(0)))


# --- the GGUF layout of a valid file, so that any field can be changed ----------------------------------

_SCALAR_FMT = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


class Layout:
    """A valid GGUF taken apart: raw key/value and tensor-info entries, the data, and every numeric field
    of the header (position, struct format, what it is). Not a dataclass: hypothesis would print it whole."""

    def __init__(
        self,
        raw: bytes,
        version: int,
        alignment: int,
        kvs: list[tuple[str, bytes]],  # key, whole raw entry
        infos: list[tuple[str, tuple[int, ...], int, int]],  # name, ne, ggml type id, offset
        header_end: int,  # after the last tensor info
        data: bytes,  # from the aligned data start to the end of the file
        fields: dict[str, list[tuple[int, str]]],  # kind -> [(pos, struct format)]
    ) -> None:
        self.raw, self.version, self.alignment, self.kvs, self.infos = raw, version, alignment, kvs, infos
        self.header_end, self.data, self.fields = header_end, data, fields

    def __repr__(self) -> str:
        return f"Layout({self.arch}, {len(self.raw)} bytes)"

    @property
    def arch(self) -> str:
        return open_bytes_str(dict(self.kvs)["general.architecture"])


def open_bytes_str(entry: bytes) -> str:
    """The string value of a raw key/value entry whose value is a string."""
    (klen,) = struct.unpack_from("<Q", entry, 0)
    (slen,) = struct.unpack_from("<Q", entry, 8 + klen + 4)
    return entry[8 + klen + 12 : 8 + klen + 12 + slen].decode()


class _Walker:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0
        self.fields: dict[str, list[tuple[int, str]]] = {}

    def num(self, fmt: str, kind: str | None) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        if kind:
            self.fields.setdefault(kind, []).append((self.pos, fmt))
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, kind: str) -> bytes:
        n = self.num("<Q", kind)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def value(self, vtype: int) -> None:
        if vtype == V.STRING:
            self.string("string length")
        elif vtype == V.ARRAY:
            etype = self.num("<I", "array element type")
            count = self.num("<Q", "array length")
            if etype in _SCALAR_FMT:
                self.pos += count * struct.calcsize(_SCALAR_FMT[etype])
            else:
                for _ in range(count):
                    self.value(etype)
        else:
            self.num(_SCALAR_FMT[V(vtype)], "scalar value")


def take_apart(raw: bytes) -> Layout:
    w = _Walker(raw)
    w.pos = 4
    version = w.num("<I", "version")
    n_tensors = w.num("<Q", "tensor count")
    n_kv = w.num("<Q", "metadata count")
    kvs = []
    alignment = 32
    for _ in range(n_kv):
        start = w.pos
        key = w.string("key length").decode()
        vtype = w.num("<I", "value type")
        value_pos = w.pos
        w.value(vtype)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", raw, value_pos)
        kvs.append((key, raw[start : w.pos]))
    infos = []
    for _ in range(n_tensors):
        name = w.string("tensor name length").decode()
        n_dims = w.num("<I", "dimension count")
        ne = tuple(w.num("<Q", "dimension") for _ in range(n_dims))
        infos.append((name, ne, w.num("<I", "tensor type"), w.num("<Q", "tensor offset")))
    header_end = w.pos
    data_start = -(-header_end // alignment) * alignment
    return Layout(raw, version, alignment, kvs, infos, header_end, raw[data_start:], w.fields)


def encode_value(vtype: int, value: Any) -> bytes:
    """A GGUF value (its type id, then its bytes); an ARRAY value is (element type, [elements])."""
    out = struct.pack("<I", vtype)
    if vtype == V.STRING:
        raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        return out + struct.pack("<Q", len(raw)) + raw
    if vtype == V.ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        return out + b"".join(encode_value(etype, item)[4:] for item in items)
    return out + struct.pack(_SCALAR_FMT[V(vtype)], value)


def encode_kv(key: str, vtype: int, value: Any) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + encode_value(vtype, value)


def encode_info(name: str | bytes, ne: tuple[int, ...], type_id: int, offset: int) -> bytes:
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogatepass")
    out = struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(ne))
    return out + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", type_id, offset)


def assemble(lay: Layout, kvs: list[bytes], infos: list[bytes], data: bytes) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", lay.version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % lay.alignment) + data


# --- running one case -----------------------------------------------------------------------------------


class Hang(BaseException):
    """Raised by SIGALRM inside a case that ran past HANG_S (a BaseException: no `except Exception` eats it)."""


@contextmanager
def hang_guard(seconds: float):
    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _stage(stats: Counter, name: str, path: Path, fn) -> Any:
    """Run one stage; a clear error is an outcome like success, anything else propagates (a bug)."""
    try:
        result = fn()
    except CLEAR_ERRORS as e:
        message = str(e)
        assert message, f"{type(e).__name__} without a message"
        if isinstance(e, GGUFError):
            assert message.startswith(f"{path}: ") and e.problem, message
        stats[f"{name} error"] += 1
        return None
    stats[f"{name} ok"] += 1
    return result


def _touch_tensors(g) -> None:
    for t in g.tensors.values():
        assert t.raw().nbytes == t.n_bytes
        if t.n_bytes <= 2**20:
            t.numpy()


def _tokenize(g) -> bool:
    tok = Tokenizer.from_gguf(g)
    tok.decode(tok.encode("Hello the world, <|im_end|> 123 ü", parse_special=True))
    return True


def load_everything(path: Path, stats: Counter) -> None:
    g = _stage(stats, "open", path, lambda: open_gguf(path))
    if g is None:
        return
    _touch_tensors(g)
    if _stage(stats, "config", path, lambda: config_from_gguf(g)) is not None:
        _stage(stats, "load", path, lambda: load(path))
    _stage(stats, "tokenizer", path, lambda: _tokenize(g))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory, request):
    """The folder cases are written to; at the end of the module, the counts go to the terminal."""
    yield tmp_path_factory.mktemp("fuzz")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None and STATS:
        with capture.global_and_fixture_disabled() if capture else nullcontext():
            reporter.write_line("")
            for test, counts in STATS.items():
                outcomes = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("cases", "seconds"))
                reporter.write_line(f"fuzz: {test}: {counts['cases']} cases in {counts['seconds']:.1f} s ({outcomes})")


def run_case(directory: Path, content: bytes, test: str) -> None:
    stats = STATS.setdefault(test, Counter())
    path = directory / f"{test}.gguf"
    path.write_bytes(content)
    stats["cases"] += 1
    tracemalloc.start()  # only around the case: tracing hypothesis itself would double the run time
    start = time.perf_counter()
    try:
        with hang_guard(HANG_S):
            load_everything(path, stats)
    finally:
        elapsed = time.perf_counter() - start
        stats["seconds"] += elapsed
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < TIME_BUDGET_S, f"loading took {elapsed:.2f} s"
    assert peak < len(content) + MEMORY_SLACK, f"allocated {peak} bytes for a {len(content)}-byte file"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Layout]:
    directory = tmp_path_factory.mktemp("bases")
    out = {}
    for arch in SYNTHETIC:
        path = directory / f"{arch}.gguf"
        write_synthetic(path, arch)
        out[arch] = take_apart(path.read_bytes())
        # Once untraced: lazy imports and the C kernel library load on first use, not inside a measured case.
        load_everything(path, Counter())
    return out


@pytest.fixture(scope="module")
def tinyqwen() -> Layout:
    path = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"
    if not path.exists():
        pytest.skip(f"{path} is absent: the fixture fuzz needs the shared/ folder next to the repo")
    load_everything(path, Counter())
    return take_apart(path.read_bytes())


def test_bases_load_cleanly(bases, fuzz_dir):
    """The unmutated files go all the way through (so a mutation, not the base, is what fails)."""
    for arch, lay in bases.items():
        stats: Counter = Counter()
        path = fuzz_dir / f"{arch}.gguf"
        path.write_bytes(lay.raw)
        load_everything(path, stats)
        assert stats == Counter({"open ok": 1, "config ok": 1, "load ok": 1, "tokenizer ok": 1}), arch
        assert (
            take_apart(assemble(lay, [kv for _, kv in lay.kvs], [encode_info(*i) for i in lay.infos], lay.data)).raw
            == lay.raw
        )


# --- mutations ------------------------------------------------------------------------------------------

U64 = 2**64
INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    31,
    32,
    33,
    63,
    64,
    255,
    256,
    257,
    512,
    513,
    4096,
    2**15,
    2**16 - 1,
    2**16,
    2**20,
    2**24,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**40,
    2**53,
    2**62,
    2**63 - 1,
    2**63,
    2**63 + 1,
    U64 - 1,
    U64 - 2,
    U64 - 32,
    U64 - 2**31,
]
u64s = st.one_of(st.sampled_from(INTERESTING), st.integers(0, U64 - 1))
index = st.integers(0, 2**16)  # taken modulo the number of things it picks from


def _element(vtype: V) -> st.SearchStrategy:
    fmt = _SCALAR_FMT.get(vtype)
    if vtype == V.STRING:
        return st.one_of(
            st.sampled_from(
                ["", "llama", "gpt2", "qwen35", "gemma3", "qwen2", "qwen3", "linear", "yarn", "<|im_end|>"]
            ),
            st.text(max_size=8),
            st.binary(max_size=6),  # often not UTF-8
        )
    if vtype == V.BOOL:
        return st.booleans()
    if vtype in (V.FLOAT32, V.FLOAT64):
        return st.floats(width=32 if vtype == V.FLOAT32 else 64)
    bits = struct.calcsize(fmt) * 8
    signed = fmt.islower()
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    special = [v for v in (0, 1, 2, 3, 4, 8, 64, 512, 513, -1, lo, hi, 2**31, 2**32 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(special), st.integers(lo, hi))


SCALAR_TYPES = [V(t) for t in _SCALAR_FMT] + [V.STRING]
scalar_values = st.sampled_from(SCALAR_TYPES).flatmap(lambda t: st.tuples(st.just(int(t)), _element(t)))
array_values = st.sampled_from(SCALAR_TYPES).flatmap(
    lambda t: st.tuples(st.just(int(V.ARRAY)), st.tuples(st.just(int(t)), st.lists(_element(t), max_size=10)))
)
nested_values = st.tuples(
    st.just(int(V.ARRAY)),
    st.tuples(st.just(int(V.ARRAY)), st.lists(array_values.map(lambda a: a[1]), max_size=3)),
)
typed_values = st.one_of(scalar_values, array_values, nested_values)

# Keys the config and vocabulary code read ("{a}" is the file's architecture).
KNOWN_KEYS = [
    "general.architecture",
    "general.alignment",
    "{a}.block_count",
    "{a}.context_length",
    "{a}.embedding_length",
    "{a}.feed_forward_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
    "{a}.attention.key_length",
    "{a}.attention.value_length",
    "{a}.attention.layer_norm_rms_epsilon",
    "{a}.rope.freq_base",
    "{a}.rope.freq_base_swa",
    "{a}.rope.dimension_count",
    "{a}.rope.dimension_sections",
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.vocab_size",
    "{a}.expert_count",
    "{a}.nextn_predict_layers",
    "{a}.full_attention_interval",
    "{a}.attention.recurrent_layers",
    "{a}.ssm.conv_kernel",
    "{a}.ssm.state_size",
    "{a}.ssm.group_count",
    "{a}.ssm.time_step_rank",
    "{a}.ssm.inner_size",
    "{a}.attention.sliding_window",
    "{a}.attention.sliding_window_pattern",
    "{a}.final_logit_softcapping",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
    "tokenizer.chat_template.tool_use",
    "split.no",
    "split.count",
]

set_kv = st.tuples(st.just("set kv"), st.sampled_from(KNOWN_KEYS), typed_values)
# Absurd values of the key's own type (what a wrong-type change cannot reach): integers wrapped to the type,
# special floats, other strings, arrays resized or filled with one absurd value.
ABSURD_INTS = [
    0,
    1,
    -1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    63,
    64,
    65,
    511,
    512,
    513,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**63,
    U64 - 1,
]
ABSURD_FLOATS = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 3.4e38]
tweak_kv = st.tuples(
    st.just("tweak kv"),
    st.sampled_from(KNOWN_KEYS),
    st.sampled_from(ABSURD_INTS),
    st.sampled_from(ABSURD_FLOATS),
    st.sampled_from(["same length", "empty", "one more", "one less"]),
)
drop_kv = st.tuples(st.just("drop kv"), st.one_of(index, st.sampled_from(KNOWN_KEYS)))
dup_kv = st.tuples(st.just("duplicate kv"), index)
# Dimensions: 0 and 5 of them are invalid counts, values up to 2**64 - 1; "scale" keeps the rank.
dims = st.one_of(st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64, 96, 256, 2**31, 2**32, 2**63, U64 - 1]), u64s)
tensor_ne = st.tuples(st.just("tensor ne"), index, st.lists(dims, max_size=5))
tensor_scale = st.tuples(st.just("tensor scale"), index, st.integers(0, 3), st.sampled_from([0, 2, 32, 2**32, 2**62]))
TYPE_IDS = [int(t) for t in T] + [4, 5, 31, 36, 99, 2**31, 2**32 - 1]
tensor_type = st.tuples(st.just("tensor type"), index, st.sampled_from(TYPE_IDS))
tensor_offset = st.tuples(
    st.just("tensor offset"),
    index,
    st.one_of(
        st.tuples(st.just("alias"), index),  # the offset of another tensor: aliasing / overlap
        st.tuples(st.just("delta"), st.integers(-(2**20), 2**20).map(lambda d: d - d % 32)),
        st.tuples(st.just("delta"), st.integers(-64, 64)),
        st.tuples(st.just("absolute"), u64s),  # past EOF, negative (two's complement), overflowing
    ),
)
tensor_name = st.tuples(
    st.just("tensor name"),
    index,
    st.one_of(
        st.tuples(st.just("copy"), index),
        st.tuples(st.just("text"), st.text(max_size=12)),
        st.just(("bytes", b"\xff\xfe")),
    ),
)
drop_tensor = st.tuples(st.just("drop tensor"), index)
data_len = st.tuples(st.just("data length"), st.one_of(st.floats(0, 1), st.integers(1, 4096)))
# Changes the reader accepts, so that the config, loader and vocabulary code see them...
metadata_changes = st.one_of(tweak_kv, tweak_kv, tweak_kv, set_kv, set_kv, drop_kv)
# ...and changes that mostly end in the reader.
container_changes = st.one_of(
    dup_kv, tensor_ne, tensor_scale, tensor_type, tensor_offset, tensor_name, drop_tensor, data_len
)
structured = st.one_of(metadata_changes, container_changes)


def decode_value(entry: bytes) -> tuple[int, Any]:
    """(value type, value) of a raw key/value entry; an array is (element type, [elements])."""
    (klen,) = struct.unpack_from("<Q", entry, 0)
    w = _Walker(entry)
    w.pos = 8 + klen

    def read(vtype: int) -> Any:
        if vtype == V.STRING:
            return w.string("")
        if vtype == V.ARRAY:
            etype, count = w.num("<I", None), w.num("<Q", None)
            return (etype, [read(etype) for _ in range(count)])
        return w.num(_SCALAR_FMT[V(vtype)], None)

    vtype = w.num("<I", None)
    return vtype, read(vtype)


def _wrap(vtype: int, value: int) -> tuple[int, Any]:
    """An integer as `vtype` holds it (two's complement wrap-around); floats and bools get a stand-in."""
    fmt = _SCALAR_FMT[V(vtype)]
    if fmt in ("<f", "<d"):
        return vtype, float(value)
    if fmt == "<?":
        return vtype, bool(value)
    bits = 8 * struct.calcsize(fmt)
    value %= 2**bits
    return vtype, value - 2**bits if fmt.islower() and value >= 2 ** (bits - 1) else value


def _absurd_element(etype: int, absurd_int: int, absurd_float: float) -> Any:
    if etype == V.ARRAY:
        return (int(V.UINT8), [])
    if etype == V.STRING:
        return "x"
    return absurd_float if etype in (V.FLOAT32, V.FLOAT64) else _wrap(etype, absurd_int)[1]


def _tweak(typed: tuple[int, Any], absurd_int: int, absurd_float: float, array_mode: str) -> tuple[int, Any]:
    vtype, value = typed
    if vtype == V.STRING:
        return vtype, ["", "qwen35", "gemma3", "llama", "x" * 300][absurd_int % 5]
    if vtype == V.ARRAY:
        etype, items = value
        if array_mode == "empty":
            return vtype, (etype, [])
        if array_mode == "one less":
            return vtype, (etype, items[:-1])
        if array_mode == "one more":
            return vtype, (etype, [*items, items[-1] if items else _absurd_element(etype, absurd_int, absurd_float)])
        if etype in (V.STRING, V.ARRAY):  # same length: a duplicated element
            return vtype, (etype, [*items[1:], items[-1]] if items else [])
        return vtype, (etype, [_tweak((etype, v), absurd_int, absurd_float, "")[1] for v in items])
    if vtype in (V.FLOAT32, V.FLOAT64):
        return vtype, absurd_float
    if vtype == V.BOOL:
        return vtype, not value
    return _wrap(vtype, absurd_int)


def mutate_structure(lay: Layout, mutations: list[tuple]) -> bytes:
    """Apply structured mutations; a key/value or tensor is picked by index (modulo their number) or by name."""
    kvs = [(k, raw) for k, raw in lay.kvs]
    infos = [list(i) for i in lay.infos]
    data = lay.data
    arch = lay.arch
    for m in mutations:
        op = m[0]
        if op == "set kv":
            key = m[1].format(a=arch)
            entry = encode_kv(key, *m[2])
            where = next((i for i, (k, _) in enumerate(kvs) if k == key), None)
            if where is None:
                kvs.append((key, entry))
            else:
                kvs[where] = (key, entry)
        elif op == "tweak kv":
            key = m[1].format(a=arch)
            where = next((i for i, (k, _) in enumerate(kvs) if k == key), None)
            if where is None:  # an absent key gets the absurd integer
                kvs.append((key, encode_kv(key, *_wrap(V.INT64 if m[2] < 0 else V.UINT64, m[2]))))
            else:
                kvs[where] = (key, encode_kv(key, *_tweak(decode_value(kvs[where][1]), *m[2:])))
        elif op in ("drop kv", "duplicate kv") and kvs:
            keys = [k for k, _ in kvs]
            if isinstance(m[1], str) and m[1].format(a=arch) not in keys:
                continue
            i = keys.index(m[1].format(a=arch)) if isinstance(m[1], str) else m[1] % len(kvs)
            if op == "drop kv":
                del kvs[i]
            else:
                kvs.insert(i, kvs[i])
        elif op == "data length":
            n = int(m[1] * len(data)) if isinstance(m[1], float) else len(data) + m[1]
            data = data[:n] if n <= len(data) else data + bytes(n - len(data))
        elif infos:
            t = next(i for i in infos if i[0] == m[1]) if isinstance(m[1], str) else infos[m[1] % len(infos)]
            if op == "tensor ne":
                t[1] = tuple(m[2])
            elif op == "tensor scale" and t[1]:
                ne = list(t[1])
                ne[m[2] % len(ne)] = ne[m[2] % len(ne)] * m[3] % U64
                t[1] = tuple(ne)
            elif op == "tensor type":
                t[2] = m[2]
            elif op == "tensor offset":
                how, value = m[2]
                if how == "alias":
                    t[3] = infos[value % len(infos)][3]
                else:
                    t[3] = (t[3] + value if how == "delta" else value) % U64
            elif op == "tensor name":
                how, value = m[2]
                t[0] = infos[value % len(infos)][0] if how == "copy" else value
            elif op == "drop tensor":
                infos.remove(t)
    return assemble(lay, [raw for _, raw in kvs], [encode_info(*i) for i in infos], data)


truncate = st.tuples(st.just("truncate"), st.floats(0, 1))
flip = st.tuples(st.just("flip"), index, st.integers(0, 7))
overwrite = st.tuples(
    st.just("overwrite"), index, st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from([b"\xff" * 8, bytes(8)]))
)
set_field = st.tuples(st.just("set field"), st.integers(0, 64), index, u64s)
byte_level = st.one_of(truncate, flip, overwrite, set_field, set_field, set_field)


def mutate_bytes(lay: Layout, mutations: list[tuple]) -> bytes:
    """Byte-level damage; flips and overwrites stay in the header (before the tensor data)."""
    buf = bytearray(lay.raw)
    kinds = sorted(lay.fields)
    for m in mutations:
        op = m[0]
        if op == "truncate":
            del buf[int(m[1] * len(buf)) :]
        elif op == "flip" and buf:
            buf[m[1] % min(len(buf), lay.header_end)] ^= 1 << m[2]
        elif op == "overwrite" and buf:
            pos = m[1] % min(len(buf), lay.header_end)
            buf[pos : pos + len(m[2])] = m[2]
        elif op == "set field":
            fields = lay.fields[kinds[m[1] % len(kinds)]]
            pos, fmt = fields[m[2] % len(fields)]
            size = struct.calcsize(fmt)
            if pos + size <= len(buf):
                buf[pos : pos + size] = (m[3] % 2 ** (8 * size)).to_bytes(size, "little")
    return bytes(buf)


# --- regressions: inputs the fuzzer (or reading the code it drove) found, now clear errors ----------------

U32, I32, U64T, F32, STR, ARR = (int(t) for t in (V.UINT32, V.INT32, V.UINT64, V.FLOAT32, V.STRING, V.ARRAY))
REGRESSIONS: dict[str, tuple[str, list[tuple], str | None]] = {
    # ZeroDivisionError in Qwen35Config (layer i is recurrent unless (i + 1) % interval == 0).
    "qwen35 full_attention_interval 0": (
        "qwen35",
        [("set kv", "{a}.full_attention_interval", (U32, 0))],
        "qwen35.full_attention_interval = 0: must be at least 1",
    ),
    # A hang building per-layer lists and tensor specs for 4 billion layers.
    "block_count 2**32 - 1": (
        "llama",
        [("set kv", "{a}.block_count", (U32, 2**32 - 1))],
        "llama.block_count = 4294967295: must be 1 to 512",
    ),
    "block_count 2**63 (u64)": (
        "qwen35",
        [("set kv", "{a}.block_count", (U64T, 2**63))],
        "qwen35.block_count = 9223372036854775808",
    ),
    # MemoryError / a 4 GiB table: the token-type lookup table was sized by the largest type value.
    "token_type 2**32 - 1": (
        "gemma3",
        [("set kv", "tokenizer.ggml.token_type", (ARR, (U32, [2**32 - 1] * 300)))],
        None,
    ),
    "token_type 2**64 - 1": (
        "gemma3",
        [("set kv", "tokenizer.ggml.token_type", (ARR, (U64T, [2**64 - 1] * 300)))],
        None,
    ),
    # numpy's bare ValueError ("inhomogeneous shape") for arrays of arrays.
    "token_type arrays of arrays": (
        "gemma3",
        [("set kv", "tokenizer.ggml.token_type", (ARR, (ARR, [(int(V.UINT8), [1]), (int(V.UINT8), [1, 2])] * 150)))],
        "tokenizer.ggml.token_type should be 292 integers",
    ),
    "scores arrays of arrays": (
        "gemma3",
        [("set kv", "tokenizer.ggml.scores", (ARR, (ARR, [(int(V.UINT8), [1]), (int(V.UINT8), [1, 2])] * 150)))],
        "tokenizer.ggml.scores should be 292 numbers",
    ),
    # ZeroDivisionError in the model classes (RopeTable(..., 1.0 / rope_scale)).
    "rope scaling factor 0 (gemma3)": (
        "gemma3",
        [("set kv", "{a}.rope.scaling.type", (STR, "linear")), ("set kv", "{a}.rope.scaling.factor", (F32, 0.0))],
        "gemma3.rope.scaling.factor = 0.0: must be a positive number",
    ),
    "rope scaling factor 0 (llama)": (
        "llama",
        [("set kv", "{a}.rope.scaling.type", (STR, "linear")), ("set kv", "{a}.rope.scaling.factor", (F32, 0.0))],
        "llama.rope.scaling.factor = 0.0",
    ),
    # torch's RuntimeError "negative dimension" in RopeTable.
    "rope.dimension_count -2": (
        "llama",
        [("set kv", "{a}.rope.dimension_count", (I32, -2))],
        "llama.rope.dimension_count = -2: must be even",
    ),
    # torch RuntimeError in QTensor.from_gguf (an empty tensor viewed as [0, -1]) when metadata and tensors agree on 0.
    "feed_forward_length 0 with empty FFN tensors": (
        "llama",
        [
            ("set kv", "{a}.feed_forward_length", (U32, 0)),
            ("tensor ne", "blk.0.ffn_gate.weight", [64, 0]),
            ("tensor ne", "blk.0.ffn_up.weight", [64, 0]),
            ("tensor ne", "blk.0.ffn_down.weight", [0, 64]),
        ],
        "the metadata gives tensor 'blk.0.ffn_gate.weight' the shape [0, 64]",
    ),
    # numpy's "Maximum allowed dimension exceeded" from TensorInfo.numpy(): 0 elements, absurd other dims.
    "tensor with a zero and a 2**63 dimension": (
        "llama",
        [("tensor ne", "output_norm.weight", [0, 2**63])],
        "tensor 'output_norm.weight' has dimensions [0, 9223372036854775808]: more than 2**63 - 1 elements",
    ),
    # What the fuzzer tries, as fixed seeds: each already ended in a clear error.
    "block_count as a string": (
        "llama",
        [("set kv", "{a}.block_count", (STR, "2"))],
        "metadata key 'llama.block_count' should be an integer, got str",
    ),
    "tokens as integers": (
        "llama",
        [("set kv", "tokenizer.ggml.tokens", (ARR, (I32, [1, 2, 3])))],
        "metadata key 'tokenizer.ggml.tokens' should be an array of strings, got array of 3",
    ),
    "aliasing tensors": ("llama", [("tensor offset", "blk.0.ffn_up.weight", ("alias", 0))], "overlap in the file"),
    "negative offset": ("llama", [("tensor offset", 3, ("absolute", U64 - 32))], "data runs past the end of the file"),
    "data past EOF": ("llama", [("data length", 0.5)], "data runs past the end of the file"),
    "huge dimensions": ("llama", [("tensor ne", 0, [2**63, 2**63, 2**63, 2**63])], "more than 2**63 - 1 elements"),
}


@pytest.mark.parametrize("case", REGRESSIONS, ids=str)
def test_regression(bases, fuzz_dir, case):
    arch, mutations, message = REGRESSIONS[case]
    content = mutate_structure(bases[arch], mutations)
    run_case(fuzz_dir, content, "regressions")
    errors: list[str] = []
    path = fuzz_dir / "regression.gguf"
    path.write_bytes(content)
    for stage in (lambda: load(path), lambda: Tokenizer.from_gguf(path)):
        try:
            stage()
        except GGUFError as e:
            errors.append(str(e))
    if message is None:
        assert not errors
    else:
        assert any(message in e for e in errors), errors


def test_arrays_nested_5000_deep(bases, fuzz_dir):
    """RecursionError in the reader: each level of an array of arrays costs only 12 bytes of file."""
    lay = bases["llama"]
    nested = struct.pack("<Q", 5) + b"x.arr" + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 1) * 5000
    nested += struct.pack("<IQ", V.UINT32, 0)
    content = assemble(lay, [raw for _, raw in lay.kvs] + [nested], [encode_info(*i) for i in lay.infos], lay.data)
    run_case(fuzz_dir, content, "regressions")
    with pytest.raises(GGUFError, match="metadata key 'x.arr' nests arrays more than 8 deep"):
        open_gguf(fuzz_dir / "regressions.gguf")
    # Nesting within the limit still reads (gguf-py writes arrays of arrays).
    ok = struct.pack("<Q", 5) + b"x.arr" + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 1) * 3
    ok += struct.pack("<IQ", V.UINT8, 2) + b"\x01\x02"
    content = assemble(lay, [raw for _, raw in lay.kvs] + [ok], [encode_info(*i) for i in lay.infos], lay.data)
    (fuzz_dir / "ok.gguf").write_bytes(content)
    assert open_gguf(fuzz_dir / "ok.gguf").metadata["x.arr"][0][0][0].tolist() == [1, 2]


@pytest.mark.parametrize("value", [(ARR, (U32, [1, 1])), (STR, "1"), (U32, 2)], ids=["array", "string", "wrong count"])
def test_split_metadata_of_the_wrong_type(bases, tmp_path, value):
    """numpy's "truth value of an array is ambiguous" ValueError when split.count was an array."""
    path = tmp_path / "m-00001-of-00001.gguf"
    path.write_bytes(
        mutate_structure(bases["llama"], [("set kv", "split.count", value), ("set kv", "split.no", (U32, 0))])
    )
    with pytest.raises(GGUFError, match="metadata says split 0 of .*, file name says 0 of 1"):
        open_gguf(path)


def test_sentencepiece_token_of_a_megabyte(bases, fuzz_dir):
    """A hang: SentencePiece merges are derived by cutting each token at every position (quadratic in its
    length), so a 1 MB token took minutes; it is now refused by length."""
    md = _spm_vocab()
    tokens = [*md["tokenizer.ggml.tokens"], "x" * 2**20]
    content = mutate_structure(
        bases["gemma3"],
        [
            ("set kv", "tokenizer.ggml.tokens", (ARR, (STR, tokens))),
            ("set kv", "tokenizer.ggml.scores", (ARR, (F32, [0.0] * len(tokens)))),
            ("set kv", "tokenizer.ggml.token_type", (ARR, (I32, [1] * len(tokens)))),
        ],
    )
    run_case(fuzz_dir, content, "regressions")
    with pytest.raises(
        GGUFError, match=r"token 292 of tokenizer.ggml.tokens is 1048576 characters long \(at most 1024"
    ):
        Tokenizer.from_gguf(fuzz_dir / "regressions.gguf")


# --- the fuzz tests -------------------------------------------------------------------------------------

arch_names = st.sampled_from(sorted(SYNTHETIC))


@settings(FUZZ, max_examples=fuzz_examples(800))
@given(arch=arch_names, mutations=st.lists(metadata_changes, min_size=1, max_size=3))
def test_fuzz_metadata(bases, fuzz_dir, arch, mutations):
    """Wrong types and absurd values (of their own type: 0, -1, 2**31, 2**64 - 1, NaN, resized arrays...) for
    the keys the config and vocabulary code read, and dropped keys."""
    run_case(fuzz_dir, mutate_structure(bases[arch], mutations), "metadata")


@settings(FUZZ, max_examples=fuzz_examples(300))
@given(arch=arch_names, mutations=st.lists(structured, min_size=1, max_size=3))
def test_fuzz_tensor_infos(bases, fuzz_dir, arch, mutations):
    """Tensor infos with absurd dimensions (up to 2**64 - 1, 0 or 5 of them), unknown types, aliasing,
    misaligned, negative or past-EOF offsets, duplicate names, dropped tensors, truncated data, duplicate keys
    (mixed with metadata changes)."""
    run_case(fuzz_dir, mutate_structure(bases[arch], mutations), "tensor infos")


@settings(FUZZ, max_examples=fuzz_examples(400))
@given(arch=arch_names, mutations=st.lists(byte_level, min_size=1, max_size=4))
@example(arch="llama", mutations=[("truncate", 0.3)])
@example(arch="llama", mutations=[("set field", 0, 0, U64 - 1)])
def test_fuzz_bytes(bases, fuzz_dir, arch, mutations):
    """Truncations, flipped bits and overwritten ranges of the header, and any numeric field of the header
    (counts, string and array lengths, value and tensor types, dimensions, offsets) set to an absurd value."""
    run_case(fuzz_dir, mutate_bytes(bases[arch], mutations), "bytes")


@settings(FUZZ, max_examples=fuzz_examples(100))
@given(
    mutations=st.one_of(
        st.lists(byte_level, min_size=1, max_size=3).map(lambda m: ("bytes", m)),
        st.lists(structured, min_size=1, max_size=2).map(lambda m: ("structure", m)),
    )
)
def test_fuzz_tinyqwen_header(tinyqwen, fuzz_dir, mutations):
    """The same damage to the header of the real tinyqwen35 Q4_K_M fixture (5.9 MB: a vocabulary of 4096 tokens
    and 3835 merges, a 7.7 kB chat template, 9 blocks with an MTP block, K-quant tensors)."""
    kind, ms = mutations
    content = mutate_bytes(tinyqwen, ms) if kind == "bytes" else mutate_structure(tinyqwen, ms)
    run_case(fuzz_dir, content, "tinyqwen")
