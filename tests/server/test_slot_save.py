"""Slot save / restore / erase over HTTP (llama-server's `POST /slots/{id}?action=...`): the answers' fields, a
restored slot reused as prompt cache with the same greedy text, names that try to leave --slot-save-path (400),
a busy slot's action deferred until its request ends, and llama-server's 501 without --slot-save-path."""

from __future__ import annotations

import copy
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mtpserve.engine import slot_files

from ..conftest import default_model, tinyqwen_path
from ..support.server_process import ServerProcess
from .conftest import TINY_KEY

PROMPT = "Once upon a time, in a city by the sea, there lived an old sailor who told stories to the children."


@pytest.fixture(scope="module")
def saving(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slots")
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "-np", "2", "-c", "4096", "-t", "2", "--slot-save-path", str(directory)]
    process = ServerProcess([*args, "--spec-type", "draft-mtp"], tmp_path_factory.mktemp("server") / "server.log")
    with httpx.Client(base_url=process.url, timeout=60) as client:
        client.server_pid = process.proc.pid  # type: ignore[attr-defined]
        yield client, directory
    process.stop()


def _complete(client: httpx.Client, id_slot: int, n_predict: int = 8, prompt: str = PROMPT) -> dict:
    body = {"prompt": prompt, "id_slot": id_slot, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}
    response = client.post("/completion", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _action(client: httpx.Client, id_slot: int | str, action: str, filename: object = None) -> httpx.Response:
    body = None if filename is None else {"filename": filename}
    return client.post(f"/slots/{id_slot}", params={"action": action}, json=body)


def _processing(client: httpx.Client, id_slot: int) -> bool:
    return next(s["is_processing"] for s in client.get("/slots").json() if s["id"] == id_slot)


def _cached(client: httpx.Client, id_slot: int) -> int:
    return next(s["n_cached_tokens"] for s in client.get("/slots").json() if s["id"] == id_slot)


def test_save_erase_restore_and_reuse(saving):
    client, directory = saving
    first = _complete(client, 1)
    saved = _action(client, 1, "save", "story.bin").json()
    assert saved["id_slot"] == 1 and saved["filename"] == "story.bin"
    assert saved["n_saved"] == _cached(client, 1) > first["tokens_evaluated"]
    assert saved["n_written"] == (directory / "story.bin").stat().st_size and saved["timings"]["save_ms"] > 0

    assert _action(client, 1, "erase").json() == {"id_slot": 1, "n_erased": saved["n_saved"]}
    assert _cached(client, 1) == 0

    restored = _action(client, 0, "restore", "story.bin").json()  # into the other slot
    assert restored["id_slot"] == 0 and restored["filename"] == "story.bin"
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
    assert restored["timings"]["restore_ms"] > 0
    again = _complete(client, 0)
    assert again["content"] == first["content"]
    # the same prompt again: its recurrent state comes from the restored checkpoint 4 tokens before its end
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 4


@pytest.mark.parametrize("name", ["../x.bin", "/etc/passwd", "a/b", "..", "a\0b", "", 42])
def test_names_that_leave_the_directory_are_refused(saving, name):
    client, directory = saving
    for action in ("save", "restore"):
        response = _action(client, 0, action, name)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and ("filename" in error["message"])
    assert not (directory.parent / "x.bin").exists()


def test_a_symlink_out_of_the_directory_is_not_followed(saving, tmp_path):
    client, directory = saving
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    os.symlink(outside, directory / "escape.bin")
    for action in ("save", "restore"):
        response = _action(client, 0, action, "escape.bin")
        assert response.status_code == 400 and "symbolic link" in response.json()["error"]["message"]
    assert outside.read_bytes() == b"not yours"


def test_a_directory_is_a_400_and_costs_no_file_descriptor(saving):
    """Saving over, or restoring from, a name that is a directory (these were 500s, and each restore leaked a
    descriptor)."""
    client, directory = saving
    (directory / "adir").mkdir()
    descriptors = len(os.listdir(f"/proc/{client.server_pid}/fd"))
    for _ in range(5):
        for action in ("save", "restore"):
            response = _action(client, 0, action, "adir")
            assert response.status_code == 400 and "not a regular file" in response.json()["error"]["message"]
    assert len(os.listdir(f"/proc/{client.server_pid}/fd")) == descriptors


def test_forged_slot_files_are_400s_and_the_slot_still_restores(saving):
    """A file with the right fingerprint and checksum but a forged header: absurd shapes (2**62 rows: no
    allocation, no wrap-around), entries that are not tensors, layout fields of the wrong type."""
    client, directory = saving
    assert client.post("/completion", json={"prompt": "a b c d e f g", "n_predict": 2, "id_slot": 0}).status_code == 200
    assert _action(client, 0, "save", "genuine.bin").status_code == 200
    raw = (directory / "genuine.bin").read_bytes()
    magic, version, n = slot_files._PREFIX.unpack(raw[: slot_files._PREFIX.size])
    header = json.loads(raw[slot_files._PREFIX.size : slot_files._PREFIX.size + n])
    data = raw[slot_files._PREFIX.size + n : -slot_files._CRC.size]

    def forged(change) -> str:
        h = copy.deepcopy(header)
        change(h)
        encoded = json.dumps(h).encode()
        crc = zlib.crc32(data, zlib.crc32(encoded))
        (directory / "forged.bin").write_bytes(
            slot_files._PREFIX.pack(magic, version, len(encoded)) + encoded + data + slot_files._CRC.pack(crc)
        )
        return "forged.bin"

    changes = [
        lambda h: h["tensors"][0].update(shape=[2**62, 2**3]),
        lambda h: h["tensors"].__setitem__(0, "x"),
        lambda h: h.update(tensors={"a": 1}),
        lambda h: h["tensors"][0].update(name=5),
        lambda h: h.update(n_past="many"),
        lambda h: h.update(kv=None),
        lambda h: h.update(checkpoints=-5),
    ]
    for change in changes:
        response = _action(client, 1, "restore", forged(change))
        assert response.status_code == 400 and "Unable to restore slot" in response.json()["error"]["message"]
    assert _action(client, 1, "restore", "genuine.bin").status_code == 200


def test_bad_requests(saving):
    client, _ = saving
    cases = [
        (_action(client, 0, "load", "x.bin"), "Invalid action"),
        (_action(client, "one", "erase"), "Invalid slot ID"),
        (_action(client, 7, "erase"), "Invalid slot ID"),
        (_action(client, 0, "restore", "absent.bin"), "no file 'absent.bin'"),
        (client.post("/slots/0", params={"action": "save"}, json={}), "'filename' is required"),
    ]
    for response, message in cases:
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_busy_slots_action_waits_for_its_request(saving):
    """The save is sent once slot 1 streams (its first piece read), while 512 tokens are still to come: deferred, it
    saves what the request left, not what the slot held when the save came. (Polling /slots for is_processing once
    missed a 32-token request that ended between two polls.)"""
    client, _ = saving
    body = {"prompt": PROMPT, "id_slot": 1, "n_predict": 512, "ignore_eos": True, "temperature": 0, "stream": True}
    with client.stream("POST", "/completion", json=body) as response, ThreadPoolExecutor(1) as pool:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines)  # slot 1 is generating
        save = pool.submit(_action, client, 1, "save", "busy.bin")  # deferred, as llama-server defers it
        final = [json.loads(line.removeprefix("data: ")) for line in lines][-1]
        saved = save.result().json()
    assert final["stop"] and final["tokens_predicted"] == 512
    assert saved["n_saved"] == final["tokens_evaluated"] + final["tokens_predicted"] - 1


