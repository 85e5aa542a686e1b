"""Slot files: one slot's state on disk, for llama-server's `POST /slots/{id}?action=save|restore`, and the rules
for their names.

A file holds everything that makes the slot continue as if it had never been saved: its tokens, every attention
layer's KV rows (positions 0..length-1 in order; a sliding-window ring whole, with its cells' positions), each
Gated DeltaNet layer's conv and SSM state, the recurrent checkpoints (with the trunk's hidden state there), and
with draft-mtp the MTP block's KV rows (an attention layer of the state like the others) and the hidden state its
next row reads. Layout (version 1), little-endian:

    8 bytes   magic b"MTPSLOT\\0"
    u32       format version
    u32       header length H
    H bytes   header, JSON: model fingerprint, n_past, the layers' layout, the checkpoints, and the tensors
              (name, dtype, shape) in the order their bytes follow
    ...       each tensor's bytes, C-contiguous
    u32       CRC-32 of the header and the tensors' bytes

No pickle: JSON and raw bytes of an allowed set of dtypes, every shape checked against the slot's own before
anything is written into it. The fingerprint is a SHA-256 of the GGUF's metadata (every key, type and value)
and tensor layout (name, type, dimensions): a file from another model, another quantization or an edited file
is refused, as is one saved with another KV cache type or without the MTP block's cache.

Files live only directly in --slot-save-path: a name is one path component (no separators, no `..`, no control
characters, llama.cpp's `fs_validate_filename` rules), and a symbolic link is never followed (refused by name,
and opened with O_NOFOLLOW). A save writes a temporary file and renames it over the name: a failed save leaves
the previous file whole.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import stat
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..cache import KVCache, RecurrentState
from ..gguf.reader import open_gguf
from .drafters import Drafter, MTPDrafter
from .errors import InvalidRequest, ServerError
from .slots import Checkpoint, Reuse, Slot, Slots

MAGIC = b"MTPSLOT\0"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_CRC = struct.Struct("<I")
MAX_HEADER = 64 << 20  # bytes: a header lists tensors, never their data
MAX_NAME_BYTES = 255
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int64": torch.int64,
}
_FORBIDDEN = set(':*?"<>|/\\')  # llama.cpp's fs_validate_filename, separators included


class SlotFileError(InvalidRequest):
    """A slot file (or a file name) this server cannot use; the message says why."""


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # SHA-256 of the GGUF's metadata and tensor layout
    model: str  # the file's name, for messages


@dataclass
class SlotImage:
    """A slot's state as CPU tensors: taken from the slot on the engine thread, written or read on another."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.header["n_past"])


# --- names -------------------------------------------------------------------------------------------------


def slot_file_path(directory: Path, filename: object) -> Path:
    """The path of `filename` directly inside `directory`; SlotFileError (400) for anything that could name a
    file elsewhere, or a symbolic link."""
    if not isinstance(filename, str) or not filename:
        raise SlotFileError("'filename' is required: the name of a file in --slot-save-path")
    problem = _name_problem(filename)
    if problem:
        raise SlotFileError(f"Invalid filename {filename[:100]!r}: {problem}")
    path = directory / filename
    if path.is_symlink():
        raise SlotFileError(
            f"Invalid filename {filename!r}: it is a symbolic link (slot files are regular files in --slot-save-path)"
        )
    return path


def _name_problem(name: str) -> str | None:
    """Why `name` is not one plain path component (None: it is)."""
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "control characters (NUL included) are not allowed"
    if "/" in name or "\\" in name:
        return "path separators are not allowed: give a file name in --slot-save-path, not a path"
    if ".." in name or name == ".":
        return "'.' and '..' are not allowed"
    if any(c in _FORBIDDEN for c in name):
        return 'the characters : * ? " < > | are not allowed'
    if name[0] == " " or name[-1] in " .":
        return "a name may not start with a space or end with a space or a dot"
    return None


