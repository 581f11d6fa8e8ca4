"""The playground at ``/``, in a real headless Chromium (Debian's chromium + chromium-driver,
driven by Selenium) against a real uvicorn server: the default SmolLM2 model where the answer
matters, the FakeEngine where timing or determinism must be controlled."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading

import httpx
import jsonschema
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tinyserve.testing.browser import find_browser, start_browser
from tinyserve.testing.server import engine_gauges, metric_samples, wait_idle, wait_until

MODEL = "SmolLM2-135M-Instruct"
STATIC = ("index.html", "style.css", "markdown.js", "api.js", "chat.js", "engine.js", "main.js")


@pytest.fixture(scope="module")
def browser():
    if find_browser() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("no chromium + chromedriver here (apt-get install chromium chromium-driver)")
    driver = start_browser()
    yield driver
    driver.quit()


@contextlib.contextmanager
def page_on(browser, server_context):
    """Serve (a ``fake_server(...)`` context) and leave the page before the server stops:
    leaving closes the page's engine-view stream (on pagehide), which would otherwise hold
    the in-process server's shutdown for 30 s."""
    with server_context as s:
        try:
            yield s
        finally:
            browser.get("about:blank")


def open_page(browser, base_url: str) -> None:
    """Load the page with empty browser storage."""
    browser.get(base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(base_url + "/")
    assert wait_until(lambda: browser.execute_script("return typeof Chat === 'object'"), 10)


def set_field(browser, field: str, value: str) -> None:
    browser.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('change', {bubbles: true}));",
        field,
        value,
    )


def send(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def busy(browser) -> bool:
    return browser.execute_script("return document.body.dataset.busy === '1'")


def wait_answer(browser, timeout: float = 60) -> None:
    assert wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"), 10)
    assert wait_until(lambda: not busy(browser), timeout), "the answer never finished"


def live_deltas(browser) -> int:
    """How many deltas the answer on screen has received so far (its data-deltas)."""
    return browser.execute_script(  # one call: the element is re-rendered as it streams
        "const els = document.querySelectorAll('.msg.assistant');"
        "return els.length ? Number(els[els.length - 1].dataset.deltas || 0) : 0;"
    )


def stored(browser) -> dict:
    return json.loads(browser.execute_script("return localStorage['tinyserve.conversations']"))


def messages(browser) -> list[dict]:
    state = stored(browser)
    conv = next(c for c in state["conversations"] if c["id"] == state["current"])
    return conv["messages"]


def test_page_and_its_files_load_without_the_key_and_from_nowhere_else(fake_server):
    with fake_server(api_key="sekret") as s, httpx.Client(base_url=s.base_url) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert refs and all(r.startswith("/playground/") or r.startswith("data:") for r in refs)
        for name in STATIC[1:]:
            r = c.get(f"/playground/{name}")
            assert r.status_code == 200, name
            assert not re.search(r"""(?:src|href|import|fetch)\s*\(?\s*["']https?://""", r.text)
        for bad in ("nope.js", "..%2Fplayground.py", "index.py"):
            r = c.get(f"/playground/{bad}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert c.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_markdown_is_escaped_and_renders_code(browser, fake_server):
    with page_on(browser, fake_server()) as s:
        open_page(browser, s.base_url)
        html = browser.execute_script(
            "return Markdown.render(arguments[0])",
            "**hi** <img src=x onerror=alert(1)>\n\n- a\n- `<b>`\n\n```python\nx = '<tag>'\n```\n",
        )
    assert "<strong>hi</strong>" in html and "<img" not in html and "&lt;img" in html
    assert "<ul><li>a</li><li><code>&lt;b&gt;</code></li></ul>" in html
    assert '<code class="language-python">x = &#39;&lt;tag&gt;&#39;</code>' in html


def test_chat_streams_in_increments_and_survives_a_reload(browser, server):
    open_page(browser, server.base_url)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "40")
    send(browser, "Name three colors.")
    lengths = set()

    def watch():  # one script call: the page re-renders the element as it streams
        text, is_busy = browser.execute_script(
            "const els = document.querySelectorAll('.msg.assistant .content');"
            "return [els.length ? els[els.length - 1].textContent : null,"
            " document.body.dataset.busy === '1'];"
        )
        if text is not None:
            lengths.add(len(text))
        return text is not None and not is_busy

    assert wait_until(watch, 60, interval=0.005)
    assert len(lengths - {0}) >= 3, f"the answer did not arrive in increments: {lengths}"
    user, answer = messages(browser)
    assert answer["deltas"] >= 3
    ref = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name three colors."}],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 40,
        },
        timeout=60,
    ).json()
    assert answer["content"] == ref["choices"][0]["message"]["content"]
    stats = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
    usage = ref["usage"]
    assert f"{usage['prompt_tokens']} prompt" in stats and "TTFT" in stats and "tok/s" in stats
    assert f"+ {usage['completion_tokens']} completion tokens" in stats
    assert re.search(r"\(\d+ cached\)", stats)
    browser.refresh()
    assert wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"), 10)
    assert browser.find_element(By.CSS_SELECTOR, "#conversations li").text.startswith("Name three")
    assert messages(browser)[1]["content"] == answer["content"]


