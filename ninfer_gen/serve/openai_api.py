"""openai_api: the OpenAI-compatible endpoints — `POST /v1/chat/completions` and `POST /v1/completions`,
streamed (SSE `chat.completion.chunk` / `text_completion` objects, then `data: [DONE]`) and not: request
validation (a 400 naming the field for what is malformed or not supported here), the conversion to a
prompt (the checkpoint's chat template, tools, `chat_template_kwargs.enable_thinking`, `image_url` parts of
user messages: data URLs, or http(s) URLs with `serve --allow-image-urls`; serve.prompt) and to an engine
request, and the responses in OpenAI's shapes — reasoning as `reasoning_content`, Qwen tool-call markup
as `tool_calls` (arguments streamed as the model writes them), usage (with a field of ours, `usage.ninfer`:
the engine's TTFT, decode speed, MTP rounds and acceptance), ids, finish_reason stop / length / tool_calls.

`ChatBuilder` turns parser events (serve.parsing) into the message or the stream's deltas; it is pure and
tested on canned model output. Structured output (response_format json_schema / json_object, tool_choice
"required" or a named function) is a grammar on the engine request (serve.structured). Not here: the
Responses API, n > 1, logprobs.

A streamed tool call is sent as soon as it starts; if its markup then turns out malformed, the parser
returns the markup as content and the call's deltas already sent cannot be taken back (OpenAI's stream
has no retraction): the final chunk's finish_reason is then "stop", not "tool_calls"."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer_gen.serve.core import (APIError, Generation, ServeState, bad_request, get, json_body, new_id,
                                   sampling_params, sse, stop_strings)
from ninfer_gen.serve.images import image_part, image_url
from ninfer_gen.serve.parsing import (ContentDelta, OutputParser, ReasoningDelta, ToolCallArgumentsDelta,
                                      ToolCallEnd, ToolCallInvalid, ToolCallStart)
from ninfer_gen.serve.prompt import chat_prompt
from ninfer_gen.serve.structured import (Structured, constrained, openai_tool_choice, response_format, thinking_for,
                                         with_answer)

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields OpenAI defines that this server does not implement: answered 400 naming the field when they ask
# for something other than the default
_UNSUPPORTED = {"n": 1, "logprobs": False, "top_logprobs": None, "audio": None, "prediction": None,
                "logit_bias": None, "best_of": 1, "echo": False, "suffix": None}


def _refuse_unsupported(body: dict, names) -> None:
    for name in names:
        value, default = body.get(name), _UNSUPPORTED[name]
        if value is not None and value != {} and (type(value) is not type(default) or value != default):  # True ≠ 1
            raise bad_request(f"{name}={json.dumps(value)} is not supported by this server", name)


def _content(content, where: str, allow_none: bool = False, images: bool = False):
    """A message's content as the template takes it: a string, or a list of text parts — and, with `images`
    (user messages), image parts (serve.images) for `image_url` parts."""
    if content is None:
        if allow_none:
            return None
        raise bad_request("this field is required", where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected a string or a list of content parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url" and images:
            url = part.get("image_url")
            parts.append(image_part(image_url(url.get("url") if isinstance(url, dict) else url, f"{where}[{i}]")))
            continue
        if kind != "text":
            why = "images go in user messages only" if kind == "image_url" else \
                f"only text{' and image_url' if images else ''} parts are taken here"
            raise bad_request(f"content part of type {kind!r}: {why}", f"{where}[{i}]")
        if not isinstance(part.get("text"), str):
            raise bad_request("expected a string", f"{where}[{i}].text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_messages(body: dict) -> list[dict]:
    """The request's messages, checked, in the shape chat templates read (tool-call arguments as objects; images
    as serve.images' parts, which serve.prompt turns into the template's)."""
    messages = get(body, "messages", "array", required=True)
    if not messages:
        raise bad_request("at least one message is required", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request("expected an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"role must be one of {', '.join(ROLES)}, got {role!r}", where + ".role")
        msg = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls") if role == "assistant" else None
        msg["content"] = _content(m.get("content"), where + ".content", allow_none=role == "assistant" and bool(calls),
                                  images=role == "user")
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request("expected a string", where + ".reasoning_content")
                msg["reasoning_content"] = reasoning
            if calls is not None:
                if not isinstance(calls, list):
                    raise bad_request("expected a list", where + ".tool_calls")
                msg["tool_calls"] = [_tool_call_in(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str):
                raise bad_request("a tool message needs the tool_call_id (string) it answers", where + ".tool_call_id")
            msg["tool_call_id"] = tcid
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_call_in(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise bad_request(f"not valid JSON: {err}", where + ".function.arguments") from None
    if not isinstance(args, dict):
        raise bad_request("must be a JSON object", where + ".function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def chat_tools(body: dict) -> list[dict] | None:
    """The request's tools (None: none, or tool_choice "none"; serve.structured reads the other choices)."""
    tools = get(body, "tools", "array")
    choice = body.get("tool_choice")
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request("expected {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("a function name (string) is required", f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request("expected a JSON schema object", f"tools[{i}].function.parameters")
    return None if choice == "none" else tools


def _enable_thinking(body: dict) -> bool | None:
    kwargs = get(body, "chat_template_kwargs", "object", default={})
    value = kwargs.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise bad_request("expected a boolean", "chat_template_kwargs.enable_thinking")
    return value


def _usage(gen: Generation) -> dict:
    usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
             "total_tokens": gen.prompt_tokens + gen.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}
    if gen.stats is not None:     # ours, beside OpenAI's fields (SDKs keep unknown ones): the chat page's stats
        s = gen.stats
        usage["ninfer"] = {"ttft_s": s.ttft_s, "decode_tok_s": round(s.decode_tok_s, 2), "rounds": s.rounds,
                           "drafted": s.drafted, "accepted": s.accepted, "acceptance": round(s.acceptance, 4),
                           "tokens_per_round": round(s.tokens_per_round, 3)}
    return usage


