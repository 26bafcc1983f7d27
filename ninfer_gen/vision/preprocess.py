"""preprocess: images → the vision encoder's input, as HF's Qwen2-VL-family image processor makes it (the class
transformers maps `qwen3_5` to; its Pillow backend): RGB (transparency composited on white), bicubic resize to
a multiple of patch × merge within [min_pixels, max_pixels], rescale by 1/255, normalise, and patchify into rows
of C·T·P·P values ordered by 2×2 merge blocks, with the grid (t, h, w) in patches.

Decoding checks the request's limits first (bytes, format, pixels before any decode, images per request) and
raises `ImageError` (a ValueError) naming the image and the problem, for the APIs to answer with a 400.
Pillow and numpy only; no torch.
"""
from __future__ import annotations

import hashlib
import io
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_ASPECT = 200          # the processor refuses longer strips (its resize cannot keep both sides ≥ one patch)


class ImageError(ValueError):
    """A request's image that cannot be used: `index` is its place in the request (0-based; None: the request)."""

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        super().__init__(message if index is None else f"image {index + 1}: {message}")


@dataclass(frozen=True)
class ImageConfig:
    """The model's preprocessing (HF `preprocessor_config.json`); defaults are Qwen3.5's."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ImageConfig.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ImageConfig: min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("ImageConfig: image_mean and image_std need 3 values each, the std positive")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor × factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, pre: dict) -> "ImageConfig":
        """From an HF preprocessor_config.json (`size.shortest_edge/longest_edge` or `min/max_pixels`)."""
        size = pre.get("size") or {}
        d = cls()
        return cls(patch_size=pre.get("patch_size", d.patch_size),
                   temporal_patch_size=pre.get("temporal_patch_size", d.temporal_patch_size),
                   merge_size=pre.get("merge_size", d.merge_size),
                   min_pixels=pre.get("min_pixels", size.get("shortest_edge", d.min_pixels)),
                   max_pixels=pre.get("max_pixels", size.get("longest_edge", d.max_pixels)),
                   image_mean=tuple(pre.get("image_mean", d.image_mean)),
                   image_std=tuple(pre.get("image_std", d.image_std)))


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send. `max_input_pixels` bounds an image as sent (before the resize) and is checked
    from its header, before any pixel is decoded; keep it below Pillow's own bomb limit (~89 M) so Pillow never
    warns about an image these limits accept."""
    max_images: int = 8
    max_bytes: int = 20 * 2**20
    max_input_pixels: int = 64 * 2**20
    max_tokens: int | None = None       # image tokens of the whole request (its context); None: no bound

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_input_pixels", "max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"ImageLimits.{name}: expected a positive integer, got {getattr(self, name)}")


@dataclass(frozen=True)
class Processed:
    """The encoder input of a request's images: `pixels` float32 [Σ patches, C·T·P·P], one (t, h, w) per image,
    and one content digest per image (of its patch rows and grid: what a prefix checkpoint's key holds in place
    of the image's placeholder tokens)."""
    pixels: np.ndarray
    grids: tuple[tuple[int, int, int], ...]
    merge_size: int
    digests: tuple[bytes, ...] = ()

    def __post_init__(self):
        if len(self.digests) != len(self.grids):
            object.__setattr__(self, "digests", tuple(_digest(r, g) for r, g in zip(self.rows(), self.grids)))

    def rows(self) -> list[np.ndarray]:
        """Each image's patch rows."""
        out, at = [], 0
        for t, h, w in self.grids:
            out.append(self.pixels[at:at + t * h * w])
            at += t * h * w
        return out

    @property
    def tokens(self) -> tuple[int, ...]:
        """Placeholder tokens per image: its merged patches."""
        return tuple(t * h * w // self.merge_size ** 2 for t, h, w in self.grids)


def _digest(rows: np.ndarray, grid) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(grid)).encode())
    h.update(np.ascontiguousarray(rows, dtype=np.float32).tobytes())
    return h.digest()


# ---------------------------------------------------------------- decoding with limits

def _declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF or BMP header, without decoding: Pillow refuses 0×0 headers as
    unidentifiable and bomb-sized ones with its own message, and the error should name the size."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"BM" and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return w, abs(h)
    return None


def _check_size(width: int, height: int, limits: ImageLimits, index: int | None) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{width}×{height} pixels: an image needs at least one pixel", index)
    if width * height > limits.max_input_pixels:
        raise ImageError(f"{width}×{height} = {width * height:,} pixels exceeds the limit of "
                         f"{limits.max_input_pixels:,} pixels", index)
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise ImageError(f"{width}×{height}: aspect ratio above {MAX_ASPECT}:1 is not supported", index)


