"""responses_api: the OpenAI Responses API — `POST /v1/responses` (one `response` object, or streamed as the
Responses SSE sequence: response.created, response.in_progress, then per output item output_item.added,
content_part.added, the item's deltas and .done events, output_item.done, and last response.completed —
or response.incomplete when max_output_tokens cut it, as OpenAI does), `GET` and `DELETE
/v1/responses/{id}` over a bounded local store (LRU) that also backs `previous_response_id`.

Owns the request's validation (a 400 naming the field), `input` (a string, or items: messages of role
user / system / developer / assistant with input_text / output_text parts, function_call and
function_call_output items as the chat template's assistant tool calls and tool messages, reasoning items
as the next assistant turn's reasoning, input_image parts of user messages — data URLs, or http(s) URLs with
`serve --allow-image-urls` — as images, serve.prompt) with `instructions` into the chat template's messages,
the response object, its usage and ids, and the stream's sequence numbers. The output items and their stream events come
from serve.responses_output's `ResponseBuilder`. text.format json_schema / json_object and tool_choice
"required" or named are a grammar on the engine request (serve.structured). Not here: built-in tools (web
search, files, …: 400), background mode, conversations, item_reference, input_file and images by file_id."""
from __future__ import annotations

import json
import time
from collections import OrderedDict

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ninfer_gen.serve.core import (APIError, Generation, ServeState, bad_request, get, json_body, new_id,
                                   sampling_params, sse)
from ninfer_gen.serve.images import ImageRef, image_part, image_url
from ninfer_gen.serve.parsing import OutputParser
from ninfer_gen.serve.prompt import chat_prompt
from ninfer_gen.serve.responses_output import ResponseBuilder
from ninfer_gen.serve.structured import constrained, openai_tool_choice, response_format, thinking_for, with_answer

STORE_SIZE = 256                       # responses kept for previous_response_id and GET (least recently used out)
STORE_IMAGE_BYTES = 256 * 2**20        # and the images their conversations hold, at most (least recently used out)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# fields the API defines that this server does not implement: a 400 naming the field unless default
_UNSUPPORTED = {"background": False, "conversation": None, "prompt": None, "top_logprobs": 0,
                "truncation": "disabled"}


def _image_bytes(conversation: list[dict]) -> int:
    return sum(part["image"].size for m in conversation if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and isinstance(part.get("image"), ImageRef))


class ResponseStore:
    """The last `size` stored responses: id → (the response object, the conversation it ends — the chat
    template's messages, instructions apart, as previous_response_id continues it, images included), within
    `image_bytes` of images (counted per response, so images shared by a continued conversation count again)."""

    def __init__(self, size: int = STORE_SIZE, image_bytes: int = STORE_IMAGE_BYTES):
        self.size, self.image_bytes, self._items, self._held = size, image_bytes, OrderedDict(), {}

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        self._held[response["id"]] = _image_bytes(conversation)
        while len(self._items) > self.size or (len(self._items) > 1 and sum(self._held.values()) > self.image_bytes):
            del self._held[self._items.popitem(last=False)[0]]

    def get(self, response_id, param: str | None = None) -> tuple[dict, list[dict]]:
        if not isinstance(response_id, str) or response_id not in self._items:
            raise APIError(404, f"no stored response with id {response_id!r} (this server keeps the last {self.size} "
                           "responses made with store=true)", param=param, kind="not_found",
                           code="previous_response_not_found" if param else "response_not_found")
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id], self._held[response_id]


# ---------------------------------------------------------------------------------------- request → prompt


def _part_text(part, where: str, parts=TEXT_PARTS, images: bool = False) -> str:
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind not in parts:
        also = " and input_image" if images else ""
        raise bad_request(f"a content part of type {kind!r}: only {', '.join(parts)}{also} parts are taken here",
                          where)
    if not isinstance(part.get("text"), str):
        raise bad_request("expected a string", f"{where}.text")
    return part["text"]


def _text(content, where: str, parts=TEXT_PARTS) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected a string or a list of content parts", where)
    return "".join(_part_text(part, f"{where}[{j}]", parts) for j, part in enumerate(content))


