"""ui: the chat page — `GET /` and its static files under `/ui/` (serve/ui/: HTML, CSS, plain JavaScript
modules; no CDN, no framework, no build step). The page is a client of the public API only (streamed
/v1/chat/completions, /health, /metrics, /v1/models): it has no endpoint of its own and never reaches the
engine. Like /health it is not behind the API key: the page asks for the key when /v1 answers 401. Images go
as data-URL image_url parts, offered only when /v1/models gives the model `capabilities.vision`."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

FOLDER = Path(__file__).with_name("ui")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
# Everything comes from this server: a page that loads no third-party code cannot leak a conversation or a key
# to one, and the policy makes a stray CDN reference fail loudly in development rather than work by luck.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-cache"}        # revalidate: a page from an older server version must not linger


def _files() -> dict[str, tuple[bytes, str]]:
    """name → (bytes, media type) of every file the page is made of, read once: a fixed table, so a request
    path never reaches the file system."""
    return {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in sorted(FOLDER.iterdir()) if p.suffix in TYPES}


def router() -> APIRouter:
    files = _files()
    if "index.html" not in files:
        raise RuntimeError(f"the chat page is missing: no index.html in {FOLDER} (an install without package data?)")
    api = APIRouter()

    def send(name: str) -> Response:
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=HEADERS)

    @api.get("/", include_in_schema=False)
    async def index():
        return send("index.html")

    @api.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in files or name == "index.html":
            return Response(f"no file {name!r} in the chat page\n", status_code=404, media_type="text/plain")
        return send(name)

    return api
