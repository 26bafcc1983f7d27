"""core: what every API of the server shares, between an HTTP handler and the cohort engine —
`ServeState` (the engine, the model, its tokenizer and chat format, the served name, the engine's stop
tokens, the draft length, the image limits), `APIError` (a 4xx/5xx the app renders in the caller's API
shape), sampling parameters from request fields, and `Generation`: one engine request (images included)
turned into text deltas (incremental detokenisation that holds back incomplete UTF-8, stop strings matched
across deltas and held back until decided) with its finish reason and usage. Waiting is asyncio-friendly (the
engine runs in its own thread; a handle's events are polled), and a generation that ends early — a stop
string, a client that went away, an exception, the server's request timeout — cancels its engine request,
which frees its lane, slot and pages. A generation reports its tokens, latencies and end to the server's
`metrics.Metrics`.

The HTTP endpoints and wire formats live in openai_api, anthropic_api and responses_api; the app in app."""
from __future__ import annotations

import asyncio
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from ninfer_gen.engine.engine import Engine
from ninfer_gen.engine.requests import EngineFull, Request
from ninfer_gen.sampling import SamplingParams
from ninfer_gen.serve.metrics import Metrics
from ninfer_gen.vision.preprocess import ImageLimits

POLL_S = 0.005                      # how often a waiting handler looks at its request's events
DISCONNECT_POLL_S = 0.25            # how often a non-streamed request checks that its client is still there
RETRY_AFTER_S = 1                   # Retry-After of a 429 (the queue is full)
DEFAULT_TIMEOUT_S = 600.0           # a generation running longer (queue included) is cancelled: 504
# the endpoint (a metrics label) of the HTTP request being handled; the app sets it for each request
ENDPOINT: ContextVar[str] = ContextVar("ninfer_endpoint", default="other")


class APIError(Exception):
    """An error answered to the client: HTTP `status`, a message, the request field it is about (`param`),
    a `kind` (bad_request, auth, not_found, rate_limit, internal) each API maps to its own type names."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "bad_request",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}" if param and not message.startswith(param) else message,
                    param=param, code="invalid_value" if param else None)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class ServeState:
    """The served model: `engine` (running in its background thread while the app lives), `model` (a loaded
    ninfer_gen Model: tokenizer, spec, EOS ids), `chat` (a serve.chat.ChatFormat, or None: chat endpoints
    then answer 400), `served_model_name`, `draft` (MTP drafts per round for every request),
    `request_timeout` (seconds a generation may take from its submission; None: no limit), `metrics`,
    `image_limits` (what one request's images may be: count, bytes, input pixels) and `allow_image_urls`
    (fetch http(s) image URLs; off: data URLs only)."""
    engine: Engine
    model: object
    chat: object | None
    served_model_name: str
    draft: int = 0
    request_timeout: float | None = DEFAULT_TIMEOUT_S
    metrics: Metrics = field(default_factory=Metrics)
    image_limits: ImageLimits = ImageLimits()
    allow_image_urls: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end any generation: the model's EOS ids and the chat format's turn-end tokens."""
        ids = set(getattr(self.model, "eos_ids", ()) or ())
        if self.chat is not None:
            ids |= set(self.chat.stop_token_ids)
        return frozenset(ids)

    @property
    def max_context(self) -> int:
        return self.engine.backend.max_context

    def encode(self, text: str) -> list[int]:
        return list(self.model.tokenizer.encode(text))

    def decode(self, ids) -> str:
        return self.model.tokenizer.decode(list(ids))

    def check_model(self, name, param: str = "model") -> None:
        if not isinstance(name, str) or not name:
            raise bad_request("a model name (string) is required", param)
        if name != self.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.served_model_name}'",
                           param=param, kind="not_found", code="model_not_found")

    def render_chat(self, messages: list[dict], tools: list[dict] | None, enable_thinking: bool | None,
                    param: str = "messages") -> str:
        """The prompt text of a conversation; a 400 naming `param` (the request's conversation field) when the
        model has no chat template or its template refuses the conversation."""
        from ninfer_gen.serve.chat_template import ChatTemplateError

        if self.chat is None:
            raise bad_request(f"the model '{self.served_model_name}' has no chat template (its folder has none); "
                              "use /v1/completions", param)
        try:
            return self.chat.render(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)
        except ChatTemplateError as err:
            raise bad_request(str(err), param) from None

    def prompt_budget(self, prompt: list[int], max_tokens: int | None, param: str, prompt_param: str | None = None
                      ) -> int:
        """The request's max tokens: as asked (≥ 1, prompt + it within the context) or, unset, the room left.
        `param` names the max-tokens field, `prompt_param` the prompt's (default: messages, or prompt)."""
        room = self.max_context - len(prompt)
        if room < 1:
            raise bad_request(f"the prompt is {len(prompt)} tokens; the context limit is {self.max_context} tokens "
                              "and leaves no room for output",
                              prompt_param or ("messages" if param != "prompt" else "prompt"))
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad_request(f"{max_tokens} output tokens and the prompt's {len(prompt)} exceed the context limit "
                              f"of {self.max_context} tokens (at most {room} here)", param)
        return max_tokens