def test_actions_waiting_on_a_busy_slot_hold_no_request_thread(tmp_path):
    """45 saves queued on busy slot 0 (each waits for its request to end) leave the server's request threads
    free: a chat on slot 1 answers while slot 0 still generates. They once took the 40 threads the server shares,
    and the chat waited for slot 0 (issue 36, finding 2). Slot 0 generates 30,000 tokens (seconds at the least),
    until the test leaves its stream."""
    directory = tmp_path / "slots"
    directory.mkdir()
    args = [
        "-m",
        str(tinyqwen_path("Q4_K_M")),
        "-np",
        "2",
        "-c",
        "65536",
        "-t",
        "2",
        "--slot-save-path",
        str(directory),
    ]
    process = ServerProcess(args, tmp_path / "server.log")
    limits = httpx.Limits(max_connections=64)
    try:
        with httpx.Client(base_url=process.url, timeout=120, limits=limits) as client, ThreadPoolExecutor(48) as pool:
            body = {"prompt": "x", "n_predict": 30000, "ignore_eos": True, "id_slot": 0, "stream": True}
            with client.stream("POST", "/completion", json=body) as busy:
                lines = busy.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the request
                next(lines)  # slot 0 is generating
                saves = [pool.submit(_action, client, 0, "save", f"waiting{i}.bin") for i in range(45)]
                time.sleep(1.0)  # the saves reach the server (were they slower, the test could only pass wrongly)
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "id_slot": 1}
                answer = client.post("/v1/chat/completions", json=chat)
                assert answer.status_code == 200 and _processing(client, 0)
                lines.close()
            assert all(f.result().status_code == 200 for f in saves)  # leaving the stream freed slot 0
    finally:
        process.stop()


