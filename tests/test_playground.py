"""The playground at GET /: served without the key, and driven in Debian's headless Chromium against a
live server (one per module, guarded by an API key) with a tiny random model.

    pytest -q tests/test_playground.py

The browser tests (marker `browser`) need Debian's chromium and chromium-driver (`apt-get install
chromium chromium-driver`, which .ci/run does) and selenium (the dev extra); without them they skip.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import make_varied_model  # noqa: E402

from gptopt.config import ServeConfig  # noqa: E402
from gptopt.serve.app import create_app  # noqa: E402
from gptopt.serve.server import serve_in_thread  # noqa: E402

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# Without the background-networking flags Chromium phones home at start, which a closed network refuses.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
KEY = "s3cret"
LIMIT = 200  # the server's --max_tokens_limit
PROMPT = "def parse_args(self, args=None):"
STATIC = Path(__file__).resolve().parents[1] / "src/gptopt/serve/static"
# Seconds a decode step: long enough to watch the text grow (a test that presses Stop mid-stream raises it).
DECODE_DELAY = {"s": 0.01}


@pytest.fixture(scope="module")
def server(debug_tokenizer: Any) -> Iterator[str]:
    """The base URL of a live server that needs KEY, its decode slowed down a little."""
    model = make_varied_model(debug_tokenizer.get_vocab_size())  # text that changes from token to token
    cfg = ServeConfig(model="debug", device="cpu", api_key=KEY, max_tokens_limit=LIMIT, max_batch_size=2)
    app = create_app(cfg, model=model, tokenizer=debug_tokenizer)
    decode = app.state.engine.generator.decode

    def slow_decode(*args: Any) -> torch.Tensor:
        time.sleep(DECODE_DELAY["s"])
        return decode(*args)

    app.state.engine.generator.decode = slow_decode
    with serve_in_thread(app) as s:
        yield f"http://127.0.0.1:{s.port}"


# -- without a browser -------------------------------------------------------------------------------


def test_page_and_files_are_served_without_the_key(server: str) -> None:
    assert httpx.get(f"{server}/v1/models").status_code == 401  # the server is guarded
    for path, media in (("/", "text/html"), ("/static/playground.js", "text/javascript"),
                        ("/static/playground.css", "text/css")):
        r = httpx.get(f"{server}{path}")
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"] == f"{media}; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
    page = httpx.get(f"{server}/").text
    assert '<script src="/static/playground.js"' in page and 'href="/static/playground.css"' in page
    schema = httpx.get(f"{server}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert not {"/", "/static/playground.js", "/static/playground.css"} & set(schema["paths"])


def test_the_files_name_no_other_host() -> None:
    """Nothing from a CDN: every URL the page's files hold is a path on this server."""
    for f in STATIC.iterdir():
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".js":  # its // comments are no URLs
            text = re.sub(r"(?m)(^|\s)//\s.*$", "", text)
        assert not re.search(r"[a-z]+://|[\"'(=]\s*//", text), f


# -- in Chromium ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    """Headless Chromium from Debian's packages, driven by the chromedriver beside it (named explicitly, so
    selenium never tries to download one)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: apt-get install chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="gptopt-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        d = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            yield d
        finally:
            d.quit()


def wait(driver: Any, script: str, *args: Any, timeout: float = 30) -> Any:
    """The first truthy value of `script` (JavaScript, `return ...`, given `args`), polled."""
    deadline = time.monotonic() + timeout
    while not (value := driver.execute_script(script, *args)):
        assert time.monotonic() < deadline, f"timed out waiting for: {script}"
        time.sleep(0.005)
    return value


def open_page(driver: Any, url: str, key: str | None) -> None:
    """The page, fresh, with `key` already in the tab's sessionStorage (or none), its model list read."""
    driver.get(f"{url}/")
    driver.execute_script("sessionStorage.clear(); if (arguments[0]) sessionStorage.setItem('gptopt-api-key', "
                          "arguments[0]);", key)
    driver.refresh()
    wait(driver, "return document.body.dataset.models !== 'loading'")


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def fill(driver: Any, **fields: Any) -> None:
    """Type into the page's fields, by id, as a user would."""
    from selenium.webdriver.common.by import By

    for name, value in fields.items():
        el = driver.find_element(By.ID, name)
        el.clear()
        el.send_keys(str(value))


