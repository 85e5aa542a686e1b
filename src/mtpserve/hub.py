"""Models from the Hugging Face Hub: `mtpserve pull REPO[:QUANT] [FILE ...]` and `serve -hf REPO:QUANT`.

Built on `huggingface_hub` (endpoint from `HF_ENDPOINT` or `endpoint=`, token from `--token`, `HF_TOKEN` or
`hf auth login`, cache under `HF_HOME`/`HF_HUB_CACHE`, `HF_HUB_OFFLINE`), so pulled files land in the same
cache as every other Hugging Face tool. Decisions:

* **What to fetch.** `REPO:QUANT` picks the `.gguf` whose path holds QUANT (case-insensitive) between
  `-`, `.` or `/` (so `Q4_K` does not pick `Q4_K_M`; plain substring only when nothing matches that way),
  skipping `mmproj` projector files, preferring a single file over a split set, then the shortest path.
  No quant and no FILE: `Q4_K_M` as llama-server does, else the repo's only model; with several models and
  no Q4_K_M it is an error listing the quants rather than a surprise 50 GB BF16. FILE names are exact repo
  paths, any file type. A split GGUF (`name-00001-of-00003.gguf`, named by any part or picked by quant)
  brings all its parts into one folder and is reported by its first part, which `mtpserve.gguf.open_gguf`
  opens as one model. One listing call (`model_info(files_metadata=True)`) pins the commit for all files.
* **How.** Files in Xet storage are downloaded by the library through `hf_xet` (parallel; it reads
  `HF_XET_HIGH_PERFORMANCE` itself). All others (and all files with `HF_HUB_DISABLE_XET=1`) are streamed by
  `huggingface_hub.file_download.http_get` into a partial file with a stable name, `blobs/<etag>.incomplete`
  in the cache (`.cache/huggingface/download/<file>.<etag>.incomplete` under `--local-dir`), under the same
  lock file the library takes. `huggingface_hub` 2.x resumes only inside one call (a dropped connection is
  retried with a `Range` request, 5 times) and deletes its partial file when the call fails; our partial file
  survives a failed or killed run, and the next pull continues it with a `Range` request. A Xet transfer
  interrupted by a killed process starts again (hf_xet retries network failures itself, within the run).
* **Verification.** Every file downloaded in this run is checked against the hub's listing: size, and
  sha256 for LFS files (the git blob sha1 for small files). A mismatch removes the file (and its cache
  blob and snapshot link) and fails with one line, so the next pull fetches it again. Files already
  present are checked by size only (a cache blob is named by its sha256, re-hashing 17 GB every pull is
  not worth it). A verified HTTP download is moved into the cache as the blob, then `hf_hub_download`
  makes the snapshot link (`snapshots/<commit>/<file>`) as it does for its own downloads.
* **No network.** When the hub cannot be reached (nothing listening, DNS, timeout, 5xx) or
  `HF_HUB_OFFLINE=1`, the same selection runs over the copy already in the cache (or `--local-dir`), with a
  warning; when that copy is missing too, one line says why. Missing repo, revision or file, gated repos and
  missing or rejected tokens each give one line too. All such failures are `HubError` (a ValueError, which
  the command line prints as one line with exit status 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx2
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers, tqdm

log = logging.getLogger("mtpserve.hub")

DEFAULT_QUANT = "Q4_K_M"
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_QUANT_LABEL = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|FP?\d+))(?=[-.]|$)",
    re.IGNORECASE,
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HASH_BLOCK = 8 << 20


class HubError(ValueError):
    """A pull that cannot be done, said in one line (a ValueError so the command line prints it as such)."""


@dataclass(frozen=True)
class RemoteFile:
    """A file of the repo at the pinned commit, as the hub lists it."""

    path: str
    size: int | None
    sha256: str | None  # LFS files
    git_sha1: str | None  # small files kept in git: the blob id


@dataclass(frozen=True)
class _Target:
    """Where a pull writes: the hub cache, or a plain folder (`--local-dir`)."""

    cache_dir: Path | None
    local_dir: Path | None

    def describe(self) -> str:
        return f"--local-dir {self.local_dir}" if self.local_dir else f"the cache {self.cache_dir}"


# --- choosing files -------------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`org/name[:QUANT]` -> (repo id, quant or None)."""
    repo, sep, quant = spec.partition(":")
    if not repo or (sep and not quant):
        raise HubError(f"bad model reference {spec!r}: expected REPO or REPO:QUANT, e.g. unsloth/Qwen3-8B-GGUF:Q4_K_M")
    return repo, quant or None


