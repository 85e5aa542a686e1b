"""The web chat page at `/`, driven in a real headless Chromium (Selenium) against a real `mtpserve serve`.

Needs Debian's `chromium` and `chromium-driver` (`make test` installs them); without them the module is skipped.
The real models cannot be made to write hostile markup, so the sanitizer is tested by feeding text to the page's
own render function (`window.mtpRender`, the code a reply goes through); the rest goes through real replies.
`MTPSERVE_WEBUI_SCREENSHOT=docs/webui.png` makes test_reasoning_thinking_switch_and_draft_acceptance save the
picture of docs/serving.md.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
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

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "src/mtpserve/server/static"
WAIT = 60.0  # seconds for one reply (small max_tokens: normally a second or two)
TOKS = r"[\d.]+ tok/s"
# The page's own files: what index.html loads, each from the server that serves the page.
PAGE_ASSETS = [
    "static/vendor/highlight-github.min.css",
    "static/vendor/highlight-github-dark.min.css",
    "static/chat.css",
    "static/vendor/marked.umd.js",
    "static/vendor/purify.min.js",
    "static/vendor/highlight.min.js",
    "static/chat.js",
]


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
    # a streamed reply's element is replaced by the finished one: a reference may go stale between two looks
    waiter = WebDriverWait(drv, timeout, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,))
    return waiter.until(condition, what)


def open_page(drv: WebDriver, server: ServerProcess, keep: bool = False) -> str:
    """Load the page and wait for the model name in the header; unless `keep`, with this origin's
    localStorage (settings, conversations) emptied first."""
    drv.get(server.url + "/")
    if not keep:
        drv.execute_script("localStorage.clear()")
        drv.refresh()
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


def stored_conversations(drv: WebDriver) -> list[dict]:
    """The conversations the page keeps in localStorage."""
    script = """
    return Object.keys(localStorage).filter(k => k.startsWith("mtpserve.chat."))
        .map(k => JSON.parse(localStorage.getItem(k)));
    """
    return drv.execute_script(script)


def resources(drv: WebDriver) -> list[dict]:
    """What the page loaded (scripts, styles, fetches): the browser's own record."""
    return drv.execute_script(
        "return performance.getEntriesByType('resource').map(e => ({name: e.name, status: e.responseStatus}))"
    )


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


def render(drv: WebDriver, markdown: str, reasoning: str = "") -> WebElement:
    """The page's own rendering of a finished reply, added to the transcript as a reply would be."""
    return drv.execute_script("return window.mtpRender(arguments[0], arguments[1])", markdown, reasoning)


# --- the page and its files -------------------------------------------------------------------------------


