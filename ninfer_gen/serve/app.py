"""app: the FastAPI application — `create_app(engine, model, ...)` mounts the OpenAI (openai_api: chat
completions, completions; responses_api: Responses) and Anthropic (anthropic_api) endpoints over one cohort
engine, adds `GET /health`, `GET /v1/models` and `GET /metrics` (Prometheus text, serve.metrics; like
/health, not behind the key), the API key check (`Authorization: Bearer KEY` or `x-api-key: KEY` on every
/v1 path), and renders every error in the shape of the API it belongs to (paths under /v1/messages:
Anthropic's, the rest: OpenAI's): 400 for a malformed request (naming the field), 401 for a wrong key, 404
for an unknown model, path or stored response, 429 with Retry-After when the engine's queue is full, 504
when a generation runs past the request timeout (`x-should-retry: false`: the SDKs would otherwise re-run
it), 500 with the message for an unexpected internal error — which fails that request only. Every HTTP
response is counted in the metrics by endpoint and status. The engine's background loop runs while the
app lives (started at startup unless already running, stopped at shutdown when the app started it).
The chat page (serve.ui) is at `GET /` unless `ui=False`; like /health, it is not behind the key.
Each model of `/v1/models` carries `capabilities: {"vision": bool}` (an extension; the chat page reads it).

Not here (yet): structured output, prefix reuse."""
from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ninfer_gen.serve import anthropic_api, openai_api, responses_api
from ninfer_gen.serve import ui as ui_page
from ninfer_gen.serve.core import DEFAULT_TIMEOUT_S, ENDPOINT, APIError, ServeState
from ninfer_gen.serve.metrics import endpoint_label
from ninfer_gen.vision.preprocess import ImageLimits

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _render(request: HTTPRequest, err: APIError) -> JSONResponse:
    api = anthropic_api if _is_anthropic(request.url.path) else openai_api
    return api.error_response(err)


def create_app(engine, model, *, served_model_name: str, api_key: str | None = None, chat=None,
               model_folder: str | Path | None = None, draft: int = 0,
               request_timeout: float | None = DEFAULT_TIMEOUT_S, ui: bool = True, image_limits=None,
               allow_image_urls: bool = False) -> FastAPI:
    """The server over a cohort `engine` (engine.Engine) and the loaded `model` it runs (its tokenizer and
    EOS ids). `chat`: a serve.chat.ChatFormat, else read from `model_folder` (else the model's own folder
    when the engine knows it; none: the chat endpoints answer 400). `draft`: MTP drafts per round.
    `request_timeout`: seconds a generation may run from its submission (None or 0: no limit). `ui`: serve the
    chat page at `GET /`. `image_limits`: what one request's images may be (vision.preprocess.ImageLimits;
    None: its defaults); `allow_image_urls`: fetch http(s) image URLs (off: data URLs only)."""
    if chat is None:
        from ninfer_gen.serve.chat import load_chat_format

        folder = model_folder
        if folder is None:                 # Model.source: the folder, or "FOLDER (converted)"
            source = str(getattr(model, "source", ""))
            for candidate in (source, source.removesuffix(" (converted)")):
                if candidate and Path(candidate).is_dir():
                    folder = candidate
                    break
        chat = load_chat_format(folder) if folder is not None else None
    state = ServeState(engine=engine, model=model, chat=chat, served_model_name=served_model_name, draft=draft,
                       request_timeout=request_timeout or None, image_limits=image_limits or ImageLimits(),
                       allow_image_urls=allow_image_urls)

    @asynccontextmanager
    async def lifespan(app):
        started = not engine.running
        if started:
            engine.start()
        try:
            yield
        finally:
            if started:
                engine.stop()

    app = FastAPI(title="ninfer-gen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    def key_error(request: HTTPRequest) -> JSONResponse | None:
        if api_key is None or not request.url.path.startswith("/v1"):
            return None
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if given is not None and hmac.compare_digest(given.encode(), api_key.encode()):
            return None
        return _render(request, APIError(401, "invalid API key: give it as 'Authorization: Bearer KEY' or "
                                         "'x-api-key: KEY'" if given is not None else
                                         "no API key: give it as 'Authorization: Bearer KEY' or "
                                         "'x-api-key: KEY'", kind="auth", code="invalid_api_key"))

    @app.middleware("http")
    async def check_key_and_count(request: HTTPRequest, call_next):
        endpoint = endpoint_label(request.url.path)
        ENDPOINT.set(endpoint)                      # the handler's task inherits it: Generation reads it
        status = 500                                # an exception reaches the server's error handler: 500
        try:
            response = key_error(request) or await call_next(request)
            status = response.status_code
            return response
        finally:
            state.metrics.response(endpoint, status)

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, err: APIError):
        return _render(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _render(request, APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, err: StarletteHTTPException):
        kind = {401: "auth", 404: "not_found", 429: "rate_limit"}.get(err.status_code,
                                                                       "internal" if err.status_code >= 500
                                                                       else "bad_request")
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return _render(request, APIError(err.status_code, message, kind=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, err: Exception):
        return _render(request, APIError(500, f"internal error: {type(err).__name__}: {err}", kind="internal"))

    @app.get("/health")
    async def health():
        stats = engine.stats()
        return {"status": "ok" if engine.running else "stopped", "model": served_model_name,
                "lanes": stats["lanes"], "lanes_busy": stats["lanes_busy"], "queue_depth": stats["queue_depth"],
                "max_queue": stats["max_queue"]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(engine.stats()), media_type=PROMETHEUS_TEXT)

    @app.get("/v1/models")
    async def models():
        # `capabilities`: an extra field, which OpenAI's model object allows (the SDKs keep it as an attribute)
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": state.created,
                                            "owned_by": "ninfer-gen", "max_model_len": state.max_context,
                                            "capabilities": {"vision": model.vision}}]}

    app.include_router(openai_api.router(state))
    app.include_router(anthropic_api.router(state))
    app.include_router(responses_api.router(state))
    if ui:
        app.include_router(ui_page.router())
    return app
