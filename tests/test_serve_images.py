"""Images through the HTTP server (serve.images, serve.prompt and the three chat APIs): a real uvicorn server
(test_serve's Server) over the tiny vision model (model_specs/qwen3.8-tiny-vl.yaml, random weights, its tower
included) on the reference backend, with a Qwen3.5-style chat template (image parts →
<|vision_start|><|image_pad|><|vision_end|>), driven with the official `openai` and `anthropic` SDKs:
- an image_url data URL (chat), an input_image (Responses) and a base64 image block (Messages) answer, and each
  prompt counts the image: the text-only prompt's tokens + the image's tokens + its start and end tokens;
- the placeholder blocks of [text, image, text, image] sit in order with each image's own count;
- bad images (corrupt, 0×0, 20,000×20,000 declared, TIFF, ICO, bad base64, not an image type, too many, a
  remote URL without --allow-image-urls) answer 400 naming the problem, and leave no lane, slot or page held;
- with --allow-image-urls an http URL is fetched (a local server), a 404 and an oversized image are 400s naming
  the URL; a text model answers an image with 400 saying it has no vision tower; the serve flags reach the app."""
from __future__ import annotations

import asyncio
import base64
import http.server
import io
import struct
import threading
import zlib

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from PIL import Image  # noqa: E402

import ninfer_gen  # noqa: E402
from ninfer_gen.api import REPO, TINY_SPEC  # noqa: E402
from ninfer_gen.engine import Engine  # noqa: E402
from ninfer_gen.lanes.reference import ReferenceLanes  # noqa: E402
from ninfer_gen.serve.app import create_app  # noqa: E402
from ninfer_gen.serve.chat import ChatFormat  # noqa: E402
from ninfer_gen.serve.core import APIError, ServeState  # noqa: E402
from ninfer_gen.serve.images import ImageRef, image_part, image_url  # noqa: E402
from ninfer_gen.serve.prompt import chat_prompt  # noqa: E402
from ninfer_gen.serve.responses_api import ResponseStore  # noqa: E402
from ninfer_gen.vision.preprocess import ImageLimits  # noqa: E402
from test_serve import Server, _idle  # noqa: E402

VL_SPEC = REPO / "model_specs" / "qwen3.8-tiny-vl.yaml"
NAME = "vl"
MAX_IMAGES = 3
# Qwen3.5's content macro, cut down: image parts as the vision placeholder block, text parts as their text
TEMPLATE = """{%- macro content(c) -%}
{%- if c is string -%}{{- c -}}
{%- else -%}{%- for item in c -%}
{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif 'text' in item -%}{{- item.text -}}
{%- else -%}{{- raise_exception('Unexpected item type in content.') -}}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + content(m.content) + '<|im_end|>\\n' -}}{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""
CHAT = ChatFormat("qwen3.5-style test template", {"default": TEMPLATE})
TEXT = "What is in the picture?"


def png(width: int, height: int, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def header_png(width: int, height: int) -> bytes:
    """A PNG signature and IHDR declaring a size, no pixel data."""
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))


def encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16)).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


PNG = png(40, 40)                 # upscaled to the tiny tower's minimum: 64 image tokens


@pytest.fixture(scope="module")
def vl():
    model = ninfer_gen.load(VL_SPEC)
    engine = Engine(ReferenceLanes.for_model(model, 2), lanes=2, max_queue=8)
    srv = Server(create_app(engine, model, served_model_name=NAME, chat=CHAT,
                            image_limits=ImageLimits(max_images=MAX_IMAGES)), engine)
    srv.model = model
    yield srv
    srv.close()


def _free(engine) -> None:
    """No lane, slot or page held by a request (pages a prefix cache keeps are not a request's), none failed."""
    stats = _idle(engine)
    assert stats["pages_in_use"] == stats.get("pages_cached", 0), stats
    assert "error" not in stats["finished"], stats


def _tokens(srv, data: bytes) -> int:
    return srv.model.prepare_images([data]).tokens[0]


def test_openai_chat_and_responses_with_an_image(vl):
    client = openai.OpenAI(base_url=vl.url + "/v1", api_key="none", max_retries=0)
    picture = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    text = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": [{"type": "text", "text": TEXT}]}])
    image = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": TEXT}, picture]}])
    assert image.choices[0].finish_reason == "length" and image.usage.completion_tokens == 2
    n = _tokens(vl, PNG)
    assert n == 64 and image.usage.prompt_tokens == text.usage.prompt_tokens + n + 2     # + vision start and end

    stream = client.chat.completions.create(model=NAME, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, messages=[
                                                {"role": "user", "content": [picture, {"type": "text", "text": TEXT}]}])
    chunks = list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == image.usage.prompt_tokens

    out = client.responses.create(model=NAME, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": TEXT}, {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}]}])
    assert out.status == "incomplete" and out.usage.input_tokens == image.usage.prompt_tokens
    again = client.responses.create(model=NAME, max_output_tokens=2, previous_response_id=out.id, input="And now?")
    assert again.usage.input_tokens > out.usage.input_tokens + out.usage.output_tokens       # the image is still there
    _free(vl.engine)


def test_anthropic_message_with_a_base64_image(vl):
    client = anthropic.Anthropic(base_url=vl.url, api_key="none", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}
    text = client.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": TEXT}]}])
    image = client.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
        block, {"type": "text", "text": TEXT}]}])
    assert image.stop_reason == "max_tokens" and image.usage.output_tokens == 2

    def prompt(m):
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    assert prompt(image) == prompt(text) + _tokens(vl, PNG) + 2
    counted = client.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": [
        block, {"type": "text", "text": TEXT}]}])
    assert counted.input_tokens == prompt(image)
    _free(vl.engine)