# --- the model's fingerprint ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def model_fingerprint(path: str) -> Fingerprint:
    """SHA-256 of a GGUF's metadata (keys, types, values) and tensor layout (names, types, dimensions)."""
    gguf = open_gguf(path)
    h = hashlib.sha256(b"mtpserve-gguf-fingerprint-1")
    for key, value in gguf.metadata.items():
        _feed(h, key)
        _feed(h, int(gguf.metadata_types[key]))
        _feed(h, value)
    for name in sorted(gguf.tensors):
        t = gguf.tensors[name]
        _feed(h, [name, int(t.ggml_type), list(t.ne)])
    return Fingerprint(h.hexdigest(), Path(path).name)


def _feed(h: Any, value: Any) -> None:
    """An unambiguous encoding of a metadata value into the hash."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data) + data)
    elif isinstance(value, np.ndarray):
        h.update(f"a{value.dtype.str}{value.shape}:".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, list | tuple):
        h.update(b"l%d:" % len(value))
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


# --- slot -> image -> file -----------------------------------------------------------------------------------


def capture(slot: Slot, drafter: Drafter | None) -> SlotImage:
    """The idle slot's state as CPU copies (engine thread); a later request may change the slot meanwhile."""
    if drafter is not None:
        drafter.finish(slot)  # draft-mtp: deferred MTP rows written, so its cache ends where the trunk's does
    state, tensors = slot.state, {}
    kv_layout = {}
    for layer, kv in state.kv.items():
        kv_layout[str(layer)] = {"length": kv.length, "ring": kv.ring}
        if kv.ring:
            tensors[f"kv.{layer}.k"], tensors[f"kv.{layer}.v"] = kv.k.portable(kv.k.data), kv.v.portable(kv.v.data)
            tensors[f"kv.{layer}.positions"] = kv.positions
        else:
            cells = kv._cells(0, kv.length)
            tensors[f"kv.{layer}.k"] = kv.k.portable(kv.k.data[cells])
            tensors[f"kv.{layer}.v"] = kv.v.portable(kv.v.data[cells])
    for layer, rec in state.recurrent.items():
        tensors[f"rec.{layer}.conv"], tensors[f"rec.{layer}.ssm"] = rec.conv, rec.ssm
    checkpoints = []
    for j, c in enumerate(slot.checkpoints):
        checkpoints.append({"position": c.position, "layers": sorted(c.recurrent), "hidden": c.hidden is not None})
        for layer, snap in c.recurrent.items():
            tensors[f"ckpt.{j}.{layer}.conv"], tensors[f"ckpt.{j}.{layer}.ssm"] = snap.conv, snap.ssm
        if c.hidden is not None:
            tensors[f"ckpt.{j}.hidden"] = c.hidden
    pending_h = _mtp_hidden(drafter, slot)
    if pending_h is not None:
        tensors["mtp.hidden"] = pending_h
    tensors["tokens"] = torch.tensor(slot.tokens, dtype=torch.int64)
    header = {
        "n_past": state.n_past,
        "kv": kv_layout,
        "recurrent": sorted(state.recurrent),
        "checkpoints": checkpoints,
        "mtp_hidden": pending_h is not None,
    }
    return SlotImage(header, {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()})