def _finish(reason: str, tool_calls: bool = False) -> str:
    if reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _stream_usage(body: dict) -> bool:
    options = get(body, "stream_options", "object", default={})
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad_request("expected a boolean", "stream_options.include_usage")
    return value


def _error_chunk(err: BaseException) -> str:
    return sse(json.dumps({"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error",
                                     "param": None, "code": None}}))


# ---------------------------------------------------------------------------------------- builders


class ChatBuilder:
    """Parser events → OpenAI chat output: `deltas(events)` gives the stream's `delta` objects, and
    after all events `message()` the non-streamed message. Tool calls get ids `call_…`."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, dict] = {}          # parser index → {"id", "name", "arguments"}
        self.done: list[int] = []                 # indices of the calls that closed
        self.dropped: set[int] = set()

    def deltas(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                self.reasoning.append(e.text)
                out.append({"reasoning_content": e.text})
            elif isinstance(e, ContentDelta):
                self.content.append(e.text)
                out.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
                call = self.calls[e.index] = {"id": new_id("call_"), "name": e.name, "arguments": []}
                out.append({"tool_calls": [{"index": self._position(e.index), "id": call["id"], "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArgumentsDelta):
                self.calls[e.index]["arguments"].append(e.text)
                out.append({"tool_calls": [{"index": self._position(e.index),
                                            "function": {"arguments": e.text}}]})
            elif isinstance(e, ToolCallEnd):
                self.calls[e.index]["arguments"] = [e.call.arguments_json]
                self.done.append(e.index)
            elif isinstance(e, ToolCallInvalid) and e.index is not None:
                self.dropped.add(e.index)
        return out

    def _position(self, index: int) -> int:
        return sorted(self.calls).index(index)

    def tool_calls(self) -> list[dict]:
        return [{"id": self.calls[i]["id"], "type": "function",
                 "function": {"name": self.calls[i]["name"], "arguments": "".join(self.calls[i]["arguments"])}}
                for i in self.done]

    def message(self) -> dict:
        calls = self.tool_calls()
        content = "".join(self.content)
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if calls:
            msg["tool_calls"] = calls
        return msg


# ---------------------------------------------------------------------------------------- endpoints


def router(state: ServeState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await json_body(request)
        state.check_model(body.get("model"))
        _refuse_unsupported(body, ("n", "logprobs", "top_logprobs", "audio", "prediction", "logit_bias"))
        messages = chat_messages(body)
        tools = chat_tools(body)
        structured = with_answer(openai_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls")),
                                 response_format(body.get("response_format")))
        thinking = thinking_for(structured, _enable_thinking(body))
        stream = get(body, "stream", "boolean", default=False)
        include_usage = _stream_usage(body) if stream else False
        max_tokens = get(body, "max_completion_tokens", "integer", minimum=1)
        if max_tokens is None:
            max_tokens = get(body, "max_tokens", "integer", minimum=1)
        sampling = sampling_params(get(body, "temperature", "number"), get(body, "top_p", "number"),
                                   get(body, "top_k", "integer"), get(body, "seed", "integer"))
        stop = stop_strings(body.get("stop"), "stop")
        chat = await chat_prompt(state, messages, tools, thinking)
        prompt_text, prompt = chat.text, chat.ids
        budget = state.prompt_budget(prompt, max_tokens, "max_tokens" if "max_tokens" in body
                                     else "max_completion_tokens")
        rid, created = new_id("chatcmpl-"), int(time.time())
        parser = OutputParser.for_prompt(prompt_text, thinking=thinking is not False, parse_tool_calls=bool(tools),
                                         tools=tools)
        gen = Generation(await constrained(state, structured, prompt_text, thinking), prompt, budget, sampling,
                         stop, rid, images=chat.images)
        builder = ChatBuilder()

        if not stream:
            out = await gen.text(request.is_disconnected)
            builder.deltas(parser.feed(out.text) + parser.finish())
            return {"id": rid, "object": "chat.completion", "created": created, "model": state.served_model_name,
                    "choices": [{"index": 0, "message": builder.message(), "logprobs": None,
                                 "finish_reason": _finish(out.finish, bool(builder.done))}],
                    "usage": _usage(gen)}

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices=True) -> str:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.served_model_name,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices
                   else []}
            if include_usage:
                obj["usage"] = usage
            return sse(json.dumps(obj, ensure_ascii=False))

        async def events():
            try:
                yield chunk({"role": "assistant", "content": ""})
                finish = "stop"
                async for d in gen.deltas():
                    for delta in builder.deltas(parser.feed(d.text) + (parser.finish() if d.finish else [])):
                        yield chunk(delta)
                    finish = d.finish or finish
                yield chunk({}, _finish(finish, bool(builder.done)))
                if include_usage:
                    yield chunk({}, usage=_usage(gen), choices=False)
            except Exception as err:                 # the stream has begun: the error goes in it
                yield _error_chunk(err)
            finally:
                gen.cancel()                         # a client that went away: free the lane now
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await json_body(request)
        state.check_model(body.get("model"))
        _refuse_unsupported(body, ("n", "logprobs", "best_of", "echo", "suffix", "logit_bias"))
        prompt = _completion_prompt(state, body.get("prompt"))
        stream = get(body, "stream", "boolean", default=False)
        include_usage = _stream_usage(body) if stream else False
        max_tokens = get(body, "max_tokens", "integer", minimum=1, default=16)
        sampling = sampling_params(get(body, "temperature", "number"), get(body, "top_p", "number"),
                                   get(body, "top_k", "integer"), get(body, "seed", "integer"))
        stop = stop_strings(body.get("stop"), "stop")
        budget = state.prompt_budget(prompt, max_tokens, "max_tokens", prompt_param="prompt")
        rid, created = new_id("cmpl-"), int(time.time())
        structured = with_answer(Structured(), response_format(body.get("response_format")))
        gen = Generation(await constrained(state, structured, "", None), prompt, budget, sampling, stop, rid)

        def obj(text: str, finish: str | None, usage: dict | None = None, choices=True) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}] if choices
                   else []}
            if usage is not None or (stream and include_usage):
                out["usage"] = usage
            return out

        if not stream:
            out = await gen.text(request.is_disconnected)
            return obj(out.text, _finish(out.finish), _usage(gen))

        async def events():
            try:
                async for d in gen.deltas():
                    if d.text or d.finish:
                        yield sse(json.dumps(obj(d.text, _finish(d.finish) if d.finish else None), ensure_ascii=False))
                if include_usage:
                    yield sse(json.dumps(obj("", None, _usage(gen), choices=False)))
            except Exception as err:
                yield _error_chunk(err)
            finally:
                gen.cancel()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def _completion_prompt(state: ServeState, prompt) -> list[int]:
    """A completion's prompt: a string, a list of one string, a list of token ids, or a list of one list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        return state.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("several prompts in one request are not supported; send one request per prompt", "prompt")
    raise bad_request("expected a non-empty string or a list of token ids", "prompt")


def error_body(err: APIError) -> dict:
    """OpenAI's error shape."""
    kind = {"bad_request": "invalid_request_error", "auth": "invalid_request_error",
            "not_found": "invalid_request_error", "rate_limit": "rate_limit_error",
            "internal": "server_error"}[err.kind]
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)
