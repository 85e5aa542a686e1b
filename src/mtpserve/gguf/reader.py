"""GGUF container reader: memory-mapped, bounded, and with errors that name the file and the problem.

The container is parsed here, with gguf-py's type tables (`gguf.constants`), instead of with
`gguf.GGUFReader`: that reader builds a numpy view per string, which takes 7.5 s for a 152k-token
vocabulary on this project's CI machine (the Qwen3.6 vocab has 248k tokens plus as many merges), and a
truncated or hostile file makes it fail deep inside numpy. Here every read is bounds-checked against the
file size before it happens, so a bad file ends in one `GGUFError` and nothing is allocated beyond what
the file itself holds. `gguf.GGUFReader` remains the oracle the tests compare against.

Layout (../shared/spec/gguf-quant-formats.md §1): magic, version, n_tensors, n_kv, key/values, tensor
infos, padding to `general.alignment`, data. Split models (`name-00001-of-00003.gguf`) open as one file.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from .residency import lock, read_into_memory

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of arrays: llama.cpp accepts none, gguf-py writes them; deeper nesting than this is refused (each
# level costs 12 bytes of file, so without a bound a small file could exhaust the stack).
MAX_ARRAY_DEPTH = 8

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    t: np.dtype(fmt.replace("?", "u1")) for t, fmt in _SCALAR_FORMATS.items()
}
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2")}
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `ne` is ggml order (ne[0] contiguous); `shape` is the torch order."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    offset: int  # absolute byte offset in `path`
    n_bytes: int
    path: Path
    _file_bytes: np.ndarray = field(repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    def raw(self) -> np.ndarray:
        """The tensor's bytes as stored, a 1-D uint8 view of the memory map (no copy)."""
        return self._file_bytes[self.offset : self.offset + self.n_bytes]

    def numpy(self) -> np.ndarray:
        """A view shaped like gguf-py's `ReaderTensor.data`: F32/F16 as floats in `shape`, every other
        type as uint8 rows [*shape[:-1], bytes_per_row]."""
        if self.ggml_type in _FLOAT_DTYPES:
            return self.raw().view(_FLOAT_DTYPES[self.ggml_type]).reshape(self.shape)
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.raw().reshape(*self.shape[:-1], self.ne[0] // block_size * type_size)


class GGUFFile:
    """A GGUF model, possibly split over several files, with its metadata and tensors.

    `metadata` maps keys to Python values: ints, floats, bools, str, list[str] for string arrays, and
    numpy arrays for numeric arrays. Tensor data stays in the (copy-on-write) memory map until used.
    """

    def __init__(self, parts: list[_ParsedFile]) -> None:
        self.paths = [p.path for p in parts]
        self.path = self.paths[0]
        self.version = parts[0].version
        self.alignment = parts[0].alignment
        self.metadata: dict[str, Any] = parts[0].metadata
        self.metadata_types: dict[str, GGUFValueType] = parts[0].metadata_types
        self.file_size = sum(p.size for p in parts)
        self.tensors: dict[str, TensorInfo] = {}
        for part in parts:
            for t in part.tensors:
                if t.name in self.tensors:
                    raise GGUFError(part.path, f"tensor '{t.name}' also appears in {self.tensors[t.name].path.name}")
                self.tensors[t.name] = t

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.architecture!r}, tensors={len(self.tensors)})"


def open_gguf(path: str | Path, use_mmap: bool = True, use_mlock: bool = False) -> GGUFFile:
    """Open a GGUF file; a split model is opened from any of its parts (`x-00001-of-00003.gguf`). `use_mmap` False:
    its bytes read into the process's memory; `use_mlock`: its pages pinned in RAM (gguf.residency)."""
    path = Path(path)
    match = _SPLIT_NAME.match(path.name)
    if not match:
        return GGUFFile([_parse_file(path, use_mmap, use_mlock)])
    count = int(match["count"])
    if count < 1:
        raise GGUFError(path, "split file name says it has 0 parts")
    parts = []
    for no in range(1, count + 1):
        part_path = path.with_name(f"{match['prefix']}-{no:05d}-of-{count:05d}.gguf")
        if not part_path.exists():
            raise GGUFError(path, f"split part {no} of {count} is missing (expected {part_path})")
        part = _parse_file(part_path, use_mmap, use_mlock)
        split_no, split_count = part.metadata.get("split.no"), part.metadata.get("split.count")
        # llama.cpp's gguf-split writes a 0-based split.no and the total split.count in every part.
        if split_count is not None and not (
            type(split_count) is int and type(split_no) is int and split_count == count and split_no == no - 1
        ):
            raise GGUFError(
                part_path, f"metadata says split {split_no} of {split_count}, file name says {no - 1} of {count}"
            )
        parts.append(part)
    return GGUFFile(parts)


@dataclass
class _ParsedFile:
    path: Path
    size: int
    version: int
    alignment: int
    metadata: dict[str, Any]
    metadata_types: dict[str, GGUFValueType]
    tensors: list[TensorInfo]


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                self.path,
                f"file is truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.size} bytes",
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, strict: bool = False) -> str:
        length = self.scalar("<Q", f"length of {what}")
        self.need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise GGUFError(self.path, f"{what} is not valid UTF-8 ({e})") from None
            # Keep the bytes recoverable (token texts may hold raw bytes); callers that print must escape.
            return raw.decode("utf-8", errors="surrogateescape")