def send(driver: Any, prompt: str, **params: Any) -> Any:
    """Type a prompt and the settings, press Send: the new answer's element."""
    from selenium.webdriver.common.by import By

    before = len(driver.find_elements(By.CSS_SELECTOR, ".answer"))
    fill(driver, prompt=prompt, **params)
    driver.find_element(By.ID, "send").click()
    wait(driver, f"return document.querySelectorAll('.answer').length > {before}")
    return driver.find_elements(By.CSS_SELECTOR, ".answer")[-1]


def finished(answer: Any, timeout: float = 60) -> str:
    """The answer's end state, once it has one: done, error or stopped."""
    deadline = time.monotonic() + timeout
    while (state := answer.get_attribute("data-state")) not in ("done", "error", "stopped"):
        assert time.monotonic() < deadline, f"the answer is still {state}"
        time.sleep(0.005)
    return state


def text_of(driver: Any, answer: Any, part: str) -> str:
    """The exact text of a part of an answer (.text, .stats, .error): textContent, not selenium's layout."""
    return driver.execute_script(f"return arguments[0].querySelector('.{part}').textContent", answer)


def greedy(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.browser
def test_without_the_key_the_page_asks_for_it_fails_clearly_and_works_once_given(driver: Any, server: str) -> None:
    from selenium.webdriver.common.by import By

    open_page(driver, server, key=None)
    assert driver.execute_script("return document.body.dataset.models") == "needs-key"
    assert driver.find_element(By.ID, "api-key").is_displayed()
    assert "needs an API key" in driver.find_element(By.ID, "status").text
    # The browser logs the refused GET /v1/models; nothing else may fail.
    errors = console_errors(driver)
    assert all("/v1/models - Failed to load resource" in e and "401" in e for e in errors), errors

    answer = send(driver, "x", max_tokens=4)
    assert finished(answer) == "error"
    assert "401: missing or incorrect API key" in text_of(driver, answer, "error")
    assert text_of(driver, answer, "text") == ""

    fill(driver, **{"api-key": KEY})
    driver.find_element(By.ID, "key-use").click()
    wait(driver, "return document.body.dataset.models === 'loaded'")
    assert driver.find_element(By.ID, "model-name").text == "debug"
    assert driver.execute_script("return sessionStorage.getItem('gptopt-api-key')") == KEY
    assert driver.execute_script("return localStorage.length") == 0
    answer = send(driver, "x", max_tokens=4, temperature=0)
    assert finished(answer) == "done" and text_of(driver, answer, "text")
    assert text_of(driver, answer, "error") == ""


@pytest.mark.browser
def test_streamed_text_grows_and_equals_the_greedy_completion(driver: Any, server: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(driver, server, key=KEY)
    console_errors(driver)  # only what follows counts
    # A model without a chat template: completion mode only, and the page says why.
    assert driver.find_element(By.ID, "chat-note").is_displayed()
    assert not driver.find_element(By.ID, "mode").is_displayed()
    assert driver.find_element(By.ID, "prompt").get_attribute("placeholder") == "Once upon a time"
    fill(driver, prompt=PROMPT, temperature=0, top_p=1, max_tokens=24)
    driver.find_element(By.ID, "prompt").send_keys(Keys.CONTROL, Keys.ENTER)
    answer = driver.find_element(By.CSS_SELECTOR, ".answer")
    lengths = set()
    while answer.get_attribute("data-state") in ("waiting", "streaming"):
        lengths.add(len(text_of(driver, answer, "text")))
    assert finished(answer) == "done"
    assert text_of(driver, answer, "text") == greedy(server, PROMPT, 24)
    assert int(answer.get_attribute("data-chunks")) > 1
    assert len(lengths - {0}) > 1, f"the text did not grow by steps: lengths seen {sorted(lengths)}"
    stats = text_of(driver, answer, "stats")
    assert re.fullmatch(r"24 tokens · TTFT \d+ ms · [\d.]+ tokens/s", stats), stats
    assert answer.find_element(By.CSS_SELECTOR, ".prompt").text == PROMPT
    assert console_errors(driver) == []


@pytest.mark.browser
def test_a_refused_request_shows_the_servers_message(driver: Any, server: str) -> None:
    open_page(driver, server, key=KEY)
    answer = send(driver, PROMPT, max_tokens=LIMIT + 1)
    assert finished(answer) == "error"
    assert text_of(driver, answer, "error") == f"400: max_tokens may be at most {LIMIT}"


@pytest.mark.browser
def test_stop_ends_the_stream(driver: Any, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from selenium.webdriver.common.by import By

    monkeypatch.setitem(DECODE_DELAY, "s", 0.1)  # 40 tokens: 4 s unless stopped
    open_page(driver, server, key=KEY)
    answer = send(driver, "x", max_tokens=40, temperature=0)
    wait(driver, "return Number(arguments[0].dataset.chunks) >= 2 || "
         "!['waiting', 'streaming'].includes(arguments[0].dataset.state)", answer)
    assert not driver.find_element(By.ID, "clear").is_enabled()  # no clearing the conversation mid-reply
    driver.find_element(By.ID, "stop").click()
    assert finished(answer) == "stopped"
    assert int(answer.get_attribute("data-chunks")) < 40
    assert text_of(driver, answer, "stats").endswith(" · stopped")
    assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()
    assert driver.find_element(By.ID, "clear").is_enabled()


@pytest.mark.browser
def test_the_page_requests_nothing_but_this_server(driver: Any, server: str) -> None:
    driver.get_log("performance")  # drained: what the browser's own start-up page loaded does not count
    open_page(driver, server, key=KEY)
    # Text is shown as text: were this prompt (or model output) parsed as HTML, the image would be fetched.
    markup = '<img src="//example.invalid/x.png"><b>bold</b>'
    answer = send(driver, markup, max_tokens=4)
    assert finished(answer) == "done"
    assert text_of(driver, answer, "prompt") == markup
    assert driver.execute_script("return document.querySelectorAll('#answers img, #answers b').length") == 0
    urls = [m["params"]["request"]["url"] for m in (json.loads(e["message"])["message"]
                                                    for e in driver.get_log("performance"))
            if m["method"] == "Network.requestWillBeSent"]
    assert f"{server}/static/playground.js" in urls and f"{server}/v1/completions" in urls
    assert all(u.startswith(f"{server}/") or u.startswith("data:") for u in urls), urls


@pytest.fixture(scope="module")
def chat_server(debug_tokenizer: Any) -> Iterator[str]:
    """A server without a key whose model has a chat template (the built-in plain one)."""
    model = make_varied_model(debug_tokenizer.get_vocab_size())
    cfg = ServeConfig(model="debug", device="cpu", chat_template="plain", max_batch_size=2)
    with serve_in_thread(create_app(cfg, model=model, tokenizer=debug_tokenizer)) as s:
        yield f"http://127.0.0.1:{s.port}"


@pytest.mark.browser
def test_chat_mode_holds_the_conversation_and_each_reply_is_the_routes_greedy_reply(
    driver: Any, chat_server: str
) -> None:
    """A model with a template: the page offers chat, posts the whole conversation each turn, and shows
    what /v1/chat/completions answers for it."""
    from selenium.webdriver.common.by import By

    open_page(driver, chat_server, key=None)
    console_errors(driver)  # only what follows counts
    assert driver.find_element(By.ID, "mode").is_displayed()
    assert not driver.find_element(By.ID, "chat-note").is_displayed()
    assert driver.find_element(By.ID, "prompt-label").text == "Message"
    assert driver.find_element(By.ID, "prompt").get_attribute("placeholder").startswith("Ask something")
    messages: list[dict[str, str]] = []
    for turn in ("Hi", "Again"):  # short: the debug model reads 64 tokens, the plain template about a byte each
        answer = send(driver, turn, temperature=0, max_tokens=6)
        assert finished(answer) == "done", text_of(driver, answer, "error")
        messages.append({"role": "user", "content": turn})
        r = httpx.post(f"{chat_server}/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]["content"]
        assert text_of(driver, answer, "text") == reply  # the second turn's reply depends on the first's
        messages.append({"role": "assistant", "content": reply})
    assert driver.execute_script("return document.querySelectorAll('.answer').length") == 2
    assert console_errors(driver) == []
