"""The Responses API (ninfer_gen.serve.responses_api) end to end: a real uvicorn server (test_serve's fixtures)
over the shipped small model on the reference backend (2 lanes), driven with the official `openai` SDK unmodified —
`responses.create`, `responses.create(stream=True)`, `responses.stream`, `retrieve`, `delete` — and raw
httpx, whose JSON and SSE events are validated against the SDK's own pydantic types. The small model never
ends its turn within a short budget and emits no tool-call markup, so completed responses, reasoning and
function calls are also tested on canned model output through ResponseBuilder, served to the SDK's stream
helper over a mock transport."""
from __future__ import annotations

import json

import pydantic
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ninfer_gen.serve.parsing import OutputParser  # noqa: E402
from ninfer_gen.serve.responses_output import ResponseBuilder  # noqa: E402
import test_serve  # noqa: E402
from test_serve import CANNED, KEY, NAME, TOOLS, _idle  # noqa: E402

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

ASK = "Write a Python function that adds two numbers."
FN_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]          # the Responses API's flat function tools
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
HEADERS = {"Authorization": f"Bearer {KEY}"}
server, oai = test_serve.server, test_serve.oai     # test_serve's fixtures (module scope: this module's own server)


def _sse(response) -> list[dict]:
    """A raw SSE body's events, each checked: its `event:` line names its type, the SDK's types accept it."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            obj = json.loads(line[6:])
            assert obj["type"] == name
            EVENTS.validate_python(obj)
            events.append(obj)
    return events


def test_responses_stream_equals_non_stream(server, oai):
    args = dict(model=NAME, input=ASK, instructions="You are terse.", max_output_tokens=8, temperature=0)
    full = oai.responses.create(**args)
    assert full.id.startswith("resp_") and full.object == "response" and full.model == NAME
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in full.output] == ["message"] and full.output[0].id.startswith("msg_")
    assert full.output_text and full.usage.output_tokens == 8 and full.usage.input_tokens > 10
    assert full.usage.total_tokens == full.usage.input_tokens + 8 and full.instructions == "You are terse."

    with oai.responses.stream(**args) as stream:                   # the SDK's stream helper
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.output_text == full.output_text and events[-1].response.usage.output_tokens == 8

    streamed = list(oai.responses.create(**args, stream=True))     # create(stream=True): the raw event stream
    assert streamed[-1].response.output_text == full.output_text and len({e.response.id for e in streamed
                                                                         if hasattr(e, "response")}) == 1

    raw = httpx.post(server.url + "/v1/responses", headers=HEADERS, json={**args, "stream": False})
    Response.model_validate(raw.json())                            # the wire shape, strictly
    with httpx.stream("POST", server.url + "/v1/responses", headers=HEADERS, json={**args, "stream": True},
                      timeout=60) as r:
        wire = _sse(r)
    assert wire[-1]["response"]["output"][0]["content"][0]["text"] == full.output_text
    _idle(server.engine)


def test_previous_response_id_continues_the_conversation(server, oai):
    first = oai.responses.create(model=NAME, instructions="You are terse.", max_output_tokens=6, temperature=0,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    second = oai.responses.create(model=NAME, previous_response_id=first.id, input="Now subtract them.",
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    # the same conversation replayed by hand — first's output items as input, its instructions not carried
    replay = oai.responses.create(model=NAME, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "Now subtract them."}])
    assert replay.usage.input_tokens == second.usage.input_tokens > first.usage.input_tokens + 6
    assert replay.output_text == second.output_text

    assert oai.responses.retrieve(first.id).output_text == first.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model=NAME, previous_response_id=first.id, input="again", max_output_tokens=2)
    body = err.value.body
    assert err.value.status_code == 404 and body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found" and first.id in body["message"]

    unstored = oai.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    _idle(server.engine)


def test_function_call_items_render_as_chat_tool_messages(server, oai):
    """function_call / function_call_output / reasoning items give the prompt the chat template gives the
    same turns as an assistant tool call and a tool message: equal input token counts."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    out = oai.responses.create(model=NAME, input=items, tools=FN_TOOLS, max_output_tokens=3, temperature=0)
    assert out.tools[0].name == "get_weather" and out.status == "incomplete"
    chat = oai.chat.completions.create(model=NAME, tools=TOOLS, max_tokens=1, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    _idle(server.engine)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),                  # no tools to call
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
])
def test_invalid_requests_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", headers=HEADERS, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error"


# ----------------------------------------------------------------- canned model output


def _canned_events(builder: ResponseBuilder, text: str, step: int, status="completed") -> list[dict]:
    parser = OutputParser(tools=TOOLS)
    events = []
    for i in range(0, len(text), step):
        events += builder.events(parser.feed(text[i:i + step]))
    return events + builder.events(parser.finish()) + builder.close(status)


def _response(output: list[dict], status: str) -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": NAME, "output": output, "status": status,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": FN_TOOLS, "error": None,
            "incomplete_details": None, "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0}


def test_response_builder_on_canned_output():
    whole = ResponseBuilder()
    _canned_events(whole, CANNED, len(CANNED))
    parsed = Response.model_validate(_response(whole.output(), "completed"))
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call"]
    assert parsed.output[0].content[0].text == "The user wants the weather." and parsed.output_text == "Let me check."
    call = parsed.output[2]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert whole.message()["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}

    # streamed a character at a time, served to the SDK's stream helper: the same final response
    stream = ResponseBuilder()
    events = [{"type": "response.created", "response": _response([], "in_progress")},
              *_canned_events(stream, CANNED, 1),
              {"type": "response.completed", "response": _response(stream.output(), "completed")}]
    body = "".join(f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n"
                   for i, e in enumerate(events))
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=body.encode()))
    client = openai.OpenAI(base_url="http://canned/v1", api_key="k", http_client=httpx.Client(transport=transport))
    with client.responses.stream(model=NAME, input="hi", tools=FN_TOOLS) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 3 and "response.reasoning_text.delta" in kinds
    assert final.output_text == "Let me check." and json.loads(final.output[2].arguments) == {"city": "Paris",
                                                                                              "days": 2}
    for i, e in enumerate(events):
        EVENTS.validate_python({**e, "sequence_number": i})

    broken = ResponseBuilder()            # malformed markup: announced, closed incomplete, left out; text follows
    events = _canned_events(broken, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {oops}}\n</tool_call>", 3)
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete",
                                                                                                 "completed"]
    assert [item["type"] for item in broken.output()] == ["message"] and "tool_calls" not in broken.message()