def split_parts(path: str) -> list[str]:
    """All parts of the split GGUF that `path` belongs to (any part), or `[path]` for a single file."""
    m = SPLIT_NAME.match(path)
    if not m or int(m["count"]) < 1:
        return [path]
    count = int(m["count"])
    return [f"{m['prefix']}-{no:05d}-of-{count:05d}.gguf" for no in range(1, count + 1)]


def quant_label(path: str) -> str:
    """The quantization named in a GGUF file name (`UD-Q4_K_XL`, `Q8_0`, `BF16`), or the file name itself."""
    name = posixpath.basename(path)
    m = SPLIT_NAME.match(name)
    stem = m["prefix"] if m else name.removesuffix(".gguf")
    labels = _QUANT_LABEL.findall(stem)
    return labels[-1].upper() if labels else name


def _models(paths: Iterable[str]) -> dict[str, list[str]]:
    """The GGUF models among `paths`, each keyed by its first (or only) file, projector files left out."""
    models: dict[str, list[str]] = {}
    for path in sorted(paths):
        if path.lower().endswith(".gguf") and "mmproj" not in posixpath.basename(path).lower():
            parts = split_parts(path)
            models.setdefault(parts[0], parts)
    return models


def _available(models: Iterable[str]) -> str:
    labels = sorted({quant_label(m) for m in models})
    return ", ".join(labels) if labels else "none"


def select_model(paths: Iterable[str], quant: str | None, repo: str = "the repo") -> list[str]:
    """The files of the one GGUF model `quant` names among a repo's `paths` (see the module docstring)."""
    models = _models(paths)
    if not models:
        raise HubError(f"{repo} has no GGUF model files")
    wanted = quant or DEFAULT_QUANT
    bounded = re.compile(rf"(?:^|[-./]){re.escape(wanted)}(?:[-./]|$)", re.IGNORECASE)
    hits = [m for m in models if bounded.search(m)]
    if not hits and quant:
        hits = [m for m in models if quant.lower() in m.lower()]
    if not hits and not quant and len(models) == 1:
        hits = list(models)
    if not hits:
        if quant:
            raise HubError(f"no GGUF file in {repo} matches {quant!r}; available: {_available(models)}")
        raise HubError(
            f"{repo} has {len(models)} GGUF models and none is {DEFAULT_QUANT}: "
            f"name one as {repo}:QUANT, available: {_available(models)}"
        )
    hits.sort(key=lambda m: (len(models[m]) > 1, len(m), m))
    if len(hits) > 1:
        log.info("%s:%s matches %s; taking %s", repo, wanted, ", ".join(hits), hits[0])
    return models[hits[0]]


def _requested(paths: Sequence[str], quant: str | None, files: Sequence[str], repo: str) -> list[list[str]]:
    """The files to fetch, grouped per requested item (a split model is one group, reported by its first part)."""
    if quant and files:
        raise HubError(f"name files or a quant, not both ({repo}:{quant} and {', '.join(files)})")
    if not files:
        return [select_model(paths, quant, repo)]
    present = set(paths)
    groups: list[list[str]] = []
    for name in files:
        name = name.strip("/")
        if name not in present:
            ggufs = sorted(p for p in present if p.lower().endswith(".gguf"))
            shown = ", ".join(ggufs[:12]) + (", ..." if len(ggufs) > 12 else "")
            raise HubError(f"{repo} has no file {name!r}" + (f"; its GGUF files: {shown}" if ggufs else ""))
        group = split_parts(name)
        missing = [p for p in group if p not in present]
        if missing:
            n = len(group)
            raise HubError(f"split model {group[0]}: {len(missing)} of its {n} parts are missing ({missing[0]})")
        if group not in groups:
            groups.append(group)
    return groups


