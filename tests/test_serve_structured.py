"""Structured output through the HTTP server (serve.structured over engine.grammar): the shipped 21M-parameter
small model on the reference backend, driven with the official `openai` and `anthropic` SDKs. Under a
grammar it returns well-formed tool calls whose arguments validate against the tool's schema
(tool_choice "required" and a named function; Anthropic "any" and "tool") and JSON that validates against
a json_schema response format (chat, completions, the Responses API's text.format); streamed equals
non-streamed under greedy; what cannot be compiled or names an unknown tool is a 400 naming the field."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

import test_serve  # noqa: E402
from test_serve import KEY, NAME, TOOLS, _idle  # noqa: E402

# test_serve's fixtures, module-scoped: this module gets a server (small model, 2 lanes) and clients of its own
server, oai, claude = test_serve.server, test_serve.oai, test_serve.claude

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "days"]}
ARGS = TOOLS[0]["function"]["parameters"]


def _valid(instance, schema) -> None:
    try:
        import jsonschema
    except ImportError:                  # a hand check of the schemas used here
        assert isinstance(instance, dict) and set(schema.get("required", ())) <= set(instance)
        for key, value in instance.items():
            sub = schema["properties"][key]
            assert isinstance(value, {"string": str, "integer": int}[sub["type"]])
            assert len(value) <= sub.get("maxLength", 10 ** 9) if sub["type"] == "string" else \
                sub.get("minimum", -10 ** 18) <= value <= sub.get("maximum", 10 ** 18)
        return
    jsonschema.validate(instance, schema)


def _answer(text: str):
    return json.loads(text)         # the whole answer: no stop token's text after it


def test_chat_tool_choice_required_and_named(server, oai):
    required = oai.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=100, temperature=0)
    calls = required.choices[0].message.tool_calls
    assert calls, required.choices[0].message.content             # parallel calls allowed: ≥ 1, each complete
    for call in calls:
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        _valid(json.loads(call.function.arguments), ARGS)

    named = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = oai.chat.completions.create(**named)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1   # a named call: one
    call = choice.message.tool_calls[0]
    _valid(json.loads(call.function.arguments), ARGS)
    single = oai.chat.completions.create(**{**named, "tool_choice": "required", "parallel_tool_calls": False})
    assert [c.function.arguments for c in single.choices[0].message.tool_calls] == [call.function.arguments]

    chunks = list(oai.chat.completions.create(**named, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    _idle(server.engine)


def test_json_schema_response_format_chat_and_completions(server, oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    full = oai.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    _valid(_answer(choice.message.content), FORECAST)
    chunks = list(oai.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=60,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content

    # tools on "auto" beside the format: a call or the answer, never free text
    either = oai.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, response_format=fmt, max_tokens=60,
                                         temperature=0).choices[0].message
    if either.tool_calls:
        _valid(json.loads(either.tool_calls[0].function.arguments), ARGS)
    else:
        _valid(_answer(either.content), FORECAST)

    obj = oai.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                      max_tokens=6, temperature=0).choices[0].message.content
    assert obj.startswith("{")                                    # any object (this model does not close one)

    text = oai.completions.create(model=NAME, prompt="def fibonacci(n):", max_tokens=60, temperature=0,
                                  extra_body={"response_format": fmt}).choices[0].text
    _valid(_answer(text), FORECAST)

    # thinking asked for explicitly: the grammar lets a reasoning section come first
    thought = oai.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=8, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = thought.choices[0].message                          # (this model opens <think>, not "{")
    assert getattr(message, "reasoning_content", None) and not message.content
    _idle(server.engine)


def test_anthropic_tool_choice_any_and_tool(server, claude):
    tools = [{"name": "get_weather", "description": "weather of a city", "input_schema": ARGS}]
    anyone = claude.messages.create(model=NAME, max_tokens=100, messages=ASK, tools=tools, tool_choice={"type": "any"},
                                    extra_body={"temperature": 0})
    uses = [b for b in anyone.content if b.type == "tool_use"]
    assert uses and all(b.name == "get_weather" for b in uses)
    for block in uses:
        _valid(block.input, ARGS)

    named = dict(model=NAME, max_tokens=60, messages=ASK, tools=tools,
                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    msg = claude.messages.create(**named)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and msg.content[0].type == "tool_use"
    _valid(uses[0].input, ARGS)
    with claude.messages.stream(**named) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    assert final.stop_reason == "tool_use"
    _idle(server.engine)


def test_responses_text_format_and_tool_choice(server, oai):
    fmt = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    full = oai.responses.create(model=NAME, input="What is the weather in Paris?", text={"format": fmt},
                                max_output_tokens=60, temperature=0)
    assert full.status == "completed" and full.text.format.type == "json_schema"
    _valid(_answer(full.output_text), FORECAST)
    with oai.responses.stream(model=NAME, input="What is the weather in Paris?", text={"format": fmt},
                              max_output_tokens=60, temperature=0) as stream:
        assert stream.get_final_response().output_text == full.output_text

    tools = [{"type": "function", "name": "get_weather", "parameters": ARGS}]
    named = oai.responses.create(model=NAME, input="What is the weather in Paris?", tools=tools, max_output_tokens=60,
                                 temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in named.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    _valid(json.loads(calls[0].arguments), ARGS)
    _idle(server.engine)


def test_structured_output_errors_name_the_field(server):
    post = dict(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    base = {"model": NAME, "messages": ASK, "max_tokens": 4}

    def error(body, path="/v1/chat/completions"):
        r = httpx.post(server.url + path, json={**base, **body}, **post)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    e = error({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}})
    assert e["param"] == "response_format" and "foo" in e["message"]
    assert error({"response_format": {"type": "yaml"}})["param"] == "response_format.type"
    e = error({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert e["param"] == "tool_choice.function.name" and "get_weather" in e["message"]
    assert error({"tool_choice": "required"})["param"] == "tool_choice"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "format": "no-such-format"}}}}}]
    assert error({"tools": bad_tool, "tool_choice": "required"})["param"] == "tools"
    assert error({"prompt": "x", "messages": None, "response_format": {"type": "json_schema", "json_schema": {
        "schema": [1]}}}, "/v1/completions")["param"] == "response_format.json_schema.schema"

    r = httpx.post(server.url + "/v1/responses", json={"model": NAME, "input": "hi", "tools": [
        {"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, **post)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.name"

    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": NAME, "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "x"},
                         "tools": [{"name": "get_weather", "input_schema": ARGS}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "tool_choice.name" in r.json()["error"]["message"]
    _idle(server.engine)
