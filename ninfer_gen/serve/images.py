"""images: a request's image parts, from the wire to bytes — `ImageRef` (one image as a request gave it: a data URL,
base64 with its media type, or an http(s) URL, and the request field it came from), the content part the chat
messages carry for it (`image_part`; `split_images` swaps them for the `{"type": "image"}` parts chat templates
read), and `load_images` (data decoded, URLs fetched off the event loop when the server allows them, each within
the request's byte limit). Every failure is a 400 naming the field and the problem; decoding the pixels and the
per-image limits are ninfer_gen.vision.preprocess's (through Model.prepare_images, in serve.prompt)."""
from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from ninfer_gen.serve.core import ServeState, bad_request

FETCH_TIMEOUT_S = 10.0              # one remote image: connect and read
URLS_OFF = ("remote image URLs are off: start serve with --allow-image-urls, or send a data URL "
            "(data:image/png;base64,...)")
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),", re.IGNORECASE)


@dataclass(eq=False)
class ImageRef:
    """One image of a request: `where` (its request field, for messages), and what was sent — a `url` (data: or
    http(s)), or `b64` with its `media_type` (Anthropic's base64 source). `data`: its bytes once loaded (kept, so
    a stored conversation continued later needs no second fetch)."""
    where: str
    url: str | None = None
    b64: str | None = None
    media_type: str | None = None
    data: bytes | None = None

    @property
    def size(self) -> int:
        """Bytes it holds (a response store's budget)."""
        return len(self.data or b"") + len(self.url or "") + len(self.b64 or "")


def image_part(ref: ImageRef) -> dict:
    """The content part a chat message holds for an image (`split_images` turns it into the template's)."""
    return {"type": "image", "image": ref}


def image_url(url, where: str) -> ImageRef:
    """An image given by URL (OpenAI's image_url.url, the Responses API's input_image.image_url, Anthropic's url
    source): a data URL, or an http(s) URL fetched only when the server allows it (both checked when loading,
    after the model is known to take images)."""
    if not isinstance(url, str) or not url:
        raise bad_request("expected a data URL (data:image/png;base64,...) or an http(s) URL", where)
    return ImageRef(where, url=url)


def image_base64(media_type, data, where: str) -> ImageRef:
    """An image given as base64 with its media type (Anthropic's {"type": "base64", "media_type", "data"})."""
    if not isinstance(media_type, str) or not media_type.lower().startswith("image/"):
        raise bad_request(f"source.media_type: expected an image media type (image/png, image/jpeg, image/gif, "
                          f"image/webp), got {media_type!r}", where)
    if not isinstance(data, str) or not data:
        raise bad_request("source.data: expected the image's bytes as a base64 string", where)
    return ImageRef(where, b64=data, media_type=media_type)


def split_images(messages: list[dict]) -> tuple[list[dict], list[ImageRef]]:
    """Messages as a chat template reads them (each image part as `{"type": "image"}`) and the images in the
    order the conversation holds them (messages in order, parts in order)."""
    out, refs = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                refs.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, refs


# ---------------------------------------------------------------------------------------- loading


def _b64decode(text: str, limit: int, where: str) -> bytes:
    text = "".join(text.split())                  # line breaks some encoders add
    if len(text) // 4 * 3 > limit + 2:            # refused before decoding what would exceed the limit anyway
        raise bad_request(f"about {len(text) // 4 * 3:,} bytes exceeds the limit of {limit:,} bytes per image", where)
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image data is not valid base64", where) from None


def _data_url(url: str, limit: int, where: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise bad_request("a data URL needs the form data:image/png;base64,<data>", where)
    media = m["type"].strip().lower()
    if media and not media.startswith("image/"):
        raise bad_request(f"a data URL of type {media!r} is not an image (image/png, image/jpeg, ...)", where)
    payload = url[m.end():]
    if "base64" in (p.strip().lower() for p in m["params"].split(";")):
        return _b64decode(payload, limit, where)
    data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > limit:
        raise bad_request(f"{len(data):,} bytes exceeds the limit of {limit:,} bytes per image", where)
    return data


def fetch(url: str, limit: int, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The bytes at an http(s) URL, at most `limit` of them; a ValueError saying why not (HTTP status, network
    error, timeout, too large)."""
    request = urllib.request.Request(url, headers={"User-Agent": "ninfer-gen", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ValueError(f"{int(declared):,} bytes exceeds the limit of {limit:,} bytes per image")
            data = response.read(limit + 1)
    except urllib.error.HTTPError as err:
        raise ValueError(f"HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise ValueError(f"cannot fetch it: {err.reason}") from None
    except (OSError, http.client.HTTPException) as err:          # timeouts, resets, truncated bodies
        raise ValueError(f"cannot fetch it: {type(err).__name__}: {str(err) or 'timed out'}") from None
    if len(data) > limit:
        raise ValueError(f"more than the limit of {limit:,} bytes per image")
    return data


def _short(url: str, most: int = 120) -> str:
    return url if len(url) <= most else url[:most] + "…"


async def _load(state: ServeState, ref: ImageRef) -> None:
    limit = state.image_limits.max_bytes
    scheme = ref.url.split(":", 1)[0].lower() if ref.url is not None and ":" in ref.url else ""
    if ref.b64 is not None:
        ref.data, ref.b64 = _b64decode(ref.b64, limit, ref.where), None
    elif scheme == "data":
        ref.data, ref.url = _data_url(ref.url, limit, ref.where), None
    elif scheme not in ("http", "https"):
        raise bad_request(f"unsupported image URL {_short(ref.url, 40)!r}: send a data URL "
                          "(data:image/png;base64,...) or an http(s) URL", ref.where)
    elif not state.allow_image_urls:
        raise bad_request(URLS_OFF, ref.where)
    else:
        try:
            ref.data = await asyncio.to_thread(fetch, ref.url, limit)
        except ValueError as err:
            raise bad_request(f"image URL {_short(ref.url)}: {err}", ref.where) from None


async def load_images(state: ServeState, refs: list[ImageRef]) -> list[bytes]:
    """The images' bytes, in order (remote ones fetched concurrently); a 400 naming the first that fails."""
    if len(refs) > state.image_limits.max_images:
        raise bad_request(f"{len(refs)} images in one request exceeds this server's limit of "
                          f"{state.image_limits.max_images} (serve --max-images)", refs[-1].where)
    pending = [ref for ref in refs if ref.data is None]
    results = await asyncio.gather(*(_load(state, ref) for ref in pending), return_exceptions=True)
    for error in results:
        if isinstance(error, BaseException):
            raise error
    return [ref.data for ref in refs]
