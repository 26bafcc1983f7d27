"""prompt: a chat request's conversation → the prompt the engine runs (`ChatPrompt`: the template's text, the token
ids, the preprocessed images). The chat template renders image parts as it does for `{"type": "image"}` (Qwen's
writes `<|vision_start|><|image_pad|><|vision_end|>`); each such placeholder in the text becomes the vision start,
image and end ids inserted as ids — never through the tokenizer, which may not know them — and each image token
is then repeated to its image's count (Model.expand_images). Images are loaded (serve.images) and preprocessed off
the event loop under the server's limits. A 400 names the field for a model without a vision tower, a template
that does not place every image, and every bad image. Knows no HTTP API: the API modules hand it messages."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ninfer_gen.serve.core import ServeState, bad_request
from ninfer_gen.serve.images import load_images, split_images
from ninfer_gen.vision.preprocess import ImageError

# the placeholder text of an image in a rendered template (Qwen's), by the tokenizer config's names for them
PLACEHOLDERS = {"vision_start_token": "<|vision_start|>", "image_token": "<|image_pad|>",
                "vision_end_token": "<|vision_end|>"}


@dataclass(frozen=True)
class ChatPrompt:
    """`text`: the rendered template (the output parser and grammars read it); `ids`: the prompt the engine runs,
    image placeholders expanded; `images`: vision.preprocess.Processed, None for a text-only prompt."""
    text: str
    ids: list[int]
    images: object | None = None


def placeholder(special_tokens: Mapping[str, str] | None = None) -> tuple[str, re.Pattern]:
    """(the placeholder's text, a pattern of it in rendered text): the image token, with the vision start and end
    around it when the template writes them (the ids get all three either way)."""
    names = {**PLACEHOLDERS, **{k: v for k, v in (special_tokens or {}).items() if k in PLACEHOLDERS and v}}
    start, pad, end = (names[k] for k in ("vision_start_token", "image_token", "vision_end_token"))
    return start + pad + end, re.compile(f"(?:{re.escape(start)})?{re.escape(pad)}(?:{re.escape(end)})?")


def splice(text: str, encode: Callable[[str], list[int]], pattern: re.Pattern, vision) -> tuple[list[int], int]:
    """(ids, placeholders found): the text between placeholders tokenized piece by piece, each placeholder as
    `vision_start_token_id, image_token_id, vision_end_token_id` (`vision`: the spec's VisionSpec)."""
    pieces = pattern.split(text)
    block = [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += encode(piece)
        if i < len(pieces) - 1:
            ids += block
    return ids, len(pieces) - 1


def _image_where(err: ImageError, refs, param: str) -> str:
    return refs[err.index].where if err.index is not None and err.index < len(refs) else param


async def chat_prompt(state: ServeState, messages: list[dict], tools: list[dict] | None, thinking: bool | None,
                      param: str = "messages") -> ChatPrompt:
    """The prompt of a conversation whose messages may hold image parts (serve.images.image_part), in the order
    the conversation holds them. `param` names the request's conversation field in errors."""
    messages, refs = split_images(messages)
    if refs:
        try:
            state.model.check_vision()
        except ValueError as err:
            raise bad_request(str(err), refs[0].where) from None
    text = state.render_chat(messages, tools, thinking, param=param)
    if not refs:
        return ChatPrompt(text, state.encode(text))
    vision = state.model.spec.vision
    written, pattern = placeholder(state.chat.special_tokens if state.chat is not None else None)
    ids, found = splice(text, state.encode, pattern, vision)
    if found != len(refs):
        raise bad_request(f"the chat template wrote {found} image placeholder(s) for the request's {len(refs)} "
                          f"image(s): it must render each image part as {written} (text that holds the "
                          "placeholder counts too)", param)
    data = await load_images(state, refs)
    try:
        images = await asyncio.to_thread(state.model.prepare_images, data, state.image_limits)
    except ImageError as err:
        raise bad_request(str(err), _image_where(err, refs, param)) from None
    except ValueError as err:
        raise bad_request(str(err), param) from None
    return ChatPrompt(text, state.model.expand_images(ids, images), images)
