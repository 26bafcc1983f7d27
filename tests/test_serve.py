"""The HTTP server (ninfer_gen.serve.app) end to end: a real uvicorn server in a background thread on a free
port, the shipped small model on the reference backend (CPU), 2 lanes, driven with the official `openai`
and `anthropic` SDKs unmodified (and raw httpx for the wire shapes). The tool-call path is also tested on
canned model output through the response builders, because the 21M-parameter small model does not emit
tool-call markup by itself (structured output, which would force it, is not implemented yet)."""
from __future__ import annotations

import json
import socket
import threading
import time

import pydantic
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

import ninfer_gen  # noqa: E402
from ninfer_gen.engine import Engine  # noqa: E402
from ninfer_gen.lanes.reference import ReferenceLanes  # noqa: E402
from ninfer_gen.api import DEFAULT_MODEL, TINY_SPEC  # noqa: E402
from ninfer_gen.serve.anthropic_api import MessageBuilder, stop_reason  # noqa: E402
from ninfer_gen.serve.app import create_app  # noqa: E402
from ninfer_gen.serve.openai_api import ChatBuilder  # noqa: E402
from ninfer_gen.serve.parsing import OutputParser  # noqa: E402

NAME = "small"
KEY = "test-key"
GREEDY = {"temperature": 0}        # this anthropic SDK has no temperature argument; the API field still exists
USER = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]


