"""anthropic_api: the Anthropic Messages endpoints — `POST /v1/messages` (streamed as Anthropic's SSE
sequence message_start, content_block_start / content_block_delta / content_block_stop per block,
message_delta, message_stop; or one `message` object) and `POST /v1/messages/count_tokens`. Owns the
request's validation (a 400 `invalid_request_error` naming the field), its conversion to the chat
template's messages (system, text / image / tool_use / tool_result / thinking blocks, tools as functions,
`thinking` enabled/disabled as the template's enable_thinking; images in user messages: base64 sources, or url
ones with `serve --allow-image-urls`, serve.prompt), and the response's content blocks —
thinking, text, tool_use (its input streamed as input_json_delta) — with stop_reason end_turn /
max_tokens / stop_sequence / tool_use and usage.

`MessageBuilder` turns parser events (serve.parsing) into blocks and stream events; it is pure and tested
on canned model output. tool_choice "any" or a named tool is a grammar on the engine request
(serve.structured). Not here: documents, and images in tool results (400). Thinking blocks carry an empty
signature (there is nothing to sign)."""
from __future__ import annotations

import json

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer_gen.serve.core import (APIError, Generation, ServeState, bad_request, get, json_body, new_id,
                                   sampling_params, sse, stop_strings)
from ninfer_gen.serve.images import image_base64, image_part, image_url
from ninfer_gen.serve.parsing import (ContentDelta, OutputParser, ReasoningDelta, ToolCallArgumentsDelta,
                                      ToolCallEnd, ToolCallInvalid, ToolCallStart)
from ninfer_gen.serve.prompt import chat_prompt
from ninfer_gen.serve.structured import anthropic_tool_choice, constrained, thinking_for


