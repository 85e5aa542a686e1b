"""`mtpserve pull` against a fake Hugging Face Hub on 127.0.0.1 (never the internet).

The fake hub is two HTTP servers, as the real one is a hub plus a CDN on another host:
* the hub answers `GET /api/models/{repo}[/revision/{rev}]?blobs=True` (what `HfApi.model_info` with
  `files_metadata=True` asks: commit `sha` and `siblings` with size, blobId and `lfs.sha256`) and
  `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: LFS files answer 302 to the CDN with `X-Repo-Commit`,
  `X-Linked-Etag` (the sha256) and `X-Linked-Size`; small files answer 200 with `ETag` (the git blob id);
  errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) as the hub's do; a private
  repo wants `Authorization: Bearer <token>`;
* the CDN serves `/blobs/{sha256}` with `Range` support, and can be told to drop the connection half-way
  through a response or to answer 503, once per queued fault.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from huggingface_hub import constants, file_download

from mtpserve import hub
from mtpserve.cli import main
from mtpserve.gguf import open_gguf
from mtpserve.hub import HubError, select_model

from .support.ggufgen import write_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Request:
    server: str
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, bytes]  # what the listing and checksums describe
    served: dict[str, bytes]  # what the CDN/resolve actually sends (differs for a corrupted file)
    token: str | None = None
    lfs: set[str] = field(default_factory=set)
    xet: bool = False  # LFS files announce Xet storage (X-Xet-Hash) in their resolve answer


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 (as listed) -> bytes served by the CDN
        self.faults: dict[str, list[str]] = {}  # sha256 -> queued "drop" / "503" for its next GETs
        self.requests: list[Request] = []
        self._servers = [self._start("hub"), self._start("cdn")]
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes], *, token: str | None = None, xet: bool = False) -> FakeRepo:
        commit = hashlib.sha1(repo.encode() + b"".join(files[k] for k in sorted(files))).hexdigest()
        r = FakeRepo(commit, dict(files), dict(files), token, {f for f in files if f.endswith(".gguf")}, xet)
        self.repos[repo] = r
        for name in r.lfs:
            self.blobs[sha256(files[name])] = files[name]
        return r

    def corrupt(self, repo: str, name: str) -> None:
        """Serve `name` with one byte changed, its listed size and sha256 unchanged."""
        r = self.repos[repo]
        bad = bytearray(r.files[name])
        bad[len(bad) // 3] ^= 0xFF
        r.served[name] = bytes(bad)
        self.blobs[sha256(r.files[name])] = bytes(bad)

    def calls(self, server: str, method: str = "GET") -> list[Request]:
        return [r for r in self.requests if r.server == server and r.method == method]

    def close(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def _start(self, role: str) -> http.server.ThreadingHTTPServer:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._handle(body=True)

            def do_HEAD(self) -> None:
                self._handle(body=False)

            def _handle(self, body: bool) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append(Request(role, self.command, self.path, headers))
                if role == "cdn":
                    return self._cdn(headers, body)
                path = unquote(urlparse(self.path).path)
                if path.startswith("/api/models/"):
                    return self._api(path.removeprefix("/api/models/"), headers)
                parts = path.lstrip("/").split("/", 4)
                if len(parts) == 5 and parts[2] == "resolve":
                    return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], parts[4], headers, body)
                self._reply(404, b"not a hub endpoint")

            def _repo(self, repo_id: str, headers: dict[str, str]) -> FakeRepo | None:
                repo = fake.repos.get(repo_id)
                if repo is None:
                    self._reply(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
                    return None
                if repo.token is not None:
                    auth = headers.get("authorization")
                    if auth is None:
                        self._reply(401, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
                        return None
                    if auth != f"Bearer {repo.token}":
                        msg = "Invalid credentials in Authorization header"
                        self._reply(401, msg.encode(), {"X-Error-Message": msg})
                        return None
                return repo

            def _revision_ok(self, repo: FakeRepo, revision: str) -> bool:
                if revision in ("main", repo.commit):
                    return True
                self._reply(404, b"Revision not found", {"X-Error-Code": "RevisionNotFound"})
                return False

            def _api(self, rest: str, headers: dict[str, str]) -> None:
                repo_id, _, revision = rest.partition("/revision/")
                repo = self._repo(repo_id, headers)
                if repo is None or not self._revision_ok(repo, revision or "main"):
                    return
                siblings = []
                for name, data in sorted(repo.files.items()):
                    s = {"rfilename": name, "size": len(data)}
                    if name in repo.lfs:
                        s["blobId"] = git_blob_sha1(b"version https://git-lfs.github.com/spec/v1\n" + data[:8])
                        s["lfs"] = {"size": len(data), "sha256": sha256(data), "pointerSize": 134}
                    else:
                        s["blobId"] = git_blob_sha1(data)
                    siblings.append(s)
                info = {"id": repo_id, "sha": repo.commit, "private": repo.token is not None, "siblings": siblings}
                self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

            def _resolve(self, repo_id: str, revision: str, name: str, headers: dict[str, str], body: bool) -> None:
                repo = self._repo(repo_id, headers)
                if repo is None or not self._revision_ok(repo, revision):
                    return
                common = {"X-Repo-Commit": repo.commit}
                if name not in repo.files:
                    return self._reply(404, b"Entry not found", {**common, "X-Error-Code": "EntryNotFound"})
                data = repo.files[name]
                if name in repo.lfs:
                    digest = sha256(data)
                    redirect = {
                        **common,
                        "Location": f"{fake.cdn_url}/blobs/{digest}",
                        "ETag": '"pointer-oid"',
                        "X-Linked-Etag": f'"{digest}"',
                        "X-Linked-Size": str(len(data)),
                    }
                    if repo.xet:
                        redirect["X-Xet-Hash"] = xet_hash(data)
                        route = f"{fake.url}/api/models/{repo_id}/xet-read-token/{repo.commit}"
                        redirect["X-Xet-Refresh-Route"] = route
                    return self._reply(302, b"", redirect)
                served = repo.served[name]
                self._reply(200, served if body else b"", {**common, "ETag": f'"{git_blob_sha1(data)}"'}, len(served))

            def _cdn(self, headers: dict[str, str], body: bool) -> None:
                digest = urlparse(self.path).path.removeprefix("/blobs/")
                if digest not in fake.blobs:
                    return self._reply(404, b"no such blob")
                data = fake.blobs[digest]
                start = 0
                if "range" in headers:
                    start = int(headers["range"].removeprefix("bytes=").split("-")[0])
                fault = fake.faults.get(digest, []).pop(0) if body and fake.faults.get(digest) else None
                if fault == "503":
                    return self._reply(503, b"unavailable")
                chunk = data[start:]
                extra = {"Accept-Ranges": "bytes", "ETag": f'"{digest}"'}
                status = 200
                if start:
                    status, extra["Content-Range"] = 206, f"bytes {start}-{len(data) - 1}/{len(data)}"
                if fault == "drop":  # promise everything, send half, hang up
                    self._reply(status, chunk[: len(chunk) // 2], extra, length=len(chunk))
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self._reply(status, chunk if body else b"", extra, len(chunk))

            def _reply(self, status: int, data: bytes, headers: dict | None = None, length: int | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return server


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def xet_hash(data: bytes) -> str:
    return hashlib.sha256(b"xet" + data).hexdigest()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake hub, the library pointed at it, its cache in tmp_path, and every other host unreachable."""
    fake = FakeHub()
    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost"):
            raise socket.gaierror(f"test_pull: no network beyond 127.0.0.1 (asked for {host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    home = tmp_path / "hf"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    # huggingface_hub reads its environment once, at import: set what it read, too (but not its ENDPOINT,
    # which its URL template was built from: the endpoint goes to each call, as hub.pull passes it).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # no user-agent look-ups
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # so half a file is several chunks
    yield fake
    fake.close()


def snapshot_dir(fake: FakeHub, tmp_path: Path, repo: str) -> Path:
    return tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / fake.repos[repo].commit


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


# --- plain download ------------------------------------------------------------------------------------


def test_download_into_the_cache_is_verified(fake, tmp_path, monkeypatch):
    data = random_bytes(300_000)
    fake.add("org/model", {"model-Q8_0.gguf": data, "README.md": b"# a model\n"})
    hashed = []
    real_sha256 = hub._sha256
    monkeypatch.setattr(hub, "_sha256", lambda path, name: hashed.append(name) or real_sha256(path, name))

    [path] = hub.pull("org/model", ["model-Q8_0.gguf"])
    assert path == snapshot_dir(fake, tmp_path, "org/model") / "model-Q8_0.gguf"
    assert path.read_bytes() == data
    assert path.resolve().name == sha256(data)  # the library's layout: a snapshot link to the blob named by its hash
    assert hashed == ["model-Q8_0.gguf"]
    ref = tmp_path / "hf" / "hub" / "models--org--model" / "refs" / "main"
    assert ref.read_text() == fake.repos["org/model"].commit
    [get] = fake.calls("cdn")
    assert "range" not in get.headers

    [readme] = hub.pull("org/model", ["README.md"])  # a small git file: checked against its git blob id
    assert readme.read_bytes() == b"# a model\n"

    fake.requests.clear()
    assert hub.pull("org/model", ["model-Q8_0.gguf"]) == [path]  # already there: only the listing is asked
    assert [r.path.split("?")[0] for r in fake.requests] == ["/api/models/org/model"]


def test_download_into_a_local_dir(fake, tmp_path):
    data = random_bytes(100_000, seed=1)
    fake.add("org/model", {"model-Q8_0.gguf": data})
    out = tmp_path / "models"
    [path] = hub.pull("org/model", ["model-Q8_0.gguf"], local_dir=out)
    assert path == out / "model-Q8_0.gguf" and path.read_bytes() == data and not path.is_symlink()
    assert leftovers(out / ".cache") == []  # no partial file left behind


# --- resume ---------------------------------------------------------------------------------------------


def test_a_dropped_connection_resumes_with_a_range_request(fake):
    data = random_bytes(300_000, seed=2)
    fake.add("org/model", {"model-Q8_0.gguf": data})
    fake.faults[sha256(data)] = ["drop"]
    [path] = hub.pull("org/model", ["model-Q8_0.gguf"])
    assert path.read_bytes() == data
    first, second = fake.calls("cdn")
    assert "range" not in first.headers
    resumed_at = int(second.headers["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= len(data) // 2  # continued where the first response broke off, not from 0


@pytest.mark.parametrize("local", [False, True], ids=["cache", "local-dir"])
def test_an_interrupted_pull_resumes_in_the_next_run(fake, tmp_path, local):
    data = random_bytes(300_000, seed=3)
    fake.add("org/model", {"model-Q8_0.gguf": data})
    digest = sha256(data)
    fake.faults[digest] = ["drop", "503"]  # half the file, then the retry fails: the run gives up
    local_dir = tmp_path / "models" if local else None
    with pytest.raises(HubError, match="stopped at .* run the pull again to resume") as err:
        hub.pull("org/model", ["model-Q8_0.gguf"], local_dir=local_dir)
    assert "\n" not in str(err.value)
    [partial] = (tmp_path / ("models" if local else "hf")).rglob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(data) and partial.read_bytes() == data[:kept]

    fake.requests.clear()
    [path] = hub.pull("org/model", ["model-Q8_0.gguf"], local_dir=local_dir)
    assert path.read_bytes() == data
    [get] = fake.calls("cdn")
    assert get.headers["range"] == f"bytes={kept}-"  # only the rest was fetched
    assert not partial.exists()


# --- verification ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [False, True], ids=["cache", "local-dir"])
def test_a_checksum_mismatch_is_an_error_and_leaves_no_file(fake, tmp_path, local):
    data = random_bytes(200_000, seed=4)
    fake.add("org/model", {"model-Q8_0.gguf": data})
    fake.corrupt("org/model", "model-Q8_0.gguf")
    root = tmp_path / "models" if local else tmp_path / "hf" / "hub"
    with pytest.raises(HubError) as err:
        hub.pull("org/model", ["model-Q8_0.gguf"], local_dir=root if local else None)
    message = str(err.value)
    assert message.startswith("downloaded model-Q8_0.gguf is corrupt: sha256 is ")
    assert f"the hub says {sha256(data)}" in message and "removed it" in message and "\n" not in message
    assert leftovers(root) in ([], ["main"])  # nothing but (for the cache) the ref to the commit


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupt"])
def test_xet_files_go_through_hf_xet_and_are_verified(fake, tmp_path, monkeypatch, corrupt):
    """A Xet-backed file is left to the library's hf_xet transfer (stood in for here: the fake hub speaks no
    Xet), then checked like any other; a corrupt one is removed with its blob and shared-store entry."""
    data = random_bytes(50_000, seed=7)
    fake.add("org/xet", {"m-Q8_0.gguf": data}, xet=True)
    if corrupt:
        fake.corrupt("org/xet", "m-Q8_0.gguf")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    transfers = []

    def xet_get(*, incomplete_path, xet_file_data, headers, expected_size=None, **kwargs):
        transfers.append(xet_file_data.file_hash)
        incomplete_path.write_bytes(fake.blobs[sha256(data)])

    monkeypatch.setattr(file_download, "xet_get", xet_get)
    root = tmp_path / "hf" / "hub"
    if corrupt:
        with pytest.raises(HubError, match=r"^downloaded m-Q8_0.gguf is corrupt: sha256 is \w+, the hub says"):
            hub.pull("org/xet:Q8_0")
        assert [p for p in root.rglob("*") if p.is_symlink() or p.stat().st_size == len(data)] == []
    else:
        [path] = hub.pull("org/xet:Q8_0")
        assert path.read_bytes() == data
    assert transfers == [xet_hash(data)] and fake.calls("cdn") == []


# --- split models ---------------------------------------------------------------------------------------


@pytest.fixture
def split_repo(fake, tmp_path):
    """org/split: a three-part Q8_0 model in a folder, as unsloth lays big quants out, plus a Q4_0 file."""
    rng = np.random.default_rng(5)
    tensors = [(f"t{i}", rng.standard_normal((2, 32)), T.Q8_0) for i in range(5)]
    src = tmp_path / "src"
    src.mkdir()
    write_gguf(src / "m-Q8_0.gguf", "llama", {"llama.block_count": 1}, tensors, split_max_tensors=2)
    parts = sorted(src.glob("m-Q8_0-*-of-*.gguf"))
    assert len(parts) == 3
    files = {f"Q8_0/{p.name}": p.read_bytes() for p in parts}
    files["m-Q4_0.gguf"] = random_bytes(1000)
    fake.add("org/split", files)
    return [f"Q8_0/{p.name}" for p in parts], [name for name, *_ in tensors]


def test_a_split_model_named_by_any_part_comes_whole(fake, tmp_path, split_repo):
    parts, tensor_names = split_repo
    [path] = hub.pull("org/split", [parts[1]])
    assert path == snapshot_dir(fake, tmp_path, "org/split") / parts[0]  # reported by its first part
    g = open_gguf(path)
    assert list(g.tensors) == tensor_names
    assert g.file_size == sum(len(fake.repos["org/split"].files[p]) for p in parts)
    assert len(fake.calls("cdn")) == 3


def test_a_split_model_picked_by_quant(fake, tmp_path, split_repo):
    parts, tensor_names = split_repo
    [path] = hub.pull("org/split:q8_0", local_dir=tmp_path / "models")
    assert path == tmp_path / "models" / parts[0]
    assert list(open_gguf(path).tensors) == tensor_names


# --- choosing by quant ----------------------------------------------------------------------------------

REPO_FILES = [
    "README.md",
    "mmproj-m-F16.gguf",
    "m-Q4_K_M.gguf",
    "m-Q4_K_S.gguf",
    "m-UD-Q4_K_XL.gguf",
    "m-Q8_0.gguf",
    "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
    "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf",
    "BF16/m-BF16-00001-of-00002.gguf",
    "BF16/m-BF16-00002-of-00002.gguf",
]


@pytest.mark.parametrize(
    ("quant", "picked"),
    [
        ("Q4_K_M", ["m-Q4_K_M.gguf"]),  # the single file, not the split copy
        ("q4_k_m", ["m-Q4_K_M.gguf"]),  # case-insensitive
        (None, ["m-Q4_K_M.gguf"]),  # llama-server's default
        ("UD-Q4_K_XL", ["m-UD-Q4_K_XL.gguf"]),
        ("Q4_K_XL", ["m-UD-Q4_K_XL.gguf"]),
        ("bf16", ["BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf"]),
        ("Q8_0", ["m-Q8_0.gguf"]),
    ],
)
def test_select_model_by_quant(quant, picked):
    assert select_model(REPO_FILES, quant) == picked


def test_select_model_errors_list_the_quants():
    with pytest.raises(HubError) as err:
        select_model(REPO_FILES, "Q5_K_M", "org/m")
    assert str(err.value) == "no GGUF file in org/m matches 'Q5_K_M'; available: BF16, Q4_K_M, Q4_K_S, Q8_0, UD-Q4_K_XL"
    with pytest.raises(HubError, match=r"org/m has 2 GGUF models and none is Q4_K_M: .* available: Q6_K, Q8_0"):
        select_model(["m-Q8_0.gguf", "m-Q6_K.gguf"], None, "org/m")
    assert select_model(["README.md", "m-Q8_0.gguf", "mmproj-F16.gguf"], None) == ["m-Q8_0.gguf"]  # the only model
    with pytest.raises(HubError, match="org/m has no GGUF model files"):
        select_model(["README.md"], None, "org/m")


def test_the_command_pulls_by_quant_and_prints_the_path(fake, tmp_path, capsys):
    fake.add("org/model", {"m-Q8_0.gguf": random_bytes(5000), "m-Q4_K_M.gguf": random_bytes(4000, seed=1)})
    assert main(["pull", "org/model:q8_0", "--local-dir", str(tmp_path / "models")]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "models" / "m-Q8_0.gguf")]
    assert main(["pull", "org/model:Q5_K_M"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "mtpserve pull: error: no GGUF file in org/model matches 'Q5_K_M'; available: Q4_K_M, Q8_0"


# --- errors ---------------------------------------------------------------------------------------------


def test_missing_repo_revision_and_file(fake):
    fake.add("org/model", {"m-Q8_0.gguf": random_bytes(100)})
    with pytest.raises(HubError, match=r"^repository org/nope not found on http://127.0.0.1:\d+; if it is private"):
        hub.pull("org/nope")
    with pytest.raises(HubError, match=r"^revision 'v9' not found in org/model$"):
        hub.pull("org/model", revision="v9")
    with pytest.raises(HubError, match=r"^org/model has no file 'm-Q4.gguf'; its GGUF files: m-Q8_0.gguf$"):
        hub.pull("org/model", ["m-Q4.gguf"])


def test_a_private_repo_needs_a_token_which_stays_on_the_hub(fake):
    data = random_bytes(5000)
    fake.add("org/private", {"m-Q8_0.gguf": data}, token="hf_secret")
    with pytest.raises(HubError, match=r"a token is needed \(--token, HF_TOKEN or `hf auth login`\)"):
        hub.pull("org/private")
    with pytest.raises(HubError, match=r"refused the token"):
        hub.pull("org/private", token="hf_wrong")
    fake.requests.clear()
    [path] = hub.pull("org/private", token="hf_secret")
    assert path.read_bytes() == data
    assert {r.headers.get("authorization") for r in fake.requests if r.server == "hub"} == {"Bearer hf_secret"}
    assert [r.headers.get("authorization") for r in fake.calls("cdn")] == [None]


# --- offline ----------------------------------------------------------------------------------------------


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_hub_gives_one_line(fake):
    url = closed_port_url()
    with pytest.raises(HubError) as err:
        hub.pull("org/model:Q8_0", endpoint=url)
    message = str(err.value)
    assert message.startswith(f"cannot reach the Hugging Face Hub at {url} (")
    assert message.endswith("and org/model:Q8_0 is not in the cache " + constants.HF_HUB_CACHE)
    assert "\n" not in message


def test_offline_mode_uses_the_cache_or_says_it_is_offline(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["pull", "org/model:Q8_0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "mtpserve pull: error: offline mode is on (HF_HUB_OFFLINE=1), "
        f"and org/model:Q8_0 is not in the cache {constants.HF_HUB_CACHE}"
    )

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fake.add("org/model", {"m-Q8_0.gguf": random_bytes(5000)})
    [cached] = hub.pull("org/model:Q8_0")
    [local] = hub.pull("org/model:Q8_0", local_dir=tmp_path / "models")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake.requests.clear()
    assert hub.pull("org/model:Q8_0") == [cached]
    assert hub.pull("org/model", ["m-Q8_0.gguf"], local_dir=tmp_path / "models") == [local]
    assert fake.requests == []


def test_offline_from_the_environment_in_a_fresh_process(tmp_path):
    """HF_HUB_OFFLINE=1 as a user sets it: read by huggingface_hub at import, reported in one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    command = [sys.executable, "-m", "mtpserve", "pull", "org/model:Q8_0"]
    proc = subprocess.run(command, check=False, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == (
        "mtpserve pull: error: offline mode is on (HF_HUB_OFFLINE=1), "
        f"and org/model:Q8_0 is not in the cache {tmp_path / 'hf' / 'hub'}"
    )


def test_serve_hf_pulls_then_serves(fake, tmp_path):
    """`mtpserve serve -hf REPO:QUANT`, as llama-server's -hf: the file comes from the (fake) hub."""
    from .conftest import tinyqwen_path
    from .support.server_process import ServerProcess

    fake.add("org/tiny", {"tiny-Q4_K_M.gguf": tinyqwen_path("Q4_K_M").read_bytes(), "tiny-Q8_0.gguf": random_bytes(64)})
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": fake.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    server = ServerProcess(["-hf", "org/tiny:Q4_K_M"], tmp_path / "server.log", env=env)
    try:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny-Q4_K_M.gguf"
        assert "pulling 'org/tiny:Q4_K_M' from Hugging Face" in server.log()
    finally:
        server.stop()