def test_placeholders_in_conversation_order(vl):
    """[text, image, text, image] (and a second message's image): each image's block where its part was, the
    images in order, each with its own token count."""
    state = ServeState(engine=None, model=vl.model, chat=CHAT, served_model_name=NAME)
    small, wide = png(40, 40), png(300, 150, (0, 90, 200))
    messages = [{"role": "user", "content": [{"type": "text", "text": "A"}, image_part(image_url(data_url(small), "a")),
                                             {"type": "text", "text": "B"},
                                             image_part(image_url(data_url(wide), "b"))]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [image_part(image_url(data_url(small), "c"))]}]
    prompt = asyncio.run(chat_prompt(state, messages, None, None))
    v = vl.model.spec.vision
    counts = list(prompt.images.tokens)
    assert counts == [64, _tokens(vl, wide), 64] and counts[1] != 64
    assert prompt.text.count("<|vision_start|><|image_pad|><|vision_end|>") == 3
    ids, expected, at = prompt.ids, [], 0
    pieces = prompt.text.split("<|vision_start|><|image_pad|><|vision_end|>")
    for i, piece in enumerate(pieces):
        expected += state.encode(piece)
        if i < len(counts):
            expected += [v.vision_start_token_id] + [v.image_token_id] * counts[i] + [v.vision_end_token_id]
    assert ids == expected
    assert pieces[0].endswith("A") and pieces[1] == "B" and pieces[2].endswith("user\n")
    assert len(prompt.images.grids) == 3


def test_response_store_bounds_the_images_it_keeps():
    store = ResponseStore(size=8, image_bytes=100)

    def conversation(n: int) -> list[dict]:
        return [{"role": "user", "content": [image_part(ImageRef("input[0]", data=b"x" * n))]}]

    store.put({"id": "a"}, conversation(60))
    store.put({"id": "b"}, [{"role": "user", "content": "text only"}])
    store.put({"id": "c"}, conversation(60))         # 120 bytes held: the least recently used goes
    assert store.get("c") and store.get("b")
    with pytest.raises(APIError, match="no stored response"):
        store.get("a")
    store.put({"id": "d"}, conversation(500))        # alone over the budget: kept (the newest always is)
    assert store.get("d")
    for gone in ("b", "c"):
        with pytest.raises(APIError):
            store.get(gone)