def finished_count(base_url: str, reason: str | None = None) -> float:
    """Requests the server has finished (with ``reason``), from /metrics."""
    return sum(
        value
        for name, labels, value in metric_samples(base_url)
        if name == "request_success_total" and reason in (None, labels.get("finished_reason"))
    )


def test_stop_aborts_the_request_on_the_server(browser, server):
    open_page(browser, server.base_url)
    set_field(browser, "max-tokens", "3000")
    set_field(browser, "seed", "1")
    before = finished_count(server.base_url, "abort")
    send(browser, "Write a very long story about a dragon who learns to cook.")
    assert wait_until(lambda: live_deltas(browser) >= 3, 60, interval=0.01)
    assert engine_gauges(server.base_url)["num_requests_running"] == 1
    browser.find_element(By.ID, "stop-btn").click()
    assert wait_until(lambda: not busy(browser), 10)
    assert messages(browser)[-1]["stopped"] is True
    g = wait_idle(server.base_url, timeout=10)
    assert (
        g["num_requests_running"] == 0 and g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"]
    )
    assert finished_count(server.base_url, "abort") == before + 1
    assert "stopped" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text


def test_regenerate_and_edit_resend(browser, fake_server):
    with page_on(browser, fake_server()) as s:
        open_page(browser, s.base_url)
        set_field(browser, "max-tokens", "3")
        box = browser.find_element(By.ID, "input")
        box.send_keys("hel", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "lo")  # Shift+Enter: a new line
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
        box.send_keys(Keys.ENTER)
        wait_answer(browser)
        assert [m["content"] for m in messages(browser)] == ["hel\nlo", "t0 t1 t2 "]
        browser.find_element(By.CSS_SELECTOR, '.msg.assistant [data-act="regenerate"]').click()
        assert wait_until(lambda: finished_count(s.base_url) == 2, 5)
        wait_answer(browser)
        set_field(browser, "max-tokens", "2")
        browser.find_element(By.CSS_SELECTOR, '.msg.user [data-act="edit"]').click()
        area = browser.find_element(By.CSS_SELECTOR, ".msg.user textarea.edit")
        area.clear()
        area.send_keys("changed")
        browser.find_element(By.CSS_SELECTOR, '[data-edit="send"]').click()
        assert wait_until(lambda: messages(browser)[0]["content"] == "changed", 5)
        wait_answer(browser)
        assert [m["content"] for m in messages(browser)] == ["changed", "t0 t1 "]
        assert finished_count(s.base_url) == 3  # send, regenerate, resend: three requests