class Server:
    def __init__(self, app, engine):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.engine = engine
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def _idle(engine, timeout=10.0):
    """Waits until no lane is busy and the queue is empty (requests end asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["lanes_busy"] == 0 and s["queue_depth"] == 0 and s["slots_in_use"] == 0:
            return s
        time.sleep(0.02)
    raise AssertionError(f"the engine is not idle: {engine.stats()}")


@pytest.fixture(scope="module")
def server():
    model = ninfer_gen.load(DEFAULT_MODEL)
    engine = Engine(ReferenceLanes.for_model(model, 2), lanes=2, max_queue=8)
    srv = Server(create_app(engine, model, served_model_name=NAME, api_key=KEY, model_folder=DEFAULT_MODEL), engine)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def test_health_and_models(server, oai):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["lanes"] == 2
    models = oai.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_chat_completion_stream_equals_non_stream(server, oai):
    full = oai.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == NAME
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(oai.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and len({c.id for c in chunks}) == 1

    # a conversation with every role, an earlier tool call and its result renders and runs
    convo = [{"role": "system", "content": "You are terse."}, *USER,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = oai.chat.completions.create(model=NAME, messages=convo, tools=TOOLS, max_tokens=4, temperature=0.7, seed=1,
                                      top_p=0.9)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls") and out.usage.completion_tokens >= 1
    _idle(server.engine)


def test_stop_strings(server, oai):
    base = oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=12, temperature=0).choices[0]
    assert base.finish_reason == "length" and len(base.text) > 4
    stop = base.text[3:5]
    cut = oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base.text[:base.text.index(stop)]
    streamed = oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                                      stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    _idle(server.engine)


def test_completions(server, oai):
    full = oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    chunks = list(oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=8, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_messages_stream_and_non_stream(server, claude):
    msg = claude.messages.create(model=NAME, max_tokens=8, system="You are terse.", messages=USER,
                                 extra_body=GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    assert msg.content and msg.content[0].type == "text"
    with claude.messages.stream(model=NAME, max_tokens=8, system="You are terse.", messages=USER,
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [b.text for b in final.content] == [b.text for b in msg.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8

    count = claude.messages.count_tokens(model=NAME, system="You are terse.", messages=USER)
    assert count.input_tokens == msg.usage.input_tokens

    # tool_use / tool_result blocks and tools render and run
    convo = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                       "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    tools = [{"name": "get_weather", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    out = claude.messages.create(model=NAME, max_tokens=4, messages=convo, tools=tools, stop_sequences=["\n\n"])
    assert out.stop_reason in ("max_tokens", "end_turn", "stop_sequence", "tool_use")
    _idle(server.engine)


def test_auth_and_invalid_requests(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as aerr:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=2, messages=USER)
    assert aerr.value.status_code == 401
    assert aerr.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": aerr.value.body["error"]["message"]}}

    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                   json={"model": NAME, "messages": [{"role": "bot", "content": "hi"}]})
    assert r.status_code == 400
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["param"] == "messages[0].role"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                   json={"model": NAME, "messages": USER, "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                   json={"model": NAME, "messages": USER, "max_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, json={"model": "gpt-x", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={"model": NAME, "messages": USER})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
                       {"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "messages.0.content.0" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"         # still serving


def test_queue_full_and_disconnect_cancels():
    model = ninfer_gen.load(TINY_SPEC)
    engine = Engine(ReferenceLanes.for_model(model, 1), lanes=1, max_queue=0)
    from ninfer_gen.serve.chat import ChatFormat
    srv = Server(create_app(engine, model, served_model_name="tiny", chat=ChatFormat("none", {})), engine)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3],
                                                                "max_tokens": 400, "stream": True}) as long:
                assert long.status_code == 200
                lines = long.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))     # it is generating
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": USER})
                assert r.status_code == 400      # no chat template: refused before the queue, in Anthropic's shape
                assert r.json()["error"]["type"] == "invalid_request_error"
            # the client closed the stream: the request is cancelled and its lane, slot and pages freed (but the
            # page its prompt's prefix checkpoint pins)
            stats = _idle(engine)
            assert stats["finished"].get("cancelled") == 1 and stats["pages_in_use"] == stats["pages_cached"]
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        srv.close()


# ----------------------------------------------------------------- tool calls on canned model output

CANNED = ("<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
          "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>")


def _events(text, step):
    parser = OutputParser(tools=TOOLS)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish()


def test_chat_builder_tool_calls_on_canned_output():
    whole = ChatBuilder()
    whole.deltas(_events(CANNED, len(CANNED)))
    message = whole.message()
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": NAME,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}]}
    parsed = openai.types.chat.ChatCompletion.model_validate(body)          # the SDK's own type
    call = parsed.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert message["reasoning_content"] == "The user wants the weather." and message["content"] == "Let me check."

    stream = ChatBuilder()                          # streamed a character at a time: the same call, arguments pieced
    deltas = stream.deltas(_events(CANNED, 1))
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert len(calls) > 3 and json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris",
                                                                                                "days": 2}
    for d in deltas:
        openai.types.chat.ChatCompletionChunk.model_validate(
            {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": NAME,
             "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
    assert stream.message() == {**message, "tool_calls": [{**message["tool_calls"][0],
                                                           "id": stream.message()["tool_calls"][0]["id"]}]}


def test_message_builder_tool_use_on_canned_output():
    whole = MessageBuilder()
    whole.events(_events(CANNED, len(CANNED)))
    whole.close()
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": NAME, "content": whole.message_content(),
            "stop_reason": stop_reason("stop", whole.tool_uses), "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}
    msg = anthropic.types.Message.model_validate(body)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[2].input == {"city": "Paris", "days": 2} and msg.content[2].id.startswith("toolu_")

    stream = MessageBuilder()
    events = stream.events(_events(CANNED, 1)) + stream.close()
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["content_block"]["type"] for e in starts] == ["thinking", "text", "tool_use"]
    assert sum(e["type"] == "content_block_stop" for e in events) == 3
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 2}
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)     # the SDK's own event types
    for e in events:
        adapter.validate_python(e)

    broken = MessageBuilder()                     # malformed markup: text, never a tool_use, never an exception
    broken.events(_events("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {oops}}\n</tool_call>", 3))
    broken.close()
    assert all(b["type"] == "text" for b in broken.message_content()) and broken.tool_uses == 0