def test_page_headers_assets_and_pins(smol: ServerProcess, keyed: ServerProcess) -> None:
    """The CSP on the page, its files served from a fixed list without a key, the vendored files as pinned."""
    page = httpx.get(smol.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = {d.split()[0]: d.split()[1:] for d in page.headers["content-security-policy"].split("; ")}
    assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"] and csp["style-src"] == ["'self'"]
    assert csp["img-src"] == ["'self'", "data:"] and csp["default-src"] == ["'none'"]
    assert csp["object-src"] == csp["base-uri"] == csp["frame-ancestors"] == ["'none'"]
    html = page.text
    # no inline script, style or handler anywhere: every <script> has a src and no body
    assert re.findall(r"<script\b[^>]*>", html) == [
        f'<script src="{a}" defer>' for a in PAGE_ASSETS if a.endswith(".js")
    ]
    assert not re.search(r"<script[^>]*>[^<]", html) and "<style" not in html and " style=" not in html
    assert not re.search(r"\son\w+\s*=", html), "an inline event handler"
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "a file from another origin"

    for server in (smol, keyed):  # the keyed server gives the page its files without a key
        for asset in PAGE_ASSETS:
            r = httpx.get(f"{server.url}/{asset}")
            assert r.status_code == 200, (asset, r.status_code)
            kind = "text/javascript" if asset.endswith(".js") else "text/css"
            assert r.headers["content-type"] == f"{kind}; charset=utf-8"
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.content == (STATIC / asset.removeprefix("static/")).read_bytes()
    # ... and nothing else: another name under /static/ still wants the key
    assert httpx.get(keyed.url + "/props").status_code == httpx.get(keyed.url + "/static/nope.js").status_code == 401

    # Only the files found in the package, by exact name: no traversal, no directory, not the page's source.
    bad = [
        "",
        "vendor",
        "index.html",
        "nope.js",
        "../app.py",
        "%2e%2e/app.py",
        "vendor/..%2f..%2fapp.py",
        "/etc/passwd",
    ]
    for path in ("/static/" + b for b in bad):
        conn = http.client.HTTPConnection("127.0.0.1", smol.port, timeout=10)  # sends the path as written
        conn.request("GET", path)
        assert conn.getresponse().status == 404, path
        conn.close()

    # The vendored files: as tools/vendor_webui.sh pinned them (hashes), each version listed in the docs.
    versions = (STATIC / "vendor/VERSIONS.txt").read_text().splitlines()
    packages = [line.split() for line in versions if line and not line.startswith("#") and len(line.split()) == 3]
    hashes = [line.split() for line in versions if len(line.split()) == 2 and not line.startswith("#")]
    assert [p[0] for p in packages] == ["marked", "dompurify", "@highlightjs/cdn-assets"]
    script = (ROOT / "tools/vendor_webui.sh").read_text()
    docs = (ROOT / "docs/serving.md").read_text()
    for name, version, integrity in packages:
        assert re.search(rf"\({re.escape(name)} {re.escape(version)}\n\s+{re.escape(integrity)}", script), name
        assert re.search(rf"`{re.escape(name)}` \| {re.escape(version)} \|", docs), f"{name} {version} not in the docs"
    vendored = sorted(p.name for p in (STATIC / "vendor").iterdir() if p.name != "VERSIONS.txt")
    assert sorted(name for _, name in hashes) == vendored
    for digest, name in hashes:
        assert hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest() == digest, f"{name} was edited"


# --- real replies -----------------------------------------------------------------------------------------


def test_chat_streams_a_reply_with_timings(driver: WebDriver, smol: ServerProcess) -> None:
    assert open_page(driver, smol) == default_model("smollm2").name
    assert find(driver, "#temperature").get_attribute("value") == "0.8"
    assert find(driver, "#max-tokens").get_attribute("value") == "512"
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    assert not find(driver, "#thinking-label").is_displayed()  # SmolLM2's template does not think
    driver.execute_script(RECORD_FETCH)
    set_input(driver, "#max-tokens", "80")
    set_input(driver, "#temperature", "0")

    # SmolLM2 answers this (at temperature 0) with a fenced Python block and a sentence about it.
    question = "Write a Python function that reverses a list, with a short explanation in markdown."
    send(driver, question)
    reply = wait_reply(driver, 1)
    assert find_all(driver, ".msg.user")[0].text.endswith(question)
    [stored] = stored_conversations(driver)
    answer = stored["messages"][1]["content"]
    assert "```python" in answer, answer
    code = find(reply, ".content .code-block pre > code.hljs.language-python")
    assert find_all(code, "span.hljs-keyword"), code.get_attribute("outerHTML")
    assert "def " in code.text and "```" not in find(reply, ".content").text  # rendered, not shown as typed
    assert find(reply, ".code-block .code-lang").text == "python"
    timings = find(reply, ".timings").text
    assert re.search(rf"prompt: [1-9]\d* tokens, {TOKS}", timings), timings
    assert re.search(rf"generated: [1-9]\d* tokens, {TOKS}", timings), timings
    assert "draft" not in timings  # no speculative decoding on this server
    assert not find_all(reply, "details.reasoning")  # SmolLM2 does not think
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    used = stored["messages"][1]["timings"]
    n_used = used["cache_n"] + used["prompt_n"] + used["predicted_n"]
    assert find(driver, "#context").text == f"context: {n_used} / 4096 tokens"
    assert sent_bodies(driver) == [
        {
            "messages": [{"role": "user", "content": question}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": 80,
        }
    ]

    # Shift+Enter is a new line, not a send; the second turn carries the history (the answer as written).
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
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Say it again,\nbut shorter."},
    ]

    # Nothing came from anywhere but this server: the page's files and its API calls, all on its origin.
    loaded = resources(driver)
    assert all(r["name"].startswith(smol.url + "/") for r in loaded), loaded
    assert {f"{smol.url}/{a}" for a in PAGE_ASSETS} <= {r["name"] for r in loaded}, loaded
    # A script that got into the DOM anyway would not run: the CSP allows no inline script.
    ran = driver.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.__inline = 1';"
        "document.body.append(s); return window.__inline === 1"
    )
    assert ran is False