# --- pulling --------------------------------------------------------------------------------------------


def pull(
    spec: str,
    files: Sequence[str] = (),
    *,
    revision: str | None = None,
    local_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> list[Path]:
    """Download `REPO[:QUANT]` (or the named FILEs of REPO); return one local path per model or file asked
    for, a split model by its first part. `endpoint` defaults to `HF_ENDPOINT`, `cache_dir` to the hub cache."""
    repo, quant = parse_spec(spec)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    target = _Target(
        cache_dir=None if local_dir else Path(cache_dir or constants.HF_HUB_CACHE).expanduser(),
        local_dir=Path(local_dir).expanduser().resolve() if local_dir else None,
    )
    try:
        commit, listing = _list_repo(repo, revision, token, endpoint)
    except _Unreachable as e:
        return _pull_from_disk(repo, quant, files, revision, target, reason=str(e))
    groups = _requested(list(listing), quant, files, repo)
    where = f"{repo}@{commit[:8]}"
    paths: list[Path] = []
    try:
        for group in groups:
            local = [_fetch(repo, listing[name], commit, target, token, endpoint, where) for name in group]
            paths.append(local[0])
    except _Unreachable as e:  # lost the hub half-way: no cache fallback, the files asked for are not all there
        raise HubError(f"{e}; run the pull again to continue") from e
    if target.cache_dir is not None:
        _write_ref(target.cache_dir, repo, revision or constants.DEFAULT_REVISION, commit)
    return paths


def pull_model(spec: str, **kwargs) -> Path:
    """The local path of the model `REPO[:QUANT]` names, downloaded if needed (`serve -hf`)."""
    return pull(spec, **kwargs)[0]


def quiet_library_logs() -> None:
    """For command lines that log at INFO: no line per HTTP request from httpx2, and huggingface_hub's
    warnings (it has its own handler) once rather than twice."""
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("huggingface_hub").propagate = False


class _Unreachable(Exception):
    """The hub could not be asked (offline mode, no connection, server error): fall back to what is on disk."""


@contextlib.contextmanager
def _hub_errors(repo: str, endpoint: str, revision: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's and httpx's exceptions into one-line HubErrors (or _Unreachable)."""
    try:
        yield
    except OfflineModeIsEnabled as e:
        raise _Unreachable("offline mode is on (HF_HUB_OFFLINE=1)") from e
    except LocalEntryNotFoundError as e:  # hf_hub_download could not ask the hub about the file
        raise _Unreachable(f"cannot reach the Hugging Face Hub at {endpoint}") from e
    except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.ProxyError, httpx2.NetworkError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _Unreachable(f"cannot reach the Hugging Face Hub at {endpoint} ({reason})") from e
    except GatedRepoError as e:
        raise HubError(
            f"{repo} is gated: accept its conditions at {endpoint}/{repo} and use a token of that account "
            "(--token, HF_TOKEN or `hf auth login`)"
        ) from e
    except RepositoryNotFoundError as e:
        raise HubError(
            f"repository {repo} not found on {endpoint}; if it is private or gated, a token is needed "
            "(--token, HF_TOKEN or `hf auth login`)"
        ) from e
    except RevisionNotFoundError as e:
        raise HubError(f"revision {revision!r} not found in {repo}") from e
    except RemoteEntryNotFoundError as e:
        raise HubError(f"{e.response.url} not found on the hub") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status is not None and status >= 500:
            raise _Unreachable(f"the Hugging Face Hub at {endpoint} answered {status}") from e
        if status == 401:
            raise HubError(
                f"the hub refused the token for {repo} (401): check --token, HF_TOKEN or `hf auth login`"
            ) from e
        if status == 403:
            raise HubError(f"access to {repo} denied (403): the token lacks permission for it") from e
        url = e.response.url if e.response is not None else endpoint
        raise HubError(f"the hub answered {status} for {url}") from e
    except HFValidationError as e:
        raise HubError(f"invalid repository id or revision for {repo!r}: {str(e).splitlines()[0]}") from e


def _list_repo(repo: str, revision: str | None, token, endpoint: str) -> tuple[str, dict[str, RemoteFile]]:
    try:
        with _hub_errors(repo, endpoint, revision):
            api = HfApi(endpoint=endpoint)
            timeout = constants.HF_HUB_ETAG_TIMEOUT  # the library's default here is none: a black hole would hang
            info = api.model_info(repo, revision=revision, files_metadata=True, token=token, timeout=timeout)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise HubError(f"{endpoint} does not answer like a Hugging Face Hub ({e!r}); check HF_ENDPOINT") from e
    if not info.sha:
        raise HubError(f"{endpoint} gave no commit for {repo}; is HF_ENDPOINT a Hugging Face Hub?")
    listing = {}
    for s in info.siblings or []:
        lfs = s.lfs
        listing[s.rfilename] = RemoteFile(
            path=s.rfilename,
            size=lfs.size if lfs else s.size,
            sha256=lfs.sha256 if lfs else None,
            git_sha1=None if lfs else s.blob_id,
        )
    return info.sha, listing


def _fetch(repo: str, rf: RemoteFile, commit: str, target: _Target, token, endpoint: str, where: str) -> Path:
    """One file into the cache or local dir: reuse what is there, else download and verify it."""
    if target.local_dir is not None:
        final = target.local_dir.joinpath(*rf.path.split("/"))
    else:
        storage = target.cache_dir / repo_folder_name(repo_id=repo, repo_type="model")
        final = storage.joinpath("snapshots", commit, *rf.path.split("/"))
    if final.exists():
        if rf.size is None or final.stat().st_size == rf.size:
            return final
        log.warning("%s has %d bytes, the hub says %d: downloading it again", final, final.stat().st_size, rf.size)
        _remove(final)

    def library_download() -> Path:
        places = {"local_dir": target.local_dir, "cache_dir": target.cache_dir}
        return Path(hf_hub_download(repo, rf.path, revision=commit, token=token, endpoint=endpoint, **places))

    url = hf_hub_url(repo, rf.path, revision=commit, endpoint=endpoint)
    with _hub_errors(repo, endpoint):
        head = get_hf_file_metadata(url, token=token, endpoint=endpoint)
        etag = head.etag
        if target.local_dir is not None:
            dest = final
            meta_dir = target.local_dir.joinpath(".cache", "huggingface", "download", *rf.path.split("/")).parent
            partial = meta_dir / f"{posixpath.basename(rf.path)}.{etag}.incomplete"
            lock = meta_dir / f"{posixpath.basename(rf.path)}.lock"
        else:
            dest = storage / "blobs" / etag
            partial = dest.with_name(f"{etag}.incomplete")
            lock = target.cache_dir / ".locks" / storage.name / f"{etag}.lock"
        fresh = not dest.exists()
        size = _human(rf.size)
        xet = head.xet_file_data is not None and _xet_usable()
        if xet:
            if fresh:
                log.info("downloading %s (%s) from %s with hf_xet", rf.path, size, where)
            path = library_download()
        else:
            if fresh:
                log.info("downloading %s (%s) from %s", rf.path, size, where)
                lock.parent.mkdir(parents=True, exist_ok=True)
                with WeakFileLock(lock):
                    if not dest.exists():
                        headers = _download_headers(head.location, token, endpoint)
                        _http_download(head.location, headers, partial, rf)
                        _verify(partial, rf)
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(partial, dest)
            # In the cache, the library links snapshots/<commit>/<file> to the blob (no download: it exists).
            path = dest if target.local_dir is not None else library_download()
    if fresh and xet:  # what hf_xet wrote, checked as our own downloads are
        _verify(path, rf)
    return path


def _download_headers(url: str, token, endpoint: str) -> dict[str, str]:
    headers = build_hf_headers(token=token)
    if urlparse(url).netloc != urlparse(endpoint).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: the token stays on the hub
    return headers


def _http_download(url: str, headers: dict[str, str], partial: Path, rf: RemoteFile) -> None:
    """Stream `url` into `partial`, continuing what an earlier run left there (a `Range` request)."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if rf.size is not None and have > rf.size:
        partial.unlink()
        have = 0
    if rf.size is not None:
        free = shutil.disk_usage(partial.parent).free
        if free < rf.size - have:
            need, free_h = _human(rf.size - have), _human(free)
            raise HubError(f"not enough disk space for {rf.path}: {need} to write, {free_h} free in {partial.parent}")
    if have:
        log.info("resuming %s at %s of %s", rf.path, _human(have), _human(rf.size))
    with open(partial, "r+b" if have else "wb") as f:
        f.seek(have)
        try:
            name = posixpath.basename(rf.path)
            http_get(url, f, resume_size=have, headers=headers, expected_size=rf.size, displayed_filename=name)
        except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
            if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code < 500:
                raise  # 4xx: a real answer, reported by _hub_errors
            f.flush()
            done = f.tell()
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HubError(
                f"download of {rf.path} stopped at {_human(done)} of {_human(rf.size)} ({first}); "
                "run the pull again to resume it"
            ) from e


def _verify(path: Path, rf: RemoteFile) -> None:
    """Check size and checksum against the hub's listing; a mismatch removes the file."""
    size = path.stat().st_size
    problem = None
    if rf.size is not None and size != rf.size:
        problem = f"has {size} bytes, the hub says {rf.size}"
    elif rf.sha256:
        got = _sha256(path, rf.path)
        if got != rf.sha256.lower():
            problem = f"sha256 is {got}, the hub says {rf.sha256}"
    elif rf.git_sha1:
        got = _git_blob_sha1(path)
        if got != rf.git_sha1.lower():
            problem = f"git blob id is {got}, the hub says {rf.git_sha1}"
    if problem:
        _remove(path)
        raise HubError(f"downloaded {rf.path} is corrupt: {problem}; removed it, run the pull again")


def _sha256(path: Path, name: str) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    desc = f"sha256 {posixpath.basename(name)}"
    bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc, disable=None)
    with open(path, "rb") as f, bar:
        while n := f.readinto(buf):
            digest.update(view[:n])
            bar.update(n)
    return digest.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _remove(path: Path) -> None:
    """Remove a file; a cache snapshot link takes what it links to with it (the blob, and the library's
    shared Xet store entry when the blob is itself a link to one)."""
    while path.is_symlink():
        target = path.parent / path.readlink()
        path.unlink()
        path = target
    path.unlink(missing_ok=True)


def _xet_usable() -> bool:
    """As the library decides: hf_xet installed and not disabled with HF_HUB_DISABLE_XET."""
    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


def _write_ref(cache_dir: Path, repo: str, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as the library keeps it, so an offline pull finds this snapshot."""
    if _COMMIT.match(revision):
        return
    ref = cache_dir / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / revision
    if not ref.exists() or ref.read_text() != commit:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)


def _human(n: int | None) -> str:
    if n is None:
        return "? bytes"
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


# --- without the hub ------------------------------------------------------------------------------------


def _pull_from_disk(
    repo: str, quant: str | None, files: Sequence[str], revision: str | None, target: _Target, reason: str
) -> list[Path]:
    """The same selection over the files already on disk, when the hub cannot be asked."""
    if target.local_dir is not None:
        root = target.local_dir
    else:
        storage = target.cache_dir / repo_folder_name(repo_id=repo, repo_type="model")
        rev = revision or constants.DEFAULT_REVISION
        ref = storage / "refs" / rev
        commit = rev if _COMMIT.match(rev) else (ref.read_text().strip() if ref.is_file() else None)
        root = storage / "snapshots" / commit if commit else None
    what = repo + (f":{quant}" if quant else "") + "".join(f" {f}" for f in files)
    present = []
    if root is not None and root.is_dir():
        present = [
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and ".cache" not in p.relative_to(root).parts
        ]
    try:
        groups = _requested(present, quant, files, repo)
    except HubError:
        raise HubError(f"{reason}, and {what} is not in {target.describe()}") from None
    log.warning("%s: using the copy in %s (not checked against the hub)", reason, target.describe())
    return [root.joinpath(*group[0].split("/")) for group in groups]
