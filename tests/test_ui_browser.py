"""The chat page (serve.ui) in a real browser: Debian's headless Chromium, driven through its ChromeDriver by
selenium, against `serve --backend reference` (the CLI's build_server, uvicorn in a thread) on the shipped small
model with 2 lanes and 2 MTP drafts. A conversation streams token by token, a stop mid-answer frees the lane
(read from /metrics), a new chat empties the page; a canned answer checks the Markdown, reasoning and
tool-call rendering; a wrong API key is answered with a readable message in the page. Screenshots go to the
test's tmp folder (their paths are printed). Without chromium and chromedriver (tools/setup.sh installs them)
the browser tests skip, saying so; the page's routes are checked without a browser."""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from ninfer_gen.cli.serve import add_serve_parser, build_server  # noqa: E402
from tests.test_serve import Server  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "qwen3.8-small-py"
KEY = "ui-test-key"
CANCELLED = 'ninfer_requests_total{endpoint="/v1/chat/completions",finish_reason="cancelled"}'


def _args(*flags):
    """`ninfer-gen serve` arguments on the reference backend, parsed by the subcommand's own parser."""
    parser = argparse.ArgumentParser(prog="ninfer-gen")
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--backend", "reference", "--weights", str(MODEL), *flags])


def _serve(*flags):
    app, engine, _ = build_server(_args("--lanes", "2", "--draft", "2", "--served-model-name", "small", *flags))
    return Server(app, engine)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip("no chromium and chromedriver on this machine: tools/setup.sh installs Debian's chromium and "
                    "chromium-driver with apt-get (as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox",          # no sandbox: CI runs as root, where Chromium's refuses
                "--disable-dev-shm-usage",                 # containers' /dev/shm is small: Chromium would crash
                "--window-size=1280,860", "--disable-gpu", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: selenium would otherwise try to download one
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))
    driver.set_script_timeout(20)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served():
    srv = _serve()
    yield srv
    srv.close()


def _by(driver, css):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, css)