def test_reload_keeps_the_conversation_and_edit_regenerates(driver: WebDriver, smol: ServerProcess) -> None:
    open_page(driver, smol)
    set_input(driver, "#max-tokens", "4")
    set_input(driver, "#temperature", "0")
    send(driver, "Name a colour.")
    wait_reply(driver, 1)
    send(driver, "Name a fruit.")
    wait_reply(driver, 2)
    before = [m.get_attribute("innerHTML") for m in find_all(driver, ".msg .content")]

    # A reload shows the same conversation, speed lines included, and lists it in the side panel.
    open_page(driver, smol, keep=True)
    assert [m.get_attribute("innerHTML") for m in find_all(driver, ".msg .content")] == before
    assert len(find_all(driver, ".msg .timings")) == 2
    [item] = find_all(driver, "#conversations .conversation")
    assert "current" in item.get_attribute("class") and find(item, ".open").text == "Name a colour."

    # Edit the first question: the later turns go, the new question is answered alone.
    driver.execute_script(RECORD_FETCH)
    find(find_all(driver, ".msg.user")[0], "button.edit").click()
    box = find(driver, ".msg.user .edit-box")
    assert box.get_attribute("value") == "Name a colour."
    box.clear()
    box.send_keys("Name an animal.")
    find(driver, ".msg.user .edit-send").click()
    wait(driver, lambda d: len(find_all(d, ".msg")) == 2 and find_all(replies(d)[0], ".timings"), what="regenerated")
    assert [m.text for m in find_all(driver, ".msg.user .content")] == ["Name an animal."]
    assert sent_bodies(driver)[-1]["messages"] == [{"role": "user", "content": "Name an animal."}]
    [stored] = stored_conversations(driver)
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][0]["content"] == "Name an animal." and stored["title"] == "Name an animal."

    # Regenerate the reply: the same question asked again, still one reply.
    find(replies(driver)[0], "button.regenerate").click()
    wait(driver, lambda d: len(sent_bodies(d)) == 2 and find_all(d, ".msg.assistant .timings"), what="regenerated")
    assert sent_bodies(driver)[-1]["messages"] == [{"role": "user", "content": "Name an animal."}]
    assert len(find_all(driver, ".msg")) == 2


def test_stop_ends_the_stream_and_frees_the_slot(driver: WebDriver, smol: ServerProcess) -> None:
    open_page(driver, smol)
    set_input(driver, "#max-tokens", "1000")
    send(driver, "Write a very long story about a dragon who learns to bake bread.")
    wait(driver, lambda d: len(replies(d)) == 1 and find(replies(d)[0], ".content").text.strip(), what="stream start")
    assert find(driver, "#stop").is_enabled() and not find(driver, "#send").is_enabled()
    assert any(s["is_processing"] for s in httpx.get(smol.url + "/slots").json())
    find(driver, "#stop").click()
    reply = wait(driver, lambda d: (m := replies(d)[0]) and find_all(m, ".note") and m, 10, "stopped note")
    assert "stopped" in find(reply, ".note").text
    assert not find_all(reply, ".timings")
    assert find(driver, "#send").is_enabled() and not find(driver, "#stop").is_enabled()
    assert server_log_has(smol, "cancel_tasks: cancel task"), smol.log()[-2000:]
    deadline = time.monotonic() + 10
    while any(s["is_processing"] for s in httpx.get(smol.url + "/slots").json()):
        assert time.monotonic() < deadline, f"a slot is still busy after Stop: {httpx.get(smol.url + '/slots').text}"
        time.sleep(0.1)
    # The partial reply is kept, marked as stopped.
    [stored] = stored_conversations(driver)
    assert stored["messages"][1]["stopped"] is True and stored["messages"][1]["content"]