def _parse_file(path: Path, use_mmap: bool = True, use_mlock: bool = False) -> _ParsedFile:
    try:
        fd = open(path, "rb")
    except OSError as e:
        raise GGUFError(path, f"cannot open: {e.strerror}") from None
    with fd:
        size = fd.seek(0, 2)
        if size < 24:
            raise GGUFError(path, f"file is truncated: {size} bytes is smaller than a GGUF header (24 bytes)")
        buf = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_COPY) if use_mmap else read_into_memory(fd, size, path)
    if use_mlock:
        lock(buf)
    cur = _Cursor(buf, path)

    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(path, f"not a GGUF file: magic is {magic!r}, expected {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            raise GGUFError(path, "big-endian GGUF files are not supported")
        raise GGUFError(
            path, f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    # Each key/value takes at least 8+4+1 bytes and each tensor info at least 8+4+4+8 bytes.
    if n_kv * 13 > size - cur.pos:
        raise GGUFError(path, f"metadata count {n_kv} cannot fit in a {size}-byte file")
    if n_tensors * 24 > size - cur.pos:
        raise GGUFError(path, f"tensor count {n_tensors} cannot fit in a {size}-byte file")

    metadata: dict[str, Any] = {}
    metadata_types: dict[str, GGUFValueType] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", strict=True)
        if key in metadata:
            raise GGUFError(path, f"metadata key '{key}' appears twice")
        vtype = _value_type(cur, f"metadata key '{key}'")
        metadata[key] = _read_value(cur, vtype, f"metadata key '{key}'")
        metadata_types[key] = vtype

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata:
        if metadata_types["general.alignment"] != GGUFValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(path, f"general.alignment must be a power-of-two u32, got {alignment!r}")

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}", strict=True)
        if name in names:
            raise GGUFError(path, f"tensor '{name}' appears twice")
        names.add(name)
        n_dims = cur.scalar("<I", f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(path, f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = tuple(cur.scalar("<Q", f"dimensions of tensor '{name}'") for _ in range(n_dims))
        # ggml counts in int64: no dimension, nor the element count, may reach 2**63 (zeros aside, which
        # numpy and torch accept but which would hide any size in the other dimensions).
        if math.prod(d for d in ne if d) >= 2**63:
            raise GGUFError(path, f"tensor '{name}' has dimensions {list(ne)}: more than 2**63 - 1 elements")
        type_id = cur.scalar("<I", f"type of tensor '{name}'")
        offset = cur.scalar("<Q", f"offset of tensor '{name}'")
        infos.append((name, ne, type_id, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    file_bytes = np.frombuffer(buf, dtype=np.uint8)
    for name, ne, type_id, offset in infos:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(path, f"tensor '{name}' has unknown ggml type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if ne[0] % block_size:
            raise GGUFError(
                path,
                f"tensor '{name}' row length {ne[0]} is not a multiple of the {ggml_type.name} block size {block_size}",
            )
        n_elements = 1
        for d in ne:
            n_elements *= d
        n_bytes = n_elements // block_size * type_size
        start = data_start + offset
        if offset % alignment:
            raise GGUFError(path, f"tensor '{name}' offset {offset} is not a multiple of the alignment {alignment}")
        if start + n_bytes > size:
            raise GGUFError(
                path,
                f"tensor '{name}' data runs past the end of the file "
                f"(bytes {start}..{start + n_bytes}, file has {size} bytes)",
            )
        tensors.append(TensorInfo(name, ggml_type, ne, start, n_bytes, path, file_bytes))

    ordered = sorted(tensors, key=lambda t: t.offset)
    for prev, nxt in zip(ordered, ordered[1:]):
        if nxt.offset < prev.offset + prev.n_bytes:
            raise GGUFError(path, f"tensors '{prev.name}' and '{nxt.name}' overlap in the file")
    return _ParsedFile(path, size, version, alignment, metadata, metadata_types, tensors)


def _value_type(cur: _Cursor, what: str) -> GGUFValueType:
    raw = cur.scalar("<I", f"type of {what}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(cur.path, f"{what} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(what)
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype], what)
    # ARRAY: element type, count, elements.
    etype = _value_type(cur, f"element of {what}")
    if etype == GGUFValueType.ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
        raise GGUFError(cur.path, f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    count = cur.scalar("<Q", f"length of {what}")
    min_size = (
        _SCALAR_DTYPES[etype].itemsize if etype in _SCALAR_DTYPES else (8 if etype == GGUFValueType.STRING else 12)
    )
    if count * min_size > cur.size - cur.pos:
        raise GGUFError(cur.path, f"{what} claims {count} elements, more than the file can hold")
    if etype in _SCALAR_DTYPES:
        dtype = _SCALAR_DTYPES[etype]
        n = count * dtype.itemsize
        values = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
        cur.pos += n
        return values.astype(bool) if etype == GGUFValueType.BOOL else values
    if etype == GGUFValueType.STRING:
        return [cur.string(f"element {i} of {what}") for i in range(count)]
    return [_read_value(cur, etype, f"element {i} of {what}", depth + 1) for i in range(count)]