def _float(value, param: str) -> float:
    try:
        return float(value)
    except OverflowError:                   # an integer beyond any float
        raise bad_request(f"{str(value)[:24]}… is out of range", param) from None


def sampling_params(temperature, top_p, top_k, seed, prefix: str = "") -> SamplingParams:
    """SamplingParams from request fields (None: the API default, temperature 1 and top_p 1); a request
    without a seed gets a fresh random one, so unseeded sampled requests differ."""
    temperature = 1.0 if temperature is None else _float(temperature, prefix + "temperature")
    top_p = 1.0 if top_p is None else _float(top_p, prefix + "top_p")
    top_k = 0 if top_k is None or top_k < 0 else int(top_k)        # OpenAI-style extensions use -1 for "off"
    if not 0 <= temperature <= 2:
        raise bad_request(f"must be between 0 and 2, got {temperature}", prefix + "temperature")
    if not 0 < top_p <= 1:
        raise bad_request(f"must be in (0, 1], got {top_p}", prefix + "top_p")
    if seed is not None and not 0 <= int(seed) < 2 ** 63:
        raise bad_request(f"must be an integer in [0, 2^63), got {seed}", prefix + "seed")
    return SamplingParams(temperature, top_k, top_p, secrets.randbits(63) if seed is None else int(seed))


def stop_strings(value, param: str, most: int = 16) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("must be a string or a list of strings", param)
    if len(items) > most:
        raise bad_request(f"at most {most} stop sequences, got {len(items)}", param)
    if any(not s for s in items):
        raise bad_request("a stop sequence may not be empty", param)
    return list(items)


@dataclass
class Delta:
    """New text of a generation (possibly empty on the final one); `finish` on the last: stop, length, or
    stop_sequence (a stop string matched: `stop_sequence` names it)."""
    text: str
    finish: str | None = None
    stop_sequence: str | None = None