def test_conversation_list_rename_export_delete(driver: WebDriver, smol: ServerProcess) -> None:
    open_page(driver, smol)
    set_input(driver, "#max-tokens", "3")
    send(driver, "First chat")
    wait_reply(driver, 1)
    find(driver, "#new-chat").click()  # New chat clears the page; the old one stays in the list
    assert not find_all(driver, ".msg") and find(driver, "#empty").is_displayed()
    send(driver, "Second chat")
    wait_reply(driver, 1)
    titles = lambda d: [e.text for e in find_all(d, "#conversations .open")]  # noqa: E731
    assert titles(driver) == ["Second chat", "First chat"]  # the latest first

    # Open the first one again.
    find_all(driver, "#conversations .open")[1].click()
    assert [m.text for m in find_all(driver, ".msg.user .content")] == ["First chat"]
    assert "current" in find_all(driver, "#conversations .conversation")[1].get_attribute("class")

    # Rename it: kept across a reload.
    find(driver, "#conversations .current .rename").click()
    box = find(driver, "#conversations .rename-box")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("Renamed", Keys.ENTER)
    open_page(driver, smol, keep=True)
    assert sorted(titles(driver)) == ["Renamed", "Second chat"]

    # Export it as JSON (the download captured, nothing written to disk).
    driver.execute_script("""
        window.__blobs = []; window.__downloads = [];
        URL.createObjectURL = (b) => { window.__blobs.push(b); return "blob:captured"; };
        HTMLAnchorElement.prototype.click = function () { window.__downloads.push(this.download); };
    """)
    find(driver, "#conversations .current .export").click()
    exported = json.loads(driver.execute_async_script("window.__blobs[0].text().then(arguments[0])"))
    assert driver.execute_script("return window.__downloads") == ["Renamed.json"]
    assert exported["exported_by"] == "mtpserve" and exported["conversation"]["title"] == "Renamed"
    assert [m["content"] for m in exported["conversation"]["messages"]][0] == "First chat"
    find(driver, "#export-all").click()
    everything = json.loads(driver.execute_async_script("window.__blobs[1].text().then(arguments[0])"))
    assert sorted(c["title"] for c in everything["conversations"]) == ["Renamed", "Second chat"]

    # Delete it (after a confirmation): gone from the list, the page and the browser's storage.
    driver.execute_script("window.confirm = () => true")
    find(driver, "#conversations .current .delete").click()
    assert titles(driver) == ["Second chat"]
    assert not find_all(driver, ".msg") and find(driver, "#empty").is_displayed()
    assert [c["title"] for c in stored_conversations(driver)] == ["Second chat"]