def decode(data: bytes, limits: ImageLimits = ImageLimits(), index: int | None = None) -> Image.Image:
    """Bytes of a PNG, JPEG, WEBP, GIF (first frame) or BMP → a decoded image, upright by its EXIF orientation
    (as transformers' `load_image`). Every failure is an ImageError naming the problem."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"expected image bytes, got {type(data).__name__}", index)
    data = bytes(data)
    if not data:
        raise ImageError("no data (0 bytes)", index)
    if len(data) > limits.max_bytes:
        raise ImageError(f"{len(data):,} bytes exceeds the limit of {limits.max_bytes:,} bytes", index)
    declared = _declared_size(data)
    if declared is not None:
        _check_size(*declared, limits, index)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(f"more than the limit of {limits.max_input_pixels:,} pixels", index) from None
    except UnidentifiedImageError:
        raise ImageError(_unidentified(data), index) from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"corrupt {_format_name(data)} data ({err})", index) from None
    _check_size(*image.size, limits, index)
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise ImageError(f"corrupt or truncated {image.format} data ({err})", index) from None


def _format_name(data: bytes) -> str:
    try:
        return Image.open(io.BytesIO(data)).format or "image"
    except Exception:       # any failure to identify is reported as unknown data by the caller
        return "image"


def _unidentified(data: bytes) -> str:
    """Why Pillow could not open accepted formats: another format it knows, or data it cannot identify."""
    fmt = _format_name(data)
    if fmt != "image":
        return f"format {fmt} is not supported (send {', '.join(FORMATS)})"
    return f"not a decodable image (corrupt, or not one of {', '.join(FORMATS)})"


# ---------------------------------------------------------------- the processor's arithmetic

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The target (height, width): each a multiple of `factor` nearest the original, scaled (keeping the aspect)
    into [min_pixels, max_pixels]. HF's rule, arithmetic included, so the grids agree."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"{width}×{height}: aspect ratio above {MAX_ASPECT}:1 is not supported")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with an alpha band or a transparent colour is composited onto white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def patchify(chw: np.ndarray, config: ImageConfig) -> np.ndarray:
    """[C, H, W] → [gh·gw, C·T·P·P]: rows in 2×2-merge-block order (block row, block col, row, col in the
    block), each patch repeated over the T temporal slots (a still image is T identical frames)."""
    c, height, width = chw.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames).reshape(gh * gw, c * t * p * p)


def preprocess_image(image: Image.Image, config: ImageConfig = ImageConfig(),
                     index: int | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One decoded image → (patch rows float32 [gh·gw, C·T·P·P], grid (1, gh, gw))."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{width}×{height} pixels: an image needs at least one pixel", index)
    try:
        new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    except ImageError as err:
        raise ImageError(str(err), index) from None
    rgb = to_rgb(image).resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    chw = np.asarray(rgb).transpose(2, 0, 1)
    scaled = (chw.astype(np.float64) * (1 / 255)).astype(np.float32)     # in float64, then float32, as HF
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    rows = patchify((scaled - mean) / std, config)
    return rows, (1, new_h // config.patch_size, new_w // config.patch_size)


def preprocess(images: Sequence[bytes | Image.Image], config: ImageConfig = ImageConfig(),
               limits: ImageLimits = ImageLimits()) -> Processed:
    """A request's images (encoded bytes, or decoded Pillow images) → the encoder's input, in order."""
    if len(images) > limits.max_images:
        raise ImageError(f"{len(images)} images in one request exceeds the limit of {limits.max_images}")
    rows, grids, tokens = [], [], 0
    for i, item in enumerate(images):
        if isinstance(item, Image.Image):
            _check_size(*item.size, limits, i)
            image = item
        else:
            image = decode(item, limits, i)
        if limits.max_tokens is not None:          # before the patch rows are made (a large image's are ~100s of MB)
            width, height = image.size
            try:
                h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
            except ImageError as err:
                raise ImageError(str(err), i) from None
            tokens += h * w // config.factor ** 2
            if tokens > limits.max_tokens:
                raise ImageError(f"{w}×{h} pixels after resizing: the request's images come to {tokens:,} image "
                                 f"tokens, over the {limits.max_tokens:,} tokens of the model's context", i)
        r, grid = preprocess_image(image, config, i)
        rows.append(r)
        grids.append(grid)
    dim = 3 * config.temporal_patch_size * config.patch_size ** 2
    pixels = np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
    return Processed(pixels, tuple(grids), config.merge_size)