def write(path: Path, image: SlotImage, fingerprint: Fingerprint) -> int:
    """Write the image to `path` (a temporary file renamed over it); the bytes written."""
    specs = [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for n, t in image.tensors.items()
    ]
    unreadable = [s for s in specs if s["dtype"] not in _DTYPES]
    if unreadable:  # a cache type added without its dtype here: refused now, not at restore
        raise ServerError(f"cannot save the slot: {unreadable[0]['name']} is {unreadable[0]['dtype']}")
    header = json.dumps(
        {**image.header, "fingerprint": fingerprint.digest, "model": fingerprint.model, "tensors": specs}
    ).encode()
    if path.exists() and not path.is_symlink() and not path.is_file():  # (links: refused by the caller)
        raise SlotFileError(f"Unable to save slot: {path.name!r} is not a regular file in --slot-save-path")
    tmp = path.with_name(f".slot-{os.getpid()}-{time.monotonic_ns()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
            crc = zlib.crc32(header)
            f.write(header)
            for t in image.tensors.values():
                data = t.reshape(-1).view(torch.uint8).numpy()
                crc = zlib.crc32(data, crc)
                f.write(data)
            f.write(_CRC.pack(crc))
            size = f.tell()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ServerError(f"could not save the slot to {path.name!r}: {e.strerror or e}") from None
    return size


# --- file -> image -> slot -----------------------------------------------------------------------------------


def read(path: Path, fingerprint: Fingerprint) -> tuple[SlotImage, int]:
    """The image in `path` and the file's size, checked whole (magic, version, fingerprint, sizes, CRC) before
    the slot is touched; SlotFileError says what is wrong."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))  # a FIFO must not block
    except FileNotFoundError:
        raise SlotFileError(f"Unable to restore slot: there is no file {name!r} in --slot-save-path") from None
    except OSError as e:
        raise SlotFileError(f"Unable to restore slot: cannot open {name!r}: {e.strerror or e}") from None
    try:  # a directory opens too, but os.fdopen refuses it: the descriptor is closed here either way
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SlotFileError(f"Unable to restore slot: {name!r} is not a regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        header, raw = _read_header(f, name, info.st_size)
        _check_fingerprint(header, name, fingerprint)
        specs = header.pop("tensors")
        expected = f.tell() + sum(_nbytes(s) for s in specs) + _CRC.size
        if info.st_size != expected:
            problem = "truncated" if info.st_size < expected else "longer than its header says"
            raise SlotFileError(
                f"Unable to restore slot: {name!r} is {problem} ({info.st_size} bytes, expected {expected})"
            )
        crc, tensors = zlib.crc32(raw), {}
        for spec in specs:
            data = bytearray(_nbytes(spec))
            if f.readinto(data) != len(data):
                raise SlotFileError(f"Unable to restore slot: {name!r} is truncated")
            crc = zlib.crc32(data, crc)
            tensors[spec["name"]] = _tensor(data, spec)
        (stored,) = _CRC.unpack(f.read(_CRC.size))
    if stored != crc:
        raise SlotFileError(f"Unable to restore slot: {name!r} is corrupted (its checksum does not match its data)")
    return SlotImage(header, tensors), info.st_size


def _read_header(f: BinaryIO, name: str, size: int) -> tuple[dict[str, Any], bytes]:
    """The header (its tensor list checked for dtypes and shapes) and its raw bytes."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
        raise SlotFileError(f"Unable to restore slot: {name!r} is not a slot file (it does not start with {MAGIC!r})")
    _, version, n_header = _PREFIX.unpack(prefix)
    if version != VERSION:
        raise SlotFileError(
            f"Unable to restore slot: {name!r} has slot file format version {version}; this server reads version "
            f"{VERSION}"
        )
    if n_header > min(MAX_HEADER, size):
        raise SlotFileError(f"Unable to restore slot: {name!r} is corrupted (a header of {n_header} bytes)")
    raw = f.read(n_header)
    try:
        header = json.loads(raw)
        for spec in header["tensors"]:
            if spec["dtype"] not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in spec["shape"]):
                raise ValueError(f"tensor {spec['name']!r} is {spec['dtype']} {spec['shape']}")
    except (ValueError, KeyError, TypeError) as e:
        raise SlotFileError(f"Unable to restore slot: {name!r} is corrupted (its header: {e})") from None
    return header, raw


def _check_fingerprint(header: dict[str, Any], name: str, fingerprint: Fingerprint) -> None:
    if header.get("fingerprint") != fingerprint.digest:
        raise SlotFileError(
            f"Unable to restore slot: {name!r} was saved from another model ({header.get('model')!r}, fingerprint "
            f"{str(header.get('fingerprint'))[:12]}); this server runs {fingerprint.model!r} (fingerprint "
            f"{fingerprint.digest[:12]})"
        )