def test_reasoning_thinking_switch_and_draft_acceptance(driver: WebDriver, qwen: ServerProcess) -> None:
    assert open_page(driver, qwen) == "tinyqwen35-mtp-Q4_K_M.gguf"
    wait(driver, lambda d: find(d, "#thinking-label").is_displayed(), 10, "the thinking switch")
    assert find(driver, "#thinking").is_selected()
    driver.execute_script(RECORD_FETCH)
    set_input(driver, "#max-tokens", "100")
    set_input(driver, "#temperature", "0")
    send(driver, "Write a Python function that reverses a list.")
    reply = wait_reply(driver, 1)
    assert "chat_template_kwargs" not in sent_bodies(driver)[0]  # thinking on: the template's default

    details = find(reply, "details.reasoning")
    assert find(details, ".reasoning-text").get_attribute("textContent").strip(), "the reasoning block is empty"
    assert find(details, "summary").text == "Reasoning"
    assert details.get_attribute("open") is None, "the reasoning block stays open after the reply"
    assert find(reply, ".content").text.strip()

    timings = find(reply, ".timings").text
    assert re.search(rf"generated: [1-9]\d* tokens, {TOKS}", timings), timings
    m = re.search(r"draft accepted: (\d+)/(\d+) \((\d+\.\d)%\)", timings)
    assert m, timings
    accepted, drafted, pct = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert pct == pytest.approx(100 * accepted / drafted, abs=0.06)
    assert re.fullmatch(r"context: \d+ / 4096 tokens", find(driver, "#context").text)

    # The picture in docs/serving.md: reasoning opened, the answer, the speed line.
    find(details, "summary").click()
    assert details.get_attribute("open") is not None
    if shot := os.environ.get("MTPSERVE_WEBUI_SCREENSHOT"):
        driver.execute_script("document.activeElement.blur()")
        driver.save_screenshot(shot)
        assert Path(shot).stat().st_size > 0

    # Thinking off: the request says so, and the reply has no reasoning.
    find(driver, "#thinking").click()
    set_input(driver, "#max-tokens", "8")
    send(driver, "Again, without thinking.")
    second = wait_reply(driver, 2)
    assert sent_bodies(driver)[1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert not find_all(second, "details.reasoning")
    assert find(second, ".content").text.strip()


def test_api_key(driver: WebDriver, keyed: ServerProcess) -> None:
    open_page(driver, keyed)  # /v1/models is public: the name shows without a key
    assert find(driver, "#api-key").get_attribute("value") == ""
    # the page's files came without a key
    assert driver.execute_script("return typeof window.mtpRender") == "function"
    statuses = {r["name"]: r["status"] for r in resources(driver)}
    assert all(statuses[f"{keyed.url}/{a}"] == 200 for a in PAGE_ASSETS), statuses
    set_input(driver, "#max-tokens", "8")

    send(driver, "Hi there")
    error = wait(driver, lambda d: (e := find(d, "#error")).is_displayed() and e, 30, "auth error")
    assert "Invalid API Key" in error.text and "API key" in error.text.replace("Invalid API Key", ""), error.text
    assert not find_all(driver, ".msg")  # the failed turn is dropped ...
    assert find(driver, "#prompt").get_attribute("value") == "Hi there"  # ... and its text put back to retry
    assert not stored_conversations(driver)  # ... and no empty conversation is left behind

    driver.execute_script(RECORD_FETCH)
    set_input(driver, "#api-key", "secret")
    send(driver, "Hi there")
    reply = wait_reply(driver, 1)
    assert find(reply, ".content").text.strip()
    assert not find(driver, "#error").is_displayed()
    sent = driver.execute_script("return window.__sent")
    assert sent and all(s["url"].startswith(keyed.url + "/") for s in sent)  # the key went to this server only
    assert all(s["headers"].get("Authorization") == "Bearer secret" for s in sent)

    # The key is remembered across reloads (localStorage).
    open_page(driver, keyed, keep=True)
    assert find(driver, "#api-key").get_attribute("value") == "secret"


# --- rendering, with chosen texts -------------------------------------------------------------------------


def test_render_markdown_code_and_reasoning(driver: WebDriver, smol: ServerProcess) -> None:
    """The page's render function on markdown the tiny models would not write reliably."""
    open_page(driver, smol)
    text = (
        "# Reversing a list\n\n"
        "Two ways:\n\n"
        "1. slicing\n2. `reversed()`\n\n"
        "- **fast**\n- *simple*\n\n"
        "```python\ndef reverse(xs: list) -> list:\n    return xs[::-1]\n```\n\n"
        "```\nno language here\n```\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "> a quote with [a link](https://example.com/x)\n\n"
        "Math stays text: $x_1 + x_2$ and \\(a^2\\), but $5 and $6 are money.\n\n"
        "$$\n\\sum_{i=1}^n i\n$$\n"
    )
    reply = render(driver, text, "first I think\nthen I answer")
    content = find(reply, ".content")
    assert find(content, "h1").text == "Reversing a list"
    assert [li.text for li in find_all(content, "ol > li")] == ["slicing", "reversed()"]
    assert find(content, "ol code").text == "reversed()"
    assert [li.text for li in find_all(content, "ul > li")] == ["fast", "simple"]
    assert find(content, "ul strong").text == "fast" and find(content, "ul em").text == "simple"
    code = find(content, ".code-block pre > code.hljs.language-python")
    assert find(code, "span.hljs-keyword").text == "def"
    assert code.get_attribute("textContent") == "def reverse(xs: list) -> list:\n    return xs[::-1]\n"
    assert len(find_all(content, ".code-block")) == 2 and find_all(content, ".code-block")[1].text.endswith(
        "no language here"
    )
    assert [c.text for c in find_all(content, "table td")] == ["1", "2"]
    link = find(content, "blockquote a")
    assert link.get_attribute("href") == "https://example.com/x" and link.get_attribute("target") == "_blank"
    assert "noopener" in link.get_attribute("rel")
    assert [m.text for m in find_all(content, "span.math")] == ["$x_1 + x_2$", "\\(a^2\\)"]
    assert "$5 and $6 are money" in content.text
    assert find(content, "div.math").text == "$$\n\\sum_{i=1}^n i\n$$"
    details = find(reply, "details.reasoning")
    assert details.get_attribute("open") is None and find(details, "summary").text == "Reasoning"
    assert find(details, ".reasoning-text").get_attribute("textContent") == "first I think\nthen I answer"

    # The copy button puts the code, as text, on the clipboard.
    driver.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": smol.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    button = find(content, ".code-block button.copy-code")
    button.click()
    wait(driver, lambda d: button.text == "Copied", 5, "copied")
    copied = driver.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0](String(e)))"
    )
    assert copied == code.get_attribute("textContent")