class Generation:
    """One engine request, submitted at construction (APIError 429 when the engine is full, 400 for what the
    backend refuses). `images`: the prompt's (vision.preprocess.Processed; the prompt holds their placeholders
    expanded). Iterate `deltas(is_disconnected)` for its text; `prompt_tokens`, `completion_tokens`
    are the usage. If the iteration stops early for any reason, the engine request is cancelled. Past the
    server's request timeout the engine request is cancelled (a timer on the event loop, so a client that
    stopped reading cannot hold its lane) and the iteration raises a 504 APIError."""

    def __init__(self, state: ServeState, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                 stop: list[str], request_id: str, images=None):
        self.state, self.prompt, self.stop = state, prompt, stop
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0                     # of them, restored from the prefix cache (known at the end)
        self.stats = None                          # the engine's RequestStats (known at the end)
        self.completion_tokens = 0
        self.endpoint = ENDPOINT.get()
        try:
            self.handle = state.engine.submit(Request(tuple(prompt), max_tokens=max_tokens, sampling=sampling,
                                                      stop=state.stop_ids, draft=state.draft, id=request_id,
                                                      images=images))
        except EngineFull as err:
            raise APIError(429, f"the server is busy: {err}", kind="rate_limit", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as err:
            raise bad_request(str(err), "prompt") from None
        self.t_submit = time.monotonic()
        state.metrics.submitted(len(prompt))
        self._tokens: list[int] = []
        self._sent = ""            # text decided and returned
        self._done = False         # the engine request has ended or was cancelled
        self._outcome: str | None = None       # how it ended (the metrics' finish_reason), once recorded
        self._t_last: float | None = None      # when its last tokens came
        self.timed_out = False
        self._timer = None
        if state.request_timeout:
            try:
                self._timer = asyncio.get_running_loop().call_later(state.request_timeout, self._expire)
            except RuntimeError:               # no event loop (a caller driving it by hand): no timer
                pass

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self.state.engine.cancel(self.handle.id)
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        """The timeout: the engine request is cancelled (its final event, "cancelled", ends the iteration
        with a 504), unless it has just ended."""
        if not self._done:
            self.timed_out = self.state.engine.cancel(self.handle.id)
            if self.timed_out:
                self._end("timeout")       # recorded here too: a stream whose client never read has no iteration

    def _timeout_error(self) -> APIError:
        return APIError(504, f"the request ran longer than the server's request timeout of "
                        f"{self.state.request_timeout:g} s and was cancelled", kind="internal", code="timeout",
                        headers={"x-should-retry": "false"})

    def _end(self, outcome: str) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self.state.metrics.finished(self.endpoint, outcome, time.monotonic() - self.t_submit)

    def _received(self, events) -> None:
        n = sum(len(e.tokens) for e in events)
        if n:
            now = time.monotonic()
            if self._t_last is None:
                self.state.metrics.tokens(n, ttft=now - self.t_submit, gap=0.0)
            else:
                self.state.metrics.tokens(n, gap=now - self._t_last)
            self._t_last = now

    async def _events(self, is_disconnected: Callable[[], Awaitable[bool]] | None):
        last_check = time.monotonic()
        while True:
            events = self.handle.poll()
            if events:
                self._received(events)
                for event in events:
                    yield event
                if events[-1].finish is not None:
                    return
                continue
            if is_disconnected is not None and time.monotonic() - last_check > DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await is_disconnected():
                    raise asyncio.CancelledError("the client went away")
            await asyncio.sleep(POLL_S)

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that could start a stop string (not sent until decided)."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    async def deltas(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Delta]:
        stop_ids = self.state.stop_ids
        try:
            async for event in self._events(is_disconnected):
                tokens = list(event.tokens)
                self.completion_tokens += len(tokens)
                if tokens and tokens[-1] in stop_ids:
                    tokens = tokens[:-1]            # the stop token ends the turn (the engine sends it last,
                                                    # before the final event, which has no tokens): not text
                self._tokens += tokens
                text = self.state.decode(self._tokens)
                final = event.finish is not None
                if not final and text.endswith("\ufffd"):
                    continue                        # an incomplete UTF-8 sequence: wait for its next token
                # a stop string cannot start in the text sent (what could start one is held back)
                hits = [(at, s) for s in self.stop if (at := text.find(s, len(self._sent))) >= 0]
                if hits:
                    at, s = min(hits)
                    out, self._sent = text[len(self._sent):at], text[:at]
                    self.cancel()
                    self._end("stop_sequence")
                    yield Delta(out, "stop_sequence", s)
                    return
                if final:
                    self._done = True
                    if event.stats is not None:
                        self.cached_tokens = event.stats.cached_tokens
                        self.stats = event.stats
                    if event.finish == "error":
                        self._end("error")
                        raise RuntimeError(f"the engine failed the request: {event.error}")
                    if event.finish == "cancelled":
                        self._end("timeout" if self.timed_out else "cancelled")
                        if self.timed_out:
                            raise self._timeout_error()
                        raise RuntimeError("the request was cancelled by the server (it is shutting down)")
                    self._end(event.finish)
                    yield Delta(text[len(self._sent):], event.finish)
                    self._sent = text
                    return
                keep = self._held(text)
                upto = max(len(self._sent), len(text) - keep)
                if upto > len(self._sent):
                    out, self._sent = text[len(self._sent):upto], text[:upto]
                    yield Delta(out)
        except Exception:
            self._end("error")
            raise
        finally:
            self.cancel()
            self._end("cancelled")          # (when not ended above) the client went away or stopped reading

    async def text(self, is_disconnected=None) -> Delta:
        """The whole output at once (a non-streamed response): one Delta with all text and the finish."""
        parts, last = [], None
        async for d in self.deltas(is_disconnected):
            parts.append(d.text)
            last = d
        return Delta("".join(parts), last.finish, last.stop_sequence)


def sse(data: str, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


_KINDS = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,)}


def get(body: dict, key: str, kind: str | tuple[str, ...], *, required: bool = False, default=None, where: str = "",
        minimum=None, maximum=None):
    """`body[key]` checked against a JSON type (or several); a 400 naming `where + key` when it is missing
    (required), of another type, or outside [minimum, maximum]. null counts as absent."""
    name = where + key
    value = body.get(key)
    if value is None:
        if required:
            raise bad_request("this field is required", name)
        return default
    kinds = (kind,) if isinstance(kind, str) else kind
    ok = any(isinstance(value, _KINDS[k]) and not (k in ("integer", "number") and isinstance(value, bool))
             for k in kinds)
    if not ok:
        raise bad_request(f"expected {' or '.join(kinds)}, got {type(value).__name__ if not isinstance(value, bool) else 'boolean'}",
                          name)
    if minimum is not None and value < minimum:
        raise bad_request(f"must be ≥ {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"must be ≤ {maximum}, got {value}", name)
    return value


async def json_body(request) -> dict:
    try:
        body = await request.json()
    except Exception:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body