def test_api_key_is_asked_once_and_sent(browser, fake_server):
    with page_on(browser, fake_server(api_key="sekret")) as s:
        browser.get(s.base_url + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(s.base_url + "/")
        dialog = browser.find_element(By.ID, "key-dialog")
        assert wait_until(lambda: dialog.get_attribute("open") is not None, 10)
        browser.find_element(By.ID, "key-input").send_keys("sekret")
        browser.find_element(By.ID, "key-save").click()
        name = browser.find_element(By.ID, "model-name")
        assert wait_until(lambda: name.text == "fake-model", 10)
        assert browser.execute_script("return localStorage['tinyserve.apiKey']") == "sekret"
        set_field(browser, "max-tokens", "2")
        send(browser, "hi")
        wait_answer(browser)
        assert messages(browser)[-1]["content"] == "t0 t1 "
        assert dialog.get_attribute("open") is None


def test_json_schema_and_tool_modes(browser, server):
    open_page(browser, server.base_url)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    set_field(browser, "temperature", "0")
    set_field(browser, "mode", "json")
    set_field(browser, "json-schema", json.dumps(schema))
    send(browser, "Pick a color.")
    wait_answer(browser)
    jsonschema.validate(json.loads(messages(browser)[-1]["content"]), schema)
    set_field(browser, "mode", "tools")
    set_field(browser, "tool-choice", "required")
    send(browser, "What is the weather in Paris?")
    wait_answer(browser)
    call = messages(browser)[-1]["tool_calls"][0]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
    view = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tool-call")[-1].text
    assert "get_weather" in view
    wait_idle(server.base_url)


def test_send_is_refused_while_an_answer_streams(browser, fake_server):
    with page_on(browser, fake_server(step_delay=0.02)) as s:
        open_page(browser, s.base_url)
        send(browser, "first")
        assert wait_until(lambda: busy(browser), 5)
        send(browser, "second")  # Enter while busy: nothing is sent
        browser.find_element(By.ID, "stop-btn").click()
        assert wait_until(lambda: not busy(browser), 5)
        assert [m["role"] for m in messages(browser)] == ["user", "assistant"]
        assert wait_until(lambda: s.async_engine.num_requests_in_flight == 0, 5)


def engine_steps(base_url: str) -> int:
    """The engine's step counter, from /metrics."""
    return int(next(v for name, _, v in metric_samples(base_url) if name == "engine_steps_total"))


def test_engine_panel_follows_the_engine(browser, server):
    open_page(browser, server.base_url)
    view = browser.find_element(By.ID, "engine")
    assert wait_until(lambda: view.get_attribute("data-step"), 10), "no first snapshot"
    body = {"model": MODEL, "max_tokens": 48, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the moon."}]}  # fmt: skip
    post = lambda: httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)  # noqa: E731
    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    seen = []

    def watch():
        attrs = ("data-step", "data-running")
        seen.append([int(view.get_attribute(a)) for a in attrs] + [
            int(browser.find_element(By.ID, "kv-pool").get_attribute("data-used") or 0),
            len(browser.find_elements(By.CSS_SELECTOR, '#engine-requests tr[data-state="running"]')),
        ])  # fmt: skip
        return not any(t.is_alive() for t in threads)

    assert wait_until(watch, 120, interval=0.05)
    assert len({s[0] for s in seen}) >= 3, "the panel did not update while requests ran"
    assert max(s[1] for s in seen) >= 2 and max(s[2] for s in seen) > 0
    assert max(s[3] for s in seen) >= 2  # the requests table listed them
    g = wait_idle(server.base_url)
    metrics_steps = engine_steps(server.base_url)
    assert wait_until(lambda: view.get_attribute("data-running") == "0", 10)
    assert wait_until(lambda: int(view.get_attribute("data-step")) == metrics_steps, 10)
    assert float(view.get_attribute("data-kv-usage")) == pytest.approx(g["kv_cache_usage_perc"])