# Each sets window.__pwned if it runs.
HOSTILE = [
    "<script>window.__pwned = 'script'</script>",
    "<img src=x onerror=\"window.__pwned = 'img'\">",
    "[click me](javascript:window.__pwned='link')",
    "[upper case](JaVaScRiPt:window.__pwned='case')",
    "[entity](&#106;avascript:window.__pwned='entity')",
    "<a href=\"javascript:window.__pwned='a'\">raw link</a>",
    "<svg onload=\"window.__pwned='svg'\"></svg>",
    "<iframe srcdoc=\"<script>parent.__pwned='iframe'</script>\"></iframe>",
    "<details open ontoggle=\"window.__pwned='toggle'\">x</details>",
    "<math><mi xlink:href=\"javascript:window.__pwned='math'\">m</mi></math>",
    "![pic](javascript:window.__pwned='image')",
    "<style>body { display: none }</style>",
    "```html\n<script>window.__pwned='code'</script>\n```",
    "`<img src=x onerror=window.__pwned='inline-code'>`",
    "<div>\n\n<img src=x onerror=\"window.__pwned='block'\">\n\n</div>",
    '<form action="https://example.com"><button>go</button></form>',
]


def test_render_is_sanitized(driver: WebDriver, smol: ServerProcess) -> None:
    """Model output with scripts, handlers and javascript: links executes nothing and shows as text."""
    open_page(driver, smol)
    nodes = [render(driver, payload) for payload in HOSTILE]
    nodes.append(render(driver, "\n\n".join(HOSTILE), "<script>window.__pwned = 'reasoning'</script>"))
    for a in find_all(driver, "#messages a"):  # follow every link that is not an ordinary web address
        if not (a.get_attribute("href") or "").startswith("http"):
            driver.execute_script("arguments[0].click()", a)
    for d in find_all(driver, "#messages details"):
        driver.execute_script("arguments[0].open = !arguments[0].open", d)
    time.sleep(0.5)  # room for an image's onerror or a toggle event to fire
    assert driver.execute_script("return window.__pwned") is None
    assert driver.current_url.startswith(smol.url)

    found = driver.execute_script("""
        const root = document.getElementById("messages");
        const all = [...root.querySelectorAll("*")];
        return {
            tags: [...new Set(all.map(e => e.tagName.toLowerCase()))],
            handlers: all.flatMap(e => [...e.attributes].filter(a => /^on/i.test(a.name)).map(a => a.name)),
            urls: all.flatMap(e => ["href", "src", "xlink:href", "action", "srcdoc"]
                .filter(n => e.hasAttribute(n)).map(n => e.getAttribute(n))),
        };
    """)
    assert not {"script", "iframe", "svg", "math", "style", "form", "object", "embed"} & set(found["tags"]), found
    assert not found["handlers"], found
    assert not [u for u in found["urls"] if "javascript" in u.lower() or u.startswith("x")], found
    # What the model wrote is shown, as text.
    assert find(nodes[0], ".content").text == HOSTILE[0]
    assert find(nodes[1], ".content").text == HOSTILE[1]
    assert find(nodes[5], ".content").text == HOSTILE[5]
    assert find(nodes[2], ".content a").text == "click me"
    assert "window.__pwned='code'" in find(nodes[12], ".content code").text
    assert (
        find(nodes[-1], ".reasoning-text").get_attribute("textContent")
        == "<script>window.__pwned = 'reasoning'</script>"
    )


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
    [stored] = stored_conversations(driver)
    assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == ["scripted", "second"]
    driver.refresh()  # drop the fake fetch
