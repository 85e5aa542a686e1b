"""The GGUF reader against files written by gguf-py's GGUFWriter and read by gguf-py's GGUFReader."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from mtpserve.gguf import GGUFError, open_gguf
from mtpserve.quant import dequantize_tensor

from ..conftest import TINYQWEN_QUANTS, tinyqwen_path
from ..support.ggufgen import WRITABLE_TYPES, encode, write_gguf

METADATA_WRITERS = [
    ("t.u8", "add_uint8", 200),
    ("t.i8", "add_int8", -100),
    ("t.u16", "add_uint16", 60000),
    ("t.i16", "add_int16", -30000),
    ("t.u32", "add_uint32", 4_000_000_000),
    ("t.i32", "add_int32", -2_000_000_000),
    ("t.u64", "add_uint64", 2**63 + 5),
    ("t.i64", "add_int64", -(2**62)),
    ("t.f32", "add_float32", 0.5),
    ("t.f64", "add_float64", 1e-300),
    ("t.bool", "add_bool", True),
    ("t.str", "add_string", "héllo 世界"),
]


def write_everything(path: Path, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, T]]:
    w = GGUFWriter(path, "llama")
    for key, method, value in METADATA_WRITERS:
        getattr(w, method)(key, value)
    w.add_array("t.arr_int", [1, 2, 3])
    w.add_array("t.arr_float", [0.25, -1.5])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_array("t.arr_str", ["a", "", "ü<0x0A>"])
    written: dict[str, tuple[np.ndarray, T]] = {}
    for ggml_type in WRITABLE_TYPES:
        data = encode(rng.standard_normal((3, 64)), ggml_type)
        written[f"w.{ggml_type.name}"] = (data, ggml_type)
    # K-quants cannot be quantized by gguf-py: take real blocks from a llama.cpp-quantized fixture.
    fixture = GGUFReader(tinyqwen_path("Q4_K_M"))
    for t in fixture.tensors:
        if t.tensor_type in (T.Q4_K, T.Q6_K) and f"w.{t.tensor_type.name}" not in written:
            written[f"w.{t.tensor_type.name}"] = (np.array(t.data), t.tensor_type)
    written["vec"] = (rng.standard_normal(7).astype(np.float32), T.F32)
    for name, (data, ggml_type) in written.items():
        w.add_tensor(name, data, raw_dtype=ggml_type if ggml_type not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_round_trip_of_every_value_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    written = write_everything(path, np.random.default_rng(0))
    g = open_gguf(path)

    for key, _, value in METADATA_WRITERS:
        assert g.metadata[key] == pytest.approx(value) if isinstance(value, float) else g.metadata[key] == value
    assert g.metadata["t.arr_int"].tolist() == [1, 2, 3]
    assert g.metadata["t.arr_float"].tolist() == [0.25, -1.5]
    assert g.metadata["t.arr_bool"].tolist() == [True, False, True]
    assert g.metadata["t.arr_str"] == ["a", "", "ü<0x0A>"]
    assert g.architecture == "llama"

    assert list(g.tensors) == list(written)
    for name, (data, ggml_type) in written.items():
        t = g.tensors[name]
        assert t.ggml_type == ggml_type
        assert t.raw().tobytes() == data.tobytes()
        expected = quants.dequantize(data, ggml_type)
        assert t.shape == expected.shape
        np.testing.assert_array_equal(dequantize_tensor(t).numpy(), expected)


def test_agrees_with_gguf_reader(tmp_path):
    paths = [tinyqwen_path(q) for q in TINYQWEN_QUANTS]
    write_everything(tmp_path / "all.gguf", np.random.default_rng(1))
    for path in [*paths, tmp_path / "all.gguf"]:
        ours, theirs = open_gguf(path), GGUFReader(path)
        fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert list(ours.metadata) == list(fields)
        for key, field in fields.items():
            value = ours.metadata[key]
            expected = field.contents()
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, np.array(expected))
            else:
                assert value == expected, key
        assert [t.name for t in theirs.tensors] == list(ours.tensors)
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.ggml_type, mine.ne, mine.offset, mine.n_bytes) == (
                t.tensor_type,
                tuple(int(d) for d in t.shape),
                t.data_offset,
                t.n_bytes,
            )
            np.testing.assert_array_equal(mine.numpy(), t.data)


def test_split_model_opens_as_one(tmp_path):
    rng = np.random.default_rng(2)
    tensors = [(f"t{i}", rng.standard_normal((2, 32)), T.Q8_0) for i in range(5)]
    write_gguf(tmp_path / "m.gguf", "llama", {"llama.block_count": 1}, tensors, split_max_tensors=2)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert [p.name for p in parts] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    for part in parts:  # any part opens the whole model
        g = open_gguf(part)
        assert list(g.tensors) == [f"t{i}" for i in range(5)]
        assert g.metadata["llama.block_count"] == 1
        assert g.file_size == sum(p.stat().st_size for p in parts)
        for name, values, ggml_type in tensors:
            np.testing.assert_array_equal(
                dequantize_tensor(g.tensors[name]).numpy(), quants.dequantize(encode(values, ggml_type), ggml_type)
            )
    parts[1].unlink()
    with pytest.raises(GGUFError, match=r"split part 2 of 3 is missing"):
        open_gguf(parts[0])


# --- bad files: each gives one GGUFError naming the file and the problem -------------------------------


def raw_gguf(
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    kv: list[tuple[bytes, int, bytes]] | None = None,
    tensors: list[tuple[bytes, tuple[int, ...], int, int]] | None = None,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    data: bytes | None = None,
) -> bytes:
    """A GGUF assembled byte by byte, so that any field can be made wrong."""
    kv = [(b"general.architecture", 8, struct.pack("<Q", 5) + b"llama")] if kv is None else kv
    tensors = [(b"a", (32,), int(T.F32), 0), (b"b", (32,), int(T.Q8_0), 128)] if tensors is None else tensors
    out = magic + struct.pack(
        "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kv) if n_kv is None else n_kv
    )
    for key, vtype, value in kv:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value
    for name, ne, ggml_type, offset in tensors:
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % 32)
    return out + (bytes(128 + 34) if data is None else data)


BAD_FILES = {
    "wrong magic": (raw_gguf(magic=b"GGML"), "not a GGUF file: magic is b'GGML'"),
    "version 1": (raw_gguf(version=1), "unsupported GGUF version 1"),
    "big endian": (raw_gguf(version=3 << 16), "big-endian GGUF files are not supported"),
    "header only": (b"GGUF\x03\0\0\0", "smaller than a GGUF header"),
    "truncated key": (raw_gguf(tensors=[])[:40], "file is truncated: metadata key #0 needs 20 bytes at offset 32"),
    "truncated value": (
        raw_gguf(tensors=[])[:66],
        "file is truncated: metadata key 'general.architecture' needs 5 bytes at offset 64",
    ),
    "absurd metadata count": (raw_gguf(n_kv=2**40), "metadata count 1099511627776 cannot fit"),
    "absurd tensor count": (raw_gguf(n_tensors=2**50), "tensor count 1125899906842624 cannot fit"),
    "huge string length": (
        raw_gguf(kv=[(b"general.name", 8, struct.pack("<Q", 2**60) + b"x")]),
        "file is truncated: metadata key 'general.name' needs 1152921504606846976 bytes",
    ),
    "huge array": (
        raw_gguf(kv=[(b"x.arr", 9, struct.pack("<IQ", 4, 2**61))]),
        "metadata key 'x.arr' claims 2305843009213693952 elements",
    ),
    "unknown value type": (raw_gguf(kv=[(b"x.v", 77, b"")]), "metadata key 'x.v' has unknown value type 77"),
    "tensor past end of file": (raw_gguf(data=bytes(150)), "tensor 'b' data runs past the end of the file"),
    "unknown ggml type": (raw_gguf(tensors=[(b"a", (32,), 99, 0)]), "tensor 'a' has unknown ggml type id 99"),
    "overlapping tensors": (
        raw_gguf(tensors=[(b"a", (64,), int(T.F32), 0), (b"b", (32,), int(T.F32), 128)], data=bytes(512)),
        "tensors 'a' and 'b' overlap",
    ),
    "misaligned offset": (
        raw_gguf(tensors=[(b"a", (8,), int(T.F32), 4)]),
        "tensor 'a' offset 4 is not a multiple of the alignment 32",
    ),
    "partial block": (
        raw_gguf(tensors=[(b"a", (33,), int(T.Q8_0), 0)]),
        "tensor 'a' row length 33 is not a multiple of the Q8_0 block size 32",
    ),
    "too many dims": (raw_gguf(tensors=[(b"a", (1, 1, 1, 1, 1), int(T.F32), 0)]), "tensor 'a' has 5 dimensions"),
    "duplicate tensor": (
        raw_gguf(tensors=[(b"a", (8,), int(T.F32), 0), (b"a", (8,), int(T.F32), 32)]),
        "tensor 'a' appears twice",
    ),
    "duplicate key": (
        raw_gguf(kv=[(b"k", 4, struct.pack("<I", 1)), (b"k", 4, struct.pack("<I", 2))]),
        "metadata key 'k' appears twice",
    ),
    "bad alignment": (
        raw_gguf(kv=[(b"general.alignment", 4, struct.pack("<I", 3))]),
        "general.alignment must be a power-of-two",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=str)
def test_bad_file_gives_one_clear_error(tmp_path, case):
    content, message = BAD_FILES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError) as err:
        open_gguf(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_the_raw_builder_makes_a_valid_file(tmp_path):
    """The bad-file cases above differ from this one valid file only in the field they break."""
    path = tmp_path / "good.gguf"
    path.write_bytes(raw_gguf())
    g = open_gguf(path)
    assert g.architecture == "llama" and [t.name for t in g.tensors.values()] == ["a", "b"]


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open: No such file"):
        open_gguf(tmp_path / "nope.gguf")