def _user_content(content, where: str):
    """A user message's content: its text joined, or — with input_image parts — its parts in order (images as
    serve.images' parts)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise bad_request("input_image with a file_id: this server has no files API; send image_url (a data "
                                  "URL, or an http(s) URL with serve --allow-image-urls)", w)
            parts.append(image_part(image_url(part.get("image_url"), w)))
        else:
            parts.append({"type": "text", "text": _part_text(part, w, images=True)})
    return parts


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request("a non-empty string is required", f"{where}.{key}")
    return value


def _arguments(text, where: str) -> dict:
    if not isinstance(text, str):
        raise bad_request("expected a string of JSON", where)
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as err:
        raise bad_request(f"not valid JSON: {err}", where) from None
    if not isinstance(args, dict):
        raise bad_request("must be a JSON object", where)
    return args


def input_messages(items, where: str = "input") -> list[dict]:
    """Input items → the chat template's messages (function calls join the assistant turn before them;
    a reasoning item is the reasoning of the assistant turn that follows it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("expected a string or a non-empty list of input items", where)
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant(new: bool) -> dict:
        if new or not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1].setdefault("reasoning_content", "".join(reasoning))
            reasoning.clear()
        return out[-1]

    for i, item in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request("expected an input item (object)", w)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"role must be one of {', '.join(ROLES)}, got {role!r}", w + ".role")
            text = (_user_content if role == "user" else _text)(item.get("content"), w + ".content")
            if role == "assistant":
                assistant(True)["content"] = text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", w), "type": "function",
                    "function": {"name": _string(item, "name", w), "arguments": _arguments(item.get("arguments"),
                                                                                         w + ".arguments")}}
            assistant(False).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", w),
                        "content": _text(output, w + ".output", ("input_text",)) if output is not None else ""})
        elif kind == "reasoning":
            content = item.get("content") or item.get("summary") or []
            reasoning.append(_text(content, w + (".content" if item.get("content") else ".summary"),
                                   ("reasoning_text", "summary_text")))
        else:
            raise bad_request(f"input items of type {kind!r} are not supported here (message, function_call, "
                              "function_call_output and reasoning are)", w + ".type")
    return out


def request_tools(body: dict) -> list[dict] | None:
    """Function tools in the chat template's shape (None: none, or tool_choice "none")."""
    tools = get(body, "tools", "array", default=[])
    choice = body.get("tool_choice")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request("expected a tool (object)", f"tools[{i}]")
        if t.get("type") != "function":
            raise bad_request(f"tools of type {t.get('type')!r} are not supported here; only \"function\"",
                              f"tools[{i}].type")
        fn = {"name": _string(t, "name", f"tools[{i}]"),
              "parameters": get(t, "parameters", "object", where=f"tools[{i}].", default={"type": "object"})}
        if get(t, "description", "string", where=f"tools[{i}].") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out if out and choice != "none" else None


def _echo_tools(tools: list[dict] | None, given) -> list[dict]:
    strict = {t.get("name"): t.get("strict") for t in given or [] if isinstance(t, dict)}
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
             "parameters": t["function"]["parameters"], "strict": strict.get(t["function"]["name"])}
            for t in tools or []]


def _check_supported(body: dict) -> None:
    for name, default in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != default:
            raise bad_request(f"{name}={json.dumps(value)} is not supported by this server", name)


def _reasoning(body: dict) -> tuple[str | None, bool | None]:
    """reasoning.effort, and the template's enable_thinking from it ("none": off; unset: the template's default)."""
    effort = get(get(body, "reasoning", "object", default={}), "effort", "string", where="reasoning.")
    return effort, None if effort is None else effort != "none"


# ---------------------------------------------------------------------------------------- one response