def _text_blocks(content, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected a string or a list of text blocks", where)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"expected a text block, got {kind!r} (system prompts and tool results take text "
                              "blocks only here)", f"{where}[{i}]")
        parts.append(block["text"])
    return "".join(parts)


def _image(source, where: str):
    """An image block's source: base64 (media_type, data) or url (serve.images)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return image_base64(source.get("media_type"), source.get("data"), where)
    if kind == "url":
        return image_url(source.get("url"), where)
    raise bad_request(f"source.type: expected 'base64' or 'url', got {kind!r}", where)


def chat_messages(body: dict) -> list[dict]:
    """system + messages → the chat template's messages (tool results become `tool` messages; a user message with
    images keeps its blocks in order as parts, images as serve.images' parts)."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    messages = get(body, "messages", "array", required=True)
    if not messages:
        raise bad_request("at least one message is required", "messages")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad_request("expected an object", where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"role must be 'user' or 'assistant', got {role!r}", where + ".role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request("expected a string or a list of content blocks", where + ".content")
        text, calls, thinking, results, parts = [], [], [], [], []
        for j, block in enumerate(content):
            bw = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and role == "user":
                parts.append(image_part(_image(block.get("source"), bw)))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise bad_request("a tool_use block needs a name (string) and an input (object)", bw)
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request("this field is required", bw + ".tool_use_id")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _text_blocks(block.get("content", ""), bw + ".content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(block.get("thinking"), str):
                    thinking.append(block["thinking"])
            else:
                raise bad_request(f"a {kind!r} block is not supported in a {role} message here (text, image, "
                                  "tool_result in user messages; text, tool_use, thinking in assistant ones)",
                                  bw + ".type")
        if role == "user":
            out.extend(results)              # tool results answer the previous turn's calls first
            if len(parts) > len(text):       # images: the blocks in order, as parts
                out.append({"role": "user", "content": parts})
            elif text or not results:
                out.append({"role": "user", "content": "".join(text)})
        else:
            msg = {"role": "assistant", "content": "".join(text)}
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = get(body, "tools", "array")
    choice = get(body, "tool_choice", "object")
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise bad_request(f"expected type auto, any, tool or none, got {kind!r}", "tool_choice.type")
    if not tools or (choice or {}).get("type") == "none":
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request("a tool needs a name (string)", f"tools.{i}.name")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request("a tool needs an input_schema (JSON schema object)", f"tools.{i}.input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _thinking(body: dict) -> bool | None:
    value = get(body, "thinking", "object")
    if value is None:
        return None
    kind = value.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"expected 'enabled' or 'disabled', got {kind!r}", "thinking.type")
    return kind != "disabled"


async def _prompt(state: ServeState, body: dict):
    messages = chat_messages(body)
    tools = chat_tools(body)
    structured = anthropic_tool_choice(body.get("tool_choice"), tools)
    thinking = thinking_for(structured, _thinking(body))
    return await chat_prompt(state, messages, tools, thinking), tools, thinking, structured


# ---------------------------------------------------------------------------------------- builder


class MessageBuilder:
    """Parser events → content blocks. `events(parser_events)` gives the stream's block events (dicts,
    with their `type`), opening and closing blocks as the kind changes; `close()` ends the open block;
    `content` is the non-streamed message's content."""

    def __init__(self):
        self.content: list[dict] = []
        self.open: dict | None = None         # the open block: {"index", "kind", "call"}
        self.tool_uses = 0

    def _start(self, block: dict, kind: str, call: int | None = None) -> list[dict]:
        out = self.close()
        index = len(self.content)
        self.content.append(block)
        self.open = {"index": index, "kind": kind, "call": call}
        start = dict(block)
        if kind == "tool_use":
            start["input"] = {}
        return out + [{"type": "content_block_start", "index": index, "content_block": start}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open["index"], None
        return [{"type": "content_block_stop", "index": index}]

    def events(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, (ReasoningDelta, ContentDelta)):
                kind = "thinking" if isinstance(e, ReasoningDelta) else "text"
                if self.open is None or self.open["kind"] != kind:
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                       else {"type": "text", "text": ""}, kind)
                block = self.content[self.open["index"]]
                block[kind] += e.text
                delta = {"type": "thinking_delta", "thinking": e.text} if kind == "thinking" else \
                    {"type": "text_delta", "text": e.text}
                out.append({"type": "content_block_delta", "index": self.open["index"], "delta": delta})
            elif isinstance(e, ToolCallStart):
                out += self._start({"type": "tool_use", "id": new_id("toolu_"), "name": e.name, "input": {}},
                                   "tool_use", e.index)
            elif isinstance(e, ToolCallArgumentsDelta) and self.open and self.open["call"] == e.index:
                out.append({"type": "content_block_delta", "index": self.open["index"],
                            "delta": {"type": "input_json_delta", "partial_json": e.text}})
            elif isinstance(e, ToolCallEnd) and self.open and self.open["call"] == e.index:
                self.content[self.open["index"]]["input"] = e.call.arguments
                self.tool_uses += 1
                out += self.close()
            elif isinstance(e, ToolCallInvalid) and e.index is not None and self.open and self.open["call"] == e.index:
                self.content[self.open["index"]]["invalid"] = True      # dropped from the final content
                out += self.close()
        return out

    def message_content(self) -> list[dict]:
        return [b for b in self.content if not b.get("invalid")]


def stop_reason(finish: str, tool_uses: int) -> str:
    if finish == "length":
        return "max_tokens"
    if finish == "stop_sequence":
        return "stop_sequence"
    return "tool_use" if tool_uses else "end_turn"


# ---------------------------------------------------------------------------------------- endpoints


def router(state: ServeState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: HTTPRequest):
        body = await json_body(request)
        state.check_model(body.get("model"))
        prompt, _, _, _ = await _prompt(state, body)
        return {"input_tokens": len(prompt.ids)}

    @api.post("/v1/messages")
    async def messages(request: HTTPRequest):
        body = await json_body(request)
        state.check_model(body.get("model"))
        max_tokens = get(body, "max_tokens", "integer", required=True, minimum=1)
        stream = get(body, "stream", "boolean", default=False)
        sampling = sampling_params(get(body, "temperature", "number", maximum=1), get(body, "top_p", "number"),
                                   get(body, "top_k", "integer"), None)
        stop = stop_strings(body.get("stop_sequences"), "stop_sequences", most=64)
        chat, tools, thinking, structured = await _prompt(state, body)
        text, prompt = chat.text, chat.ids
        budget = state.prompt_budget(prompt, max_tokens, "max_tokens")
        mid = new_id("msg_")
        parser = OutputParser.for_prompt(text, thinking=thinking is not False, parse_tool_calls=bool(tools),
                                         tools=tools)
        gen = Generation(await constrained(state, structured, text, thinking), prompt, budget, sampling, stop, mid,
                         images=chat.images)
        builder = MessageBuilder()
        base = {"id": mid, "type": "message", "role": "assistant", "model": state.served_model_name}

        if not stream:
            out = await gen.text(request.is_disconnected)
            builder.events(parser.feed(out.text) + parser.finish())
            builder.close()
            return {**base, "content": builder.message_content(),
                    "stop_reason": stop_reason(out.finish, builder.tool_uses), "stop_sequence": out.stop_sequence,
                    "usage": {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
                              "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}}

        def event(obj: dict) -> str:
            return sse(json.dumps(obj, ensure_ascii=False), obj["type"])

        async def events():
            try:
                yield event({"type": "message_start", "message": {
                    **base, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}})
                last = None
                async for d in gen.deltas():
                    for obj in builder.events(parser.feed(d.text) + (parser.finish() if d.finish else [])):
                        yield event(obj)
                    last = d
                for obj in builder.close():
                    yield event(obj)
                yield event({"type": "message_delta",
                             "delta": {"stop_reason": stop_reason(last.finish, builder.tool_uses),
                                       "stop_sequence": last.stop_sequence},
                             "usage": {"output_tokens": gen.completion_tokens}})
                yield event({"type": "message_stop"})
            except Exception as err:             # the stream has begun: the error goes in it
                yield event({"type": "error", "error": {"type": "api_error", "message": f"{type(err).__name__}: {err}"}})
            finally:
                gen.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def error_body(err: APIError) -> dict:
    """Anthropic's error shape."""
    kind = {"bad_request": "invalid_request_error", "auth": "authentication_error", "not_found": "not_found_error",
            "rate_limit": "rate_limit_error", "internal": "api_error"}[err.kind]
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)