def test_without_slot_save_path_the_actions_are_not_supported(tiny_server):
    headers = {"Authorization": f"Bearer {TINY_KEY}"}
    for action in ("save", "restore", "erase"):
        response = httpx.post(
            f"{tiny_server.url}/slots/0", params={"action": action}, json={"filename": "x.bin"}, headers=headers
        )
        assert response.status_code == 501
        assert response.json()["error"] == {
            "code": 501,
            "message": "This server does not support slots action. Start it with `--slot-save-path`",
            "type": "not_supported_error",
        }


# three server processes, ~22 s: `make test-all`; tests/engine/test_slot_files.py restores into a new engine
@pytest.mark.slow
def test_a_slot_saved_before_a_restart_continues_after_it_and_another_models_file_is_refused(tmp_path):
    """The acceptance run over HTTP: a ~1,000-token conversation on tinyqwen35 saved, the server stopped, a new
    server process restores the slot and the next turn gives the uninterrupted run's greedy tokens from the
    cache; a slot file saved by SmolLM2 is refused by tinyqwen35 with a message."""
    directory = tmp_path / "slots"
    directory.mkdir()
    tiny = ["-m", str(tinyqwen_path("Q4_K_M")), "-np", "1", "-c", "4096", "-t", "2", "--slot-save-path", str(directory)]
    first = list(range(300, 1300))  # 1,000 prompt tokens

    def complete(client: httpx.Client, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        response = client.post("/completion", json=body | {"id_slot": 0})
        assert response.status_code == 200, response.text
        return response.json()

    before = ServerProcess(tiny, tmp_path / "before.log")
    try:
        with httpx.Client(base_url=before.url, timeout=120) as client:
            turn1 = complete(client, first)
            assert _action(client, 0, "save", "talk.bin").json()["n_saved"] >= 1000
            second = [*first, *turn1["tokens"], 500, 501, 502]
            uninterrupted = complete(client, second)
    finally:
        before.stop()

    smol = ServerProcess(
        ["-m", str(default_model("smollm2")), "-np", "1", "-t", "2", "--slot-save-path", str(directory)],
        tmp_path / "smol.log",
    )
    try:
        with httpx.Client(base_url=smol.url, timeout=60) as client:
            complete(client, list(range(10, 40)))
            assert _action(client, 0, "save", "smol.bin").status_code == 200
    finally:
        smol.stop()

    after = ServerProcess(tiny, tmp_path / "after.log")
    try:
        with httpx.Client(base_url=after.url, timeout=120) as client:
            assert _action(client, 0, "restore", "talk.bin").json()["n_restored"] >= 1000
            resumed = complete(client, second)
            refused = _action(client, 0, "restore", "smol.bin")
    finally:
        after.stop()
    assert resumed["tokens"] == uninterrupted["tokens"]
    assert resumed["timings"]["cache_n"] == uninterrupted["timings"]["cache_n"] >= 1000
    assert refused.status_code == 400 and "another model" in refused.json()["error"]["message"]
