"""The web chat page at `/`, driven in a real headless Chromium (Selenium) against a real `mtpserve serve`.

Needs Debian's `chromium` and `chromium-driver` (`make test` installs them); without them the module is skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from ..conftest import default_model, tinyqwen_path
from ..support.server_process import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"{CHROMIUM} or {CHROMEDRIVER} is absent: install Debian's chromium and chromium-driver (`make test` does)",
        allow_module_level=True,
    )

WAIT = 60.0  # seconds for one reply (small max_tokens: normally well under a second)
SCREENSHOT = Path("/tmp/webui.png")
TOKS = r"[\d.]+ tok/s"


# --- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    profile = tempfile.mkdtemp(prefix="mtpserve-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1100,850",
    ):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _server(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]) -> Iterator[ServerProcess]:
    server = ServerProcess(args, tmp_path_factory.mktemp(name) / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model("smollm2")  # skip (or fail under `make test`) when the default model is not in the cache
    yield from _server(tmp_path_factory, "smol", [])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tinyqwen_path("Q4_K_M")
    args = ["-m", str(path), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "-c", "4096"]
    yield from _server(tmp_path_factory, "qwen", args)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model("smollm2")
    yield from _server(tmp_path_factory, "keyed", ["--api-key", "secret"])


# --- helpers ----------------------------------------------------------------------------------------------


def find(drv: WebDriver | WebElement, css: str) -> WebElement:
    return drv.find_element(By.CSS_SELECTOR, css)


def find_all(drv: WebDriver | WebElement, css: str) -> list[WebElement]:
    return drv.find_elements(By.CSS_SELECTOR, css)


def wait(drv: WebDriver, condition, timeout: float = WAIT, what: str = ""):
    return WebDriverWait(drv, timeout, poll_frequency=0.05).until(condition, what)


def open_page(drv: WebDriver, server: ServerProcess) -> str:
    """Load the page and wait for the model name in the header."""
    drv.get(server.url + "/")
    return wait(drv, lambda d: (t := find(d, "#model-name").text) not in ("", "…", "loading…") and t, 30, "model name")


def set_input(drv: WebDriver, css: str, value: str) -> None:
    box = find(drv, css)
    box.clear()
    box.send_keys(value)


def send(drv: WebDriver, text: str) -> None:
    """Type `text` into the prompt and press Enter."""
    prompt = find(drv, "#prompt")
    prompt.clear()
    prompt.send_keys(text, Keys.ENTER)


def replies(drv: WebDriver) -> list[WebElement]:
    return find_all(drv, ".msg.assistant")


def wait_reply(drv: WebDriver, n: int) -> WebElement:
    """Wait until the n-th assistant reply (1-based) finished with its timings line, or fail on a page error."""

    def done(d: WebDriver) -> WebElement | bool:
        error = find(d, "#error")
        if error.is_displayed():
            raise AssertionError(f"the page shows an error: {error.text}")
        msgs = replies(d)
        if len(msgs) >= n and find_all(msgs[n - 1], ".timings"):
            return msgs[n - 1]
        return False

    return wait(drv, done, what=f"reply {n} with its timings")


def server_log_has(server: ServerProcess, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in server.log():
            return True
        time.sleep(0.1)
    return False


# --- tests ------------------------------------------------------------------------------------------------


RECORD_FETCH = """
window.__sent = [];
const fetch0 = window.fetch;
window.fetch = (url, init) => {
  window.__sent.push({url: String(url), headers: (init && init.headers) || {}, body: init && init.body});
  return fetch0(url, init);
};
"""


def sent_bodies(drv: WebDriver) -> list[dict]:
    """The JSON bodies of the chat requests the page made since RECORD_FETCH."""
    sent = drv.execute_script("return window.__sent")
    return [json.loads(s["body"]) for s in sent if s["url"].endswith("/v1/chat/completions")]


def test_chat_streams_a_reply_with_timings(driver: WebDriver, smol: ServerProcess) -> None:
    assert open_page(driver, smol) == default_model("smollm2").name
    assert find(driver, "#temperature").get_attribute("value") == "0.8"
    assert find(driver, "#max-tokens").get_attribute("value") == "512"
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    driver.execute_script(RECORD_FETCH)
    set_input(driver, "#max-tokens", "12")
    set_input(driver, "#temperature", "0")

    send(driver, "Hello! Who are you?")
    reply = wait_reply(driver, 1)
    assert find_all(driver, ".msg.user")[0].text.endswith("Hello! Who are you?")
    content = find(reply, ".content").text
    assert content.strip(), "the assistant reply is empty"
    timings = find(reply, ".timings").text
    assert re.search(rf"prompt: [1-9]\d* tokens, {TOKS}", timings), timings
    assert re.search(rf"generated: [1-9]\d* tokens, {TOKS}", timings), timings
    assert "draft" not in timings  # no speculative decoding on this server
    assert not find_all(reply, "details.reasoning")  # SmolLM2 does not think
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    assert sent_bodies(driver) == [
        {
            "messages": [{"role": "user", "content": "Hello! Who are you?"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": 12,
        }
    ]

    # Shift+Enter is a new line, not a send; the second turn carries the history.
    prompt = find(driver, "#prompt")
    prompt.clear()
    prompt.send_keys("Say it again,")
    ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    prompt.send_keys("but shorter.")
    assert prompt.get_attribute("value") == "Say it again,\nbut shorter."
    assert len(replies(driver)) == 1
    set_input(driver, "#max-tokens", "6")
    prompt.send_keys(Keys.ENTER)
    second = wait_reply(driver, 2)
    assert find(second, ".content").text.strip()
    assert find_all(driver, ".msg.user")[1].get_attribute("textContent").endswith("Say it again,\nbut shorter.")
    assert sent_bodies(driver)[1]["messages"] == [
        {"role": "user", "content": "Hello! Who are you?"},
        {"role": "assistant", "content": find(reply, ".content").get_attribute("textContent")},
        {"role": "user", "content": "Say it again,\nbut shorter."},
    ]

    # Stop aborts the fetch mid-stream and the server cancels the request.
    set_input(driver, "#max-tokens", "1000")
    send(driver, "Write a very long story about a dragon who learns to bake bread.")
    wait(driver, lambda d: len(replies(d)) == 3 and find(replies(d)[2], ".content").text.strip(), what="stream start")
    assert find(driver, "#stop").is_enabled() and not find(driver, "#send").is_enabled()
    find(driver, "#stop").click()
    third = wait(driver, lambda d: (m := replies(d)[2]) and find_all(m, ".note") and m, 10, "stopped note")
    assert "stopped" in find(third, ".note").text
    assert not find_all(third, ".timings")
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    assert server_log_has(smol, "cancel_tasks: cancel task"), smol.log()[-2000:]

    # New chat clears the conversation.
    find(driver, "#new-chat").click()
    assert not find_all(driver, ".msg")
    assert find(driver, "#empty").is_displayed()


def test_reasoning_and_draft_acceptance(driver: WebDriver, qwen: ServerProcess) -> None:
    assert open_page(driver, qwen) == "tinyqwen35-mtp-Q4_K_M.gguf"
    set_input(driver, "#max-tokens", "40")
    set_input(driver, "#temperature", "0")
    send(driver, "Write a Python function that reverses a list.")
    reply = wait_reply(driver, 1)

    details = find(reply, "details.reasoning")
    assert details.get_attribute("textContent").strip() != "Reasoning"
    assert find(details, ".reasoning-text").get_attribute("textContent").strip(), "the reasoning block is empty"
    assert find(details, "summary").text == "Reasoning"
    assert details.get_attribute("open") is None, "the reasoning block stays open after the reply"

    timings = find(reply, ".timings").text
    assert re.search(rf"generated: [1-9]\d* tokens, {TOKS}", timings), timings
    m = re.search(r"draft accepted: (\d+)/(\d+) \((\d+\.\d)%\)", timings)
    assert m, timings
    accepted, drafted, pct = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert pct == pytest.approx(100 * accepted / drafted, abs=0.06)

    # The picture: reasoning opened, answer, timings.
    find(details, "summary").click()
    assert details.get_attribute("open") is not None
    driver.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 0


def test_api_key(driver: WebDriver, keyed: ServerProcess) -> None:
    open_page(driver, keyed)  # /v1/models is public: the name shows without a key
    assert find(driver, "#api-key").get_attribute("value") == ""
    set_input(driver, "#max-tokens", "8")

    send(driver, "Hi there")
    error = wait(driver, lambda d: (e := find(d, "#error")).is_displayed() and e, 30, "auth error")
    assert "Invalid API Key" in error.text and "API key" in error.text.replace("Invalid API Key", ""), error.text
    assert not find_all(driver, ".msg")  # the failed turn is dropped ...
    assert find(driver, "#prompt").get_attribute("value") == "Hi there"  # ... and its text put back to retry

    set_input(driver, "#api-key", "secret")
    send(driver, "Hi there")
    reply = wait_reply(driver, 1)
    assert find(reply, ".content").text.strip()
    assert not find(driver, "#error").is_displayed()

    # The key is remembered across reloads (localStorage).
    open_page(driver, keyed)
    assert find(driver, "#api-key").get_attribute("value") == "secret"


# A fake `fetch` for the chat endpoint: it answers with `status` and these SSE bytes, cut into awkward pieces.
SCRIPTED_FETCH = """
const [status, text] = arguments;
const fetch0 = window.__fetch0 || (window.__fetch0 = window.fetch);
window.fetch = (url, init) => {
  if (!String(url).endsWith("/v1/chat/completions")) return fetch0(url, init);
  const bytes = new TextEncoder().encode(text);
  const stream = new ReadableStream({
    start(controller) {
      for (let i = 0; i < bytes.length; i += 7) controller.enqueue(bytes.slice(i, i + 7));
      controller.close();
    },
  });
  const type = status === 200 ? "text/event-stream" : "application/json";
  return Promise.resolve(new Response(stream, {status, headers: {"Content-Type": type}}));
};
"""


def sse(*events: dict | str) -> str:
    return "".join(e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n" for e in events)


def delta(**d: object) -> dict:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": d}], "object": "chat.completion.chunk"}


def test_stream_parsing_and_errors(driver: WebDriver, smol: ServerProcess) -> None:
    """The page's SSE reader on scripted streams: keep-alives, CRLF, tool calls, safe text, error events."""
    open_page(driver, smol)
    markup = "<b>bold</b><img src=x onerror=\"document.title='pwned'\">"
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}
    timings = {
        "prompt_n": 5,
        "prompt_per_second": 100.0,
        "predicted_n": 4,
        "predicted_per_second": 50.0,
        "draft_n": 3,
        "draft_n_accepted": 2,
    }
    stream = sse(
        ": keep-alive\n\n",
        delta(role="assistant", content=None),
        delta(reasoning_content="Let me "),
        delta(reasoning_content="think."),
        "data: " + json.dumps(delta(content=markup)) + "\r\n\r\n",
        delta(tool_calls=[call]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
        {"choices": [], "usage": {"completion_tokens": 4}, "timings": timings},
        "data: [DONE]\n\n",
    )
    driver.execute_script(SCRIPTED_FETCH, 200, stream)
    send(driver, "scripted")
    reply = wait_reply(driver, 1)
    assert find(reply, ".content").text == markup  # shown as text ...
    assert not find_all(reply, ".content b, .content img")  # ... never as markup
    assert driver.title != "pwned"
    assert find(reply, "details.reasoning .reasoning-text").get_attribute("textContent") == "Let me think."
    tool = find(reply, ".tool-call")
    assert find(tool, ".name").text == "get_weather"
    assert find(tool, ".arguments").text == '{"city": "Paris"}'
    assert find(reply, ".timings").text == (
        "prompt: 5 tokens, 100.0 tok/s · generated: 4 tokens, 50.0 tok/s · draft accepted: 2/3 (66.7%)"
    )

    # An error event after some output: the partial reply stays, the error shows.
    driver.execute_script(
        SCRIPTED_FETCH,
        200,
        sse(delta(content="partial"), {"error": {"code": 500, "message": "engine fell over", "type": "server_error"}}),
    )
    send(driver, "second")
    wait(driver, lambda d: find(d, "#error").is_displayed(), 10, "stream error")
    assert "engine fell over" in find(driver, "#error").text
    assert find(replies(driver)[1], ".content").text == "partial"
    assert "engine fell over" in find(replies(driver)[1], ".note").text

    # A non-200 answer: its JSON error.message shows; the turn is dropped and its text put back.
    body = {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "x"}}
    driver.execute_script(SCRIPTED_FETCH, 400, json.dumps(body))
    send(driver, "third")
    wait(driver, lambda d: "exceeds the available context size" in find(d, "#error").text, 10, "HTTP error")
    assert "HTTP 400" in find(driver, "#error").text
    assert len(replies(driver)) == 2
    assert find(driver, "#prompt").get_attribute("value") == "third"
    driver.refresh()  # drop the fake fetch