def _page_errors(driver) -> list[str]:
    """The console's errors, less the browser's own line for each HTTP error status (a 401 is expected where
    a key is asked for): what the page's code threw or logged."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]


def _send(driver, text: str, max_tokens: int):
    from selenium.webdriver.common.keys import Keys
    field = _by(driver, "#max-tokens")[0]
    field.clear()
    field.send_keys(str(max_tokens))
    before = len(_by(driver, "article.assistant"))
    _by(driver, "#prompt")[0].send_keys(text, Keys.ENTER)
    return _until(lambda: len(answers := _by(driver, "article.assistant")) > before and answers[-1], 10,
                  "the answer to appear")


def _stat(answer, name: str) -> str:
    found = answer.find_elements("css selector", f'[data-stat="{name}"]')
    return found[0].text if found else ""


def test_page_routes_and_no_ui_flag(served):
    page = httpx.get(served.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"] and '/ui/app.js' in page.text
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{served.url}/ui/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
    assert httpx.get(served.url + "/ui/..%2fui.py", timeout=10).status_code == 404
    app, _, _ = build_server(_args("--lanes", "1", "--no-ui"))
    assert not any(getattr(r, "path", "") in ("/", "/ui/{name}") for r in app.routes)


def test_chat_streams_stops_and_starts_anew(served, browser, tmp_path):
    driver, url = browser, served.url
    driver.get(url + "/")
    _until(lambda: _by(driver, '[data-field="model"]')[0].text == "small", 15, "the model's name in the strip")
    _until(lambda: _by(driver, '[data-field="lanes"]')[0].text == "lanes 0/2 busy", 10, "the lanes in the strip")
    _by(driver, "#system")[0].send_keys("You write short Python functions.")
    temperature = _by(driver, "#temperature")[0]
    temperature.clear()
    temperature.send_keys("0")

    # two short answers in full: stats, and the second turn's prompt reuses the first's from the prefix cache
    for i, text in enumerate(("Write a function that adds two numbers.", "Now one that multiplies them.")):
        answer = _send(driver, text, 24)
        _until(lambda: answer.get_attribute("data-state") == "done", 60, f"answer {i} to finish")
        assert answer.find_element("css selector", ".content").text.strip()
        assert _stat(answer, "tokens").startswith("tokens ") and _stat(answer, "ttft").startswith("TTFT ")
        assert _stat(answer, "speed").endswith("tok/s") and _stat(answer, "acceptance").startswith("MTP acceptance")
        assert _stat(answer, "per-round").endswith("tok/round") and "prompt tokens reused" in _stat(answer, "cached")
    cached = int(answer.find_element("css selector", '[data-stat="cached"]').get_attribute("data-value"))
    assert cached > 0, "the second turn restored nothing from the prefix cache"

    # a long answer: sampled while it streams, then stopped mid-answer
    answer = _send(driver, "Write a long module with many functions and classes.", 1500)
    content = answer.find_element("css selector", ".content")
    samples = []

    def grew():
        text = content.text
        if answer.get_attribute("data-state") == "streaming" and text and (not samples or text != samples[-1]):
            samples.append(text)
        return len(samples) >= 3

    _until(grew, 60, "the answer to grow while streaming")
    assert len(samples[-1]) > len(samples[0]), samples
    assert _metrics(url)["ninfer_lanes_busy"] == 1
    cancelled = _metrics(url).get(CANCELLED, 0)
    _by(driver, "#stop")[0].click()
    _until(lambda: answer.get_attribute("data-state") == "stopped", 10, "the answer to show it stopped")
    m = _until(lambda: (m := _metrics(url))["ninfer_lanes_busy"] == 0 and m, 10, "/metrics to show the lane freed")
    assert m[CANCELLED] == cancelled + 1 and m["ninfer_state_slots_in_use"] == 0
    assert _stat(answer, "stopped").startswith("stopped after")
    shown = content.text
    time.sleep(0.5)
    assert content.text == shown, "the answer went on growing after stop"
    _until(lambda: _by(driver, '[data-field="lanes"]')[0].text == "lanes 0/2 busy", 10, "the strip to show 0 busy")

    shot = tmp_path / "chat.png"
    driver.save_screenshot(str(shot))
    print(f"\nchat page screenshot: {shot}")

    _by(driver, "#new-chat")[0].click()
    assert not _by(driver, "#conversation .msg") and _by(driver, "#empty")[0].is_displayed()
    answer = _send(driver, "Hello again.", 4)              # the new chat works and starts from an empty history
    _until(lambda: answer.get_attribute("data-state") == "done", 30, "the new chat's answer")
    assert len(_by(driver, "#conversation .msg")) == 2
    assert _page_errors(driver) == []


CANNED = r"""
const done = arguments[arguments.length - 1];
import("/ui/answer.js").then(({ AnswerView }) => {
  const box = document.getElementById("conversation");
  box.replaceChildren();
  const view = new AnswerView(box, 0);                 // sent at t = 0 ms, its deltas at t = 120 ms
  const deltas = [
    {role: "assistant", content: ""}, {reasoning_content: "The user wants **code**; "},
    {reasoning_content: "a list first."}, {content: "## Plan\n\n1. parse `argv`\n2. add\n   - nested"},
    {content: " item\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n"},
    {content: "See [docs](https://example.org/a_b) and [bad](javascript:alert(1)). <script>alert(1)</script> "},
    {content: "<img src=x onerror=alert(1)> *it* _em_ snake_case_name ~~old~~ **bold**"},
    {tool_calls: [{index: 0, id: "call_1", type: "function", function: {name: "get_weather", arguments: ""}}]},
    {tool_calls: [{index: 0, function: {arguments: "{\"city\": \"Pa"}}]},
    {tool_calls: [{index: 0, function: {arguments: "ris\"}"}}]},
  ];
  for (const d of deltas) view.apply(d, 120);
  view.finish("tool_calls");
  view.setUsage({prompt_tokens: 40, completion_tokens: 30, prompt_tokens_details: {cached_tokens: 32},
                 ninfer: {ttft_s: 0.05, decode_tok_s: 41.5, rounds: 12, drafted: 24, accepted: 17,
                          acceptance: 0.7083, tokens_per_round: 2.417}});
  view.end("done");
  const q = (s) => view.el.querySelector(s);
  done({
    state: view.el.dataset.state, summary: q(".reasoning summary").textContent, open: q(".reasoning").open,
    reasoning: q(".reasoning-text").textContent, h2: q("h2").textContent,
    items: [...view.el.querySelectorAll(".content ol > li")].map((li) => li.textContent),
    nested: q(".content ol ul li").textContent, inlineCode: q(".content li code").textContent,
    lang: q(".code-lang").textContent, code: q(".code pre code").textContent,
    cells: [...view.el.querySelectorAll("td")].map((td) => td.textContent),
    links: [...view.el.querySelectorAll(".content a")].map((a) => a.href),
    injected: view.el.querySelectorAll(".content script, .content img").length,
    em: [...view.el.querySelectorAll(".content em")].map((e) => e.textContent),
    strong: q(".content strong:last-of-type").textContent, del: q("del").textContent,
    tool: q(".tool-title code").textContent, args: JSON.parse(q(".tool-args").textContent),
    stats: [...view.el.querySelectorAll(".stat")].map((s) => s.textContent),
    message: view.message(),
  });
}).catch((err) => done({error: String(err)}));
"""


def test_markdown_reasoning_and_tool_calls_render(served, browser, tmp_path):
    driver = browser
    driver.get(served.url + "/")
    out = driver.execute_async_script(CANNED)
    assert "error" not in out, out
    assert out["state"] == "done" and out["open"] is False and out["summary"] == "Reasoning (7 words)"
    assert out["reasoning"] == "The user wants **code**; a list first."         # reasoning is shown as text
    assert out["h2"] == "Plan" and out["items"][0] == "parse argv" and out["inlineCode"] == "argv"
    assert out["nested"] == "nested item"
    assert out["lang"] == "python" and out["code"] == "def add(a, b):\n    return a + b"
    assert out["cells"] == ["1", "2"] and out["links"] == ["https://example.org/a_b"]
    assert out["injected"] == 0 and out["em"] == ["it", "em"] and out["strong"] == "bold" and out["del"] == "old"
    assert out["tool"] == "get_weather" and out["args"] == {"city": "Paris"}
    assert out["stats"] == ["tokens 30", "TTFT 120 ms", "41.5 tok/s", "MTP acceptance 71%", "2.42 tok/round",
                            "prefix cache 32/40 prompt tokens reused"]
    assert out["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    shot = tmp_path / "render.png"
    driver.save_screenshot(str(shot))
    print(f"\nrendered answer screenshot: {shot}")
    assert _page_errors(driver) == []


def test_wrong_api_key_reads_as_a_message(browser, tmp_path):
    srv = _serve("--api-key", KEY)
    try:
        driver = browser
        driver.get(srv.url + "/")
        panel = _until(lambda: (p := _by(driver, "#key-panel")[0]).is_displayed() and p, 15, "the key to be asked")
        key = _by(driver, "#key")[0]
        key.send_keys("wrong-key")
        panel.find_element("css selector", "button").click()
        error = _by(driver, "#key-error")[0]
        _until(lambda: "refused" in error.text, 10, "the wrong key's message")
        assert error.is_displayed() and "invalid API key" in error.text, error.text
        assert _page_errors(driver) == [], "a wrong key must read as a message in the page, not a console error"
        shot = tmp_path / "wrong-key.png"
        driver.save_screenshot(str(shot))
        print(f"\nwrong API key screenshot: {shot}")
        key.clear()
        key.send_keys(KEY)
        panel.find_element("css selector", "button").click()
        _until(lambda: not panel.is_displayed(), 10, "the key panel to close")
        answer = _send(driver, "Hi.", 4)
        _until(lambda: answer.get_attribute("data-state") == "done", 30, "an answer with the right key")
    finally:
        srv.close()