BAD = [      # (content part, words the 400 must hold)
    ({"type": "image_url", "image_url": {"url": data_url(PNG[:60] + b"x" * 30)}}, "corrupt or truncated PNG"),
    ({"type": "image_url", "image_url": {"url": data_url(header_png(0, 0))}}, "0×0 pixels"),
    ({"type": "image_url", "image_url": {"url": data_url(header_png(20000, 20000))}}, "20000×20000"),
    ({"type": "image_url", "image_url": {"url": data_url(encoded("TIFF"), "image/tiff")}},
     "format TIFF is not supported"),
    ({"type": "image_url", "image_url": {"url": data_url(encoded("ICO"))}}, "format ICO is not supported"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": data_url(PNG, "text/plain")}}, "is not an image"),
    ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, "unsupported image URL"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "--allow-image-urls"),
]


def test_bad_images_are_400s_and_free_everything(vl):
    with httpx.Client(base_url=vl.url, timeout=60) as client:
        for part, words in BAD:
            r = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": TEXT}, part]}]})
            assert r.status_code == 400, (words, r.text)
            error = r.json()["error"]
            assert words in error["message"] and error["param"] == "messages[0].content[1]", (words, error)
        many = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}] * (MAX_IMAGES + 1)
        r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": many}]})
        assert r.status_code == 400 and f"limit of {MAX_IMAGES}" in r.json()["error"]["message"]
        r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(header_png(0, 0)).decode()}}]}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "messages.0.content.0" in r.json()["error"]["message"] and "0×0" in r.json()["error"]["message"]
        r = client.post("/v1/responses", json={"model": NAME, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://example.com/a.png"}]}]})
        assert r.status_code == 400 and "--allow-image-urls" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}]})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"      # still serving
    _free(vl.engine)


class _Images(http.server.BaseHTTPRequestHandler):
    files = {"/cat.png": PNG, "/big.png": png(64, 64) + b"\0" * 8192}

    def do_GET(self):
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()                     # no Content-Length: the byte limit holds while reading
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_image_urls_fetched_when_allowed(vl):
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    srv = Server(create_app(vl.engine, vl.model, served_model_name=NAME, chat=CHAT, allow_image_urls=True,
                            image_limits=ImageLimits(max_bytes=4096)), vl.engine)      # the engine runs already
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        out = client.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": base + "/cat.png"}}, {"type": "text", "text": TEXT}]}])
        assert out.stop_reason == "max_tokens"
        with httpx.Client(base_url=srv.url, timeout=60) as http_client:
            for path, words in (("/missing.png", "HTTP 404"), ("/big.png", "limit of 4,096 bytes")):
                part = {"type": "image_url", "image_url": {"url": base + path}}
                r = http_client.post("/v1/chat/completions", json={"model": NAME, "messages": [
                    {"role": "user", "content": [part]}]})
                assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
                assert base + path in r.json()["error"]["message"]
    finally:
        srv.close()
        files.shutdown()
    _free(vl.engine)


def test_text_model_refuses_images():
    model = ninfer_gen.load(TINY_SPEC)
    engine = Engine(ReferenceLanes.for_model(model, 1), lanes=1, max_queue=2)
    srv = Server(create_app(engine, model, served_model_name="tiny", chat=CHAT), engine)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}]})
        assert r.status_code == 400 and "has no vision tower" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[0]"
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": TEXT}]})
        assert r.status_code == 200
        _free(engine)
    finally:
        srv.close()


def test_serve_image_flags():
    from ninfer_gen.cli import serve as cli
    from ninfer_gen.cli.main import build_parser

    assert (cli.MAX_IMAGES, cli.MAX_IMAGE_PIXELS) == (ImageLimits().max_images, ImageLimits().max_input_pixels)
    parse = build_parser().parse_args
    app, _, _ = cli.build_server(parse(["serve", "--weights", str(VL_SPEC), "--lanes", "1", "--max-images", "2",
                                        "--max-image-pixels", "1000000", "--allow-image-urls"]))
    state = app.state.serve
    assert state.image_limits == ImageLimits(max_images=2, max_input_pixels=1000000) and state.allow_image_urls
    assert not parse(["serve"]).allow_image_urls
    for flags in (["--max-images", "0"], ["--max-image-pixels", "100000000"]):
        with pytest.raises(ValueError, match=flags[0]):
            cli.build_server(parse(["serve", *flags]))