def _nbytes(spec: dict[str, Any]) -> int:
    return math.prod(spec["shape"]) * _DTYPES[spec["dtype"]].itemsize  # exact: a forged shape cannot wrap around


def _tensor(data: bytearray, spec: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    if not data:
        return torch.empty(spec["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(spec["shape"])


def apply(image: SlotImage, slot: Slot, slots: Slots, drafter: Drafter | None, hidden: HiddenSpec) -> None:
    """Make the idle slot hold the image (engine thread). Every shape is checked first: a refused image leaves
    the slot as it was. The slot's tensors are written in place (captured CUDA graphs read them there)."""
    try:
        _check_layout(image, slot, hidden.n_embd)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SlotFileError(
            f"Unable to restore slot: the file's header is malformed ({type(e).__name__}: {e})"
        ) from None
    try:
        _load(image, slot, slots, drafter, hidden.device)
    except Exception:
        slots.reset(slot)  # never a half-restored slot
        if drafter is not None:
            drafter.rewind(slot, Reuse(0))
        raise


@dataclass(frozen=True)
class HiddenSpec:
    """Where the trunk's hidden states live (checkpoints, draft-mtp's next row) and their size."""

    device: torch.device
    n_embd: int


def _check_layout(image: SlotImage, slot: Slot, n_embd: int) -> None:
    """SlotFileError unless every tensor of the image fits the slot's caches as they are."""
    header, t, state = image.header, image.tensors, slot.state
    n_past = int(header["n_past"])
    if not 0 <= n_past < state.capacity:
        raise SlotFileError(
            f"Unable to restore slot: the file holds {n_past} tokens; this server's slots have {state.capacity} "
            "(start it with a larger --ctx-size)"
        )
    layers = sorted(int(k) for k in header["kv"])
    if layers != sorted(state.kv) or header["recurrent"] != sorted(state.recurrent):
        raise SlotFileError(
            f"Unable to restore slot: the file has attention layers {layers} and recurrent layers "
            f"{header['recurrent']}; this server's slots have {sorted(state.kv)} and {sorted(state.recurrent)} "
            "(the MTP block's cache comes with --spec-type draft-mtp)"
        )
    want: dict[str, tuple[torch.dtype | None, tuple[int, ...]]] = {"tokens": (torch.int64, (n_past,))}
    for layer, kv in state.kv.items():
        saved = header["kv"][str(layer)]
        length, ring = int(saved["length"]), bool(saved["ring"])
        if ring != kv.ring or not 0 <= length <= min(kv.capacity, n_past + 1):
            raise SlotFileError(f"Unable to restore slot: layer {layer}'s cache differs ({length} positions)")
        rows = kv.capacity if ring else length
        want[f"kv.{layer}.k"] = (kv.k.data.dtype, (rows, *kv.k.data.shape[1:]))
        want[f"kv.{layer}.v"] = (kv.v.data.dtype, (rows, *kv.v.data.shape[1:]))
        if ring:
            want[f"kv.{layer}.positions"] = (torch.int64, tuple(kv.positions.shape))
    for layer, rec in state.recurrent.items():
        want.update(_recurrent_shapes(f"rec.{layer}", rec))
    for j, c in enumerate(header["checkpoints"]):
        if not 0 < int(c["position"]) <= n_past:
            raise ValueError(f"checkpoint at {c['position']} of {n_past} tokens")
        for layer in c["layers"]:
            want.update(_recurrent_shapes(f"ckpt.{j}.{layer}", state.recurrent[layer]))
        if c["hidden"]:
            want[f"ckpt.{j}.hidden"] = (None, (n_embd,))
    if header["mtp_hidden"]:
        want["mtp.hidden"] = (None, (n_embd,))
    if set(want) != set(t):
        odd = sorted(set(want) ^ set(t))[:4]
        raise SlotFileError(f"Unable to restore slot: the file's tensors do not match its layout ({odd})")
    for name, (dtype, shape) in want.items():
        got = t[name]
        if tuple(got.shape) != shape or (got.dtype != dtype if dtype else not got.dtype.is_floating_point):
            raise SlotFileError(
                f"Unable to restore slot: {name} is {str(got.dtype)[6:]} {list(got.shape)} in the file but "
                f"{str(dtype or got.dtype)[6:]} {list(shape)} here (saved with another --cache-type-k/-v?)"
            )


def _recurrent_shapes(prefix: str, rec: RecurrentState) -> Iterator[tuple[str, tuple[torch.dtype, tuple[int, ...]]]]:
    yield f"{prefix}.conv", (rec.conv.dtype, tuple(rec.conv.shape))
    yield f"{prefix}.ssm", (rec.ssm.dtype, tuple(rec.ssm.shape))


def _load(image: SlotImage, slot: Slot, slots: Slots, drafter: Drafter | None, hidden_device: torch.device) -> None:
    """The checked image into the slot: cleared first, then every cache written in place."""
    header, t, state = image.header, image.tensors, slot.state
    slots.reset(slot)
    if drafter is not None:
        drafter.rewind(slot, Reuse(0))
    longest = max((kv["length"] for kv in header["kv"].values()), default=0)
    if slots.reserve(slot, longest) < longest:  # --kv-unified: cells from the pool
        raise SlotFileError("Unable to restore slot: no available space in the KV cache (--kv-unified pool)")
    for layer, kv in state.kv.items():
        _load_kv(kv, header["kv"][str(layer)]["length"], t, f"kv.{layer}")
    for layer, rec in state.recurrent.items():
        rec.restore(RecurrentState(t[f"rec.{layer}.conv"], t[f"rec.{layer}.ssm"]))
    state.n_past = image.n_tokens
    slot.tokens = t["tokens"].tolist()
    for j, c in enumerate(header["checkpoints"]):
        recurrent = {
            layer: RecurrentState(
                t[f"ckpt.{j}.{layer}.conv"].to(state.recurrent[layer].conv.device),
                t[f"ckpt.{j}.{layer}.ssm"].to(state.recurrent[layer].ssm.device),
            )
            for layer in c["layers"]
        }
        hidden = t[f"ckpt.{j}.hidden"].to(hidden_device) if c["hidden"] else None
        slots.keep_checkpoint(slot, Checkpoint(c["position"], recurrent, hidden))
    if isinstance(drafter, MTPDrafter) and header["mtp_hidden"]:
        drafter._of(slot).pending_h = t["mtp.hidden"].to(hidden_device)
    slot.t_last_used = time.perf_counter()


def _load_kv(kv: KVCache, length: int, t: dict[str, torch.Tensor], prefix: str) -> None:
    """One attention layer's cache, written in place into its (cleared) cells."""
    if kv.ring:
        kv.k.data.copy_(kv.k.from_portable(t[f"{prefix}.k"].to(kv.device)))
        kv.v.data.copy_(kv.v.from_portable(t[f"{prefix}.v"].to(kv.device)))
        kv.positions.copy_(t[f"{prefix}.positions"])
    else:
        cells = kv._cells(0, length)
        kv.k.data[cells] = kv.k.from_portable(t[f"{prefix}.k"].to(kv.device))
        kv.v.data[cells] = kv.v.from_portable(t[f"{prefix}.v"].to(kv.device))
        kv.positions[cells] = torch.arange(length, device=kv.device)
    kv.length = length


def _mtp_hidden(drafter: Drafter | None, slot: Slot) -> torch.Tensor | None:
    """draft-mtp: the trunk's hidden state the slot's next MTP row reads."""
    return drafter.pending_hidden(slot) if drafter is not None else None