class _Turn:
    """One POST /v1/responses: the checked request, its generation (submitted by `start`, after every check), and
    its response object as it goes (`snapshot`) and at the end (`finish`, which stores it)."""

    def __init__(self, state: ServeState, store: ResponseStore, body: dict):
        state.check_model(body.get("model"))
        _check_supported(body)
        self.state, self.store = state, store
        self.stream = get(body, "stream", "boolean", default=False)
        previous = get(body, "previous_response_id", "string")
        history = store.get(previous, "previous_response_id")[1] if previous is not None else []
        if body.get("input") is None:
            raise bad_request("this field is required (a string or a list of input items)", "input")
        self.conversation = [*history, *input_messages(body["input"])]
        instructions = get(body, "instructions", "string")
        tools, (effort, thinking) = request_tools(body), _reasoning(body)
        fmt = get(get(body, "text", "object", default={}), "format", "object", where="text.")
        structured = with_answer(openai_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls")),
                                 response_format(fmt, "text.format"), "text.format")
        thinking = thinking_for(structured, thinking)
        max_out = get(body, "max_output_tokens", "integer", minimum=1)
        temperature, top_p = get(body, "temperature", "number"), get(body, "top_p", "number")
        self._sampling = sampling_params(temperature, top_p, get(body, "top_k", "integer"),
                                         get(body, "seed", "integer"))
        self._messages = [{"role": "system", "content": instructions}] * bool(instructions) + self.conversation
        self._tools, self._thinking, self._structured, self._max_out = tools, thinking, structured, max_out
        self.base = {
            "id": new_id("resp_"), "object": "response", "created_at": int(time.time()), "background": False,
            "instructions": instructions, "max_output_tokens": max_out, "max_tool_calls": None,
            "model": state.served_model_name, "previous_response_id": previous,
            "parallel_tool_calls": get(body, "parallel_tool_calls", "boolean", default=True),
            "reasoning": {"effort": effort, "summary": None}, "store": get(body, "store", "boolean", default=True),
            "temperature": 1.0 if temperature is None else temperature, "text": {"format": fmt or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": _echo_tools(tools, body.get("tools")),
            "top_p": 1.0 if top_p is None else top_p, "truncation": "disabled", "user": get(body, "user", "string"),
            "metadata": get(body, "metadata", "object", default={})}
        self.builder = ResponseBuilder()

    async def start(self) -> "_Turn":
        """The prompt (images loaded and preprocessed) and its generation, submitted."""
        state, tools, thinking = self.state, self._tools, self._thinking
        chat = await chat_prompt(state, self._messages, tools, thinking, param="input")
        budget = state.prompt_budget(chat.ids, self._max_out, "max_output_tokens", prompt_param="input")
        self.parser = OutputParser.for_prompt(chat.text, thinking=thinking is not False, parse_tool_calls=bool(tools),
                                              tools=tools)
        self.gen = Generation(await constrained(state, self._structured, chat.text, thinking), chat.ids, budget,
                              self._sampling, [], self.base["id"], images=chat.images)
        return self

    def snapshot(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        return {**self.base, "status": status, "error": error, "output": self.builder.output() if usage else [],
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "completed_at": int(time.time()) if status == "completed" else None, "usage": usage}

    def finish(self, reason: str) -> tuple[list[dict], dict]:
        """The closing events of the open item and the final response (stored when `store`)."""
        status = "incomplete" if reason == "length" else "completed"
        events = self.builder.close(status)
        gen, turn = self.gen, self.builder.message()
        reasoning = len(self.state.encode(turn["reasoning_content"])) if "reasoning_content" in turn else 0
        response = self.snapshot(status, {
            "input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, gen.completion_tokens)},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens})
        if response["store"]:
            self.store.put(response, [*self.conversation, turn])
        return events, response

    async def whole(self, is_disconnected) -> dict:
        out = await self.gen.text(is_disconnected)
        self.builder.events(self.parser.feed(out.text) + self.parser.finish())
        return self.finish(out.finish)[1]

    async def events(self):
        seq = 0

        def event(obj: dict) -> str:
            nonlocal seq
            obj["sequence_number"], seq = seq, seq + 1
            return sse(json.dumps(obj, ensure_ascii=False), obj["type"])

        try:
            yield event({"type": "response.created", "response": self.snapshot("in_progress")})
            yield event({"type": "response.in_progress", "response": self.snapshot("in_progress")})
            finish = "stop"
            async for d in self.gen.deltas():
                for obj in self.builder.events(self.parser.feed(d.text) + (self.parser.finish() if d.finish else [])):
                    yield event(obj)
                finish = d.finish or finish
            closing, response = self.finish(finish)
            for obj in closing:
                yield event(obj)
            yield event({"type": f"response.{response['status']}", "response": response})
        except Exception as err:                  # the stream has begun: the error goes in it, then the end
            message = err.message if isinstance(err, APIError) else f"{type(err).__name__}: {err}"
            code = (err.code if isinstance(err, APIError) else None) or "server_error"
            yield event({"type": "error", "code": code, "message": message, "param": None})
            yield event({"type": "response.failed",
                         "response": self.snapshot("failed", error={"code": code, "message": message})})
        finally:
            self.gen.cancel()                     # a client that went away: free the lane now


def router(state: ServeState, store: ResponseStore | None = None) -> APIRouter:
    api = APIRouter()
    store = store if store is not None else ResponseStore()

    @api.post("/v1/responses")
    async def create(request: HTTPRequest):
        turn = await _Turn(state, store, await json_body(request)).start()
        if not turn.stream:
            return await turn.whole(request.is_disconnected)
        return StreamingResponse(turn.events(), media_type="text/event-stream")

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return store.get(response_id)[0]

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return api
