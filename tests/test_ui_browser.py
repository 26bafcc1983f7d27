"""The chat page (serve.ui) in a real browser: Debian's headless Chromium, driven through its ChromeDriver by
selenium, against `serve --backend reference` (the CLI's build_server, uvicorn in a thread) on the shipped small
model with 2 lanes and 2 MTP drafts. A conversation streams token by token, a stop mid-answer frees the lane
(read from /metrics), a new chat empties the page; a canned answer checks the Markdown, reasoning and
tool-call rendering; a wrong API key is answered with a readable message in the page. With the tiny vision model
(test_serve_images' server, behind a spy on the request bodies) an attached image goes out as an image_url part,
shows in the transcript and is sent again on the next turn; files the page refuses, and an image the server
refuses, read as messages with nothing lost; a text model's page offers no attach button. Screenshots go to the
test's tmp folder (their paths are printed). Without chromium and chromedriver (tools/setup.sh installs them)
the browser tests skip, saying so; the page's routes are checked without a browser."""
from __future__ import annotations

import argparse
import base64
import json
import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import ninfer_gen  # noqa: E402
from ninfer_gen.cli.serve import add_serve_parser, build_server  # noqa: E402
from ninfer_gen.engine import Engine  # noqa: E402
from ninfer_gen.lanes.reference import ReferenceLanes  # noqa: E402
from ninfer_gen.serve.app import create_app  # noqa: E402
from tests.test_serve import Server  # noqa: E402
from tests.test_serve_images import CHAT, PNG, VL_SPEC, data_url, png  # noqa: E402

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
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"),
                       ("attach.js", "text/javascript"), ("style.css", "text/css")):
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


class _Spy:
    """The app behind an ASGI wrapper that keeps the JSON body of every chat completion: what the page sent."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        chunks = []

        async def tap():
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] == "http.request" and not message.get("more_body"):
                self.bodies.append(json.loads(b"".join(chunks)))
            return message

        await self.app(scope, tap, send)


@pytest.fixture(scope="module")
def vision_served():
    model = ninfer_gen.load(VL_SPEC)
    engine = Engine(ReferenceLanes.for_model(model, 1), lanes=1, max_queue=4)
    spy = _Spy(create_app(engine, model, served_model_name="vl", chat=CHAT))
    srv = Server(spy, engine)
    srv.model, srv.bodies = model, spy.bodies
    yield srv
    srv.close()


GIVE = """
const [how, name, type, b64, size] = arguments;        // a file dropped on the composer or pasted into the prompt
const bytes = b64 ? Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)) : new Uint8Array(size);
const files = new DataTransfer();
files.items.add(new File([bytes], name, {type}));
const init = {bubbles: true, cancelable: true};
document.getElementById(how === "drop" ? "composer" : "prompt").dispatchEvent(how === "drop"
  ? new DragEvent("drop", {...init, dataTransfer: files}) : new ClipboardEvent("paste", {...init, clipboardData: files}));
"""


def _prompt_tokens(answer) -> int:
    return int(answer.find_element("css selector", '[data-stat="tokens"]').get_attribute("title").split()[1])


def test_images_attach_send_resend_and_refuse(vision_served, browser, tmp_path):
    driver, srv = browser, vision_served
    models = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0).models.list()
    assert models.data[0].capabilities == {"vision": True}          # the extension survives the SDK's parsing
    driver.get(srv.url + "/")
    _until(lambda: _by(driver, "#attach")[0].is_displayed(), 15, "the attach button of a vision model")

    def thumbs():
        return _by(driver, "#attachments .thumb")

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    red.write_bytes(PNG)
    blue.write_bytes(png(40, 40, (0, 60, 200)))
    _by(driver, "#files")[0].send_keys(f"{red}\n{blue}")
    _until(lambda: len(thumbs()) == 2, 5, "two thumbnails")
    thumbs()[1].find_element("css selector", ".remove").click()
    assert len(thumbs()) == 1

    answer = _send(driver, "What is in the picture?", 2)
    _until(lambda: answer.get_attribute("data-state") == "done", 30, "the answer about the image")
    sent = srv.bodies[-1]["messages"]
    user = {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                        {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}
    assert sent == [user] and not thumbs()
    shown = _by(driver, "article.user .thumbs img")
    assert len(shown) == 1 and shown[0].get_attribute("src") == data_url(PNG) and shown[0].is_displayed()
    text_only = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
        "model": "vl", "max_tokens": 1, "messages": [{"role": "user", "content": [user["content"][0]]}]})
    text_only = text_only.json()["usage"]["prompt_tokens"]
    image_tokens = srv.model.prepare_images([PNG]).tokens[0]
    assert _prompt_tokens(answer) == text_only + image_tokens + 2        # the image's tokens, its start and end

    sent = len(srv.bodies)
    answer = _send(driver, "And now?", 2)                  # the stateless server gets the first image again
    _until(lambda: answer.get_attribute("data-state") == "done", 30, "the second answer")
    assert len(srv.bodies) == sent + 1
    assert srv.bodies[-1]["messages"][0] == user and srv.bodies[-1]["messages"][-1]["content"] == "And now?"

    # refused in the page: not an image, too large (dropped); an image pasted is attached
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    _by(driver, "#files")[0].send_keys(str(notes))
    error = _by(driver, "#attach-error")[0]
    _until(lambda: "notes.txt is not a PNG, JPEG, WebP, GIF or BMP image" in error.text, 5, "the refusal")
    assert error.is_displayed() and not thumbs()
    driver.execute_script(GIVE, "drop", "huge.png", "image/png", "", 21 * 2**20)
    _until(lambda: "huge.png is 21.0 MiB, over the 20 MiB limit" in error.text, 5, "the size refusal")
    broken = PNG[:60] + b"x" * 30
    driver.execute_script(GIVE, "paste", "broken.png", "image/png", base64.b64encode(broken).decode(), 0)
    _until(lambda: len(thumbs()) == 1 and not error.text, 5, "the pasted image's thumbnail")

    # refused by the server (a corrupt PNG): the 400 is shown, and the text and image are back in the composer
    answer = _send(driver, "Is this one broken?", 2)
    _until(lambda: answer.get_attribute("data-state") == "error", 30, "the bad image's error")
    message = answer.find_element("css selector", ".error").text
    assert "400" in message and "corrupt or truncated PNG" in message and "back in the composer" in message, message
    assert _by(driver, "#prompt")[0].get_attribute("value") == "Is this one broken?" and len(thumbs()) == 1
    shot = tmp_path / "images.png"
    driver.save_screenshot(str(shot))
    print(f"\nimages screenshot: {shot}")
    assert _page_errors(driver) == []


def test_text_model_offers_no_attach(served, browser):
    driver = browser
    assert httpx.get(served.url + "/v1/models", timeout=10).json()["data"][0]["capabilities"] == {"vision": False}
    driver.get(served.url + "/")
    _until(lambda: _by(driver, '[data-field="model"]')[0].text == "small", 15, "the model's name in the strip")
    assert not _by(driver, "#attach")[0].is_displayed() and "Text only" in _by(driver, "#vision-note")[0].text
    driver.execute_script(GIVE, "drop", "cat.png", "image/png", base64.b64encode(PNG).decode(), 0)
    assert "takes text only" in _by(driver, "#attach-error")[0].text and not _by(driver, "#attachments .thumb")
