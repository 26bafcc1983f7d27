"""test_vision_preprocess: image preprocessing against HF's image processor for `qwen3_5` (the Qwen2-VL image
processor, its Pillow backend) on generated images of several sizes and modes — pixel values bit for bit and the
grids — and the errors a request's bad images get (each names the image and the problem).
"""
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ninfer_gen.vision.preprocess import (ImageConfig, ImageError, ImageLimits, decode, preprocess, smart_resize)

QWEN35 = ImageConfig()                                   # patch 16, merge 2, mean/std 0.5, 256² .. 4096² pixels
SMALL = ImageConfig(patch_size=8, min_pixels=48 * 48, max_pixels=160 * 160,
                    image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))


def _images() -> list[Image.Image]:
    """Five images: RGB, RGBA with varied alpha, L, a tall RGB strip, and a large L; noise plus a gradient so
    resampling and the channel order both show."""
    rng = np.random.default_rng(0)

    def noise(h, w, c):
        grad = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, c))
        return np.clip(grad * 0.5 + rng.integers(0, 128, (h, w, c)), 0, 255).astype(np.uint8)

    return [Image.fromarray(noise(200, 300, 3), "RGB"),
            Image.fromarray(noise(457, 123, 4), "RGBA"),
            Image.fromarray(noise(30, 40, 1)[:, :, 0], "L"),
            Image.fromarray(noise(700, 90, 3), "RGB"),
            Image.fromarray(noise(1000, 1500, 1)[:, :, 0], "L")]


def _hf(images, config: ImageConfig):
    proc = Qwen2VLImageProcessorPil(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                                    merge_size=config.merge_size, image_mean=list(config.image_mean),
                                    image_std=list(config.image_std),
                                    size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels})
    out = proc(images=images, return_tensors="np")
    return out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]


@pytest.mark.parametrize("config", [QWEN35, SMALL], ids=["qwen3.5", "small"])
def test_equal_to_hf_processor(config):
    images = _images()
    ref_pixels, ref_grids = _hf(images, config)
    ours = preprocess(images, config)
    assert ours.grids == tuple(ref_grids)
    assert ours.pixels.dtype == np.float32 and ours.pixels.shape == ref_pixels.shape
    assert np.array_equal(ours.pixels, ref_pixels), f"max |Δ| {np.abs(ours.pixels - ref_pixels).max()}"
    assert ours.tokens == tuple(t * h * w // 4 for t, h, w in ref_grids)


def test_both_resize_branches_are_exercised():
    """The five images go up to min_pixels and down to max_pixels under SMALL (else the test proves less)."""
    sizes = [im.size for im in _images()]
    areas = [h * w for w, h in (smart_resize(h, w, SMALL.factor, SMALL.min_pixels, SMALL.max_pixels)[::-1]
                                for w, h in sizes)]
    raw = [(round(h / 16) * 16) * (round(w / 16) * 16) for w, h in sizes]
    assert any(r < SMALL.min_pixels for r in raw) and any(r > SMALL.max_pixels for r in raw)
    assert all(SMALL.min_pixels <= a <= SMALL.max_pixels for a in areas)


def test_bytes_decode_like_the_images():
    """PNG bytes decode to the same input as the image itself (lossless); a JPEG decodes."""
    images = _images()
    encoded = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        encoded.append(buf.getvalue())
    assert np.array_equal(preprocess(encoded, SMALL).pixels, preprocess(images, SMALL).pixels)
    buf = io.BytesIO()
    images[0].save(buf, "JPEG")
    assert preprocess([buf.getvalue()], SMALL).grids[0][0] == 1


# ---------------------------------------------------------------- errors

def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width × height (no pixel data): what a client could send."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _encoded(fmt: str, size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, fmt)
    return buf.getvalue()


def _truncated_png() -> bytes:
    """A noisy PNG cut in half: the header opens, the pixel data ends early."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()[:len(buf.getvalue()) // 2]


@pytest.mark.parametrize("data,words", [
    (b"\x00garbage\xff" * 10, "not a decodable image"),
    (_truncated_png(), "corrupt or truncated PNG"),
    (_png_header(0, 0), "0×0 pixels"),
    (_png_header(20000, 20000), "20000×20000 = 400,000,000 pixels exceeds the limit"),
    (_encoded("TIFF"), "format TIFF is not supported"),
    (b"", "no data"),
], ids=["corrupt", "truncated", "0x0", "20000x20000", "tiff", "empty"])
def test_bad_image_bytes(data, words):
    with pytest.raises(ImageError, match=words) as info:
        preprocess([_encoded("PNG"), data], SMALL)
    assert str(info.value).startswith("image 2: ") and info.value.index == 1
    assert isinstance(info.value, ValueError)


def test_large_jpeg_is_refused_before_decoding():
    """A JPEG (no size sniffing of ours) past the limit: its header size is checked before the pixels."""
    with pytest.raises(ImageError, match="exceeds the limit of 4,096 pixels"):
        decode(_encoded("JPEG", (100, 100)), ImageLimits(max_input_pixels=4096))


def test_zero_size_pillow_image():
    with pytest.raises(ImageError, match="image 1: 0×0 pixels"):
        preprocess([Image.new("RGB", (0, 0))], SMALL)


def test_limits_are_configurable():
    ok = _encoded("PNG", (40, 30))
    with pytest.raises(ImageError, match="3 images in one request exceeds the limit of 2"):
        preprocess([ok] * 3, SMALL, ImageLimits(max_images=2))
    with pytest.raises(ImageError, match="image 1: .* bytes exceeds the limit of 10 bytes"):
        preprocess([ok], SMALL, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="image 1: 40×30 = 1,200 pixels exceeds the limit of 1,000"):
        preprocess([ok], SMALL, ImageLimits(max_input_pixels=1000))
    with pytest.raises(ImageError, match="aspect ratio above 200:1"):
        preprocess([_encoded("PNG", (1000, 4))], SMALL)
    with pytest.raises(ValueError, match="ImageLimits.max_images"):
        ImageLimits(max_images=0)
    with pytest.raises(ValueError, match="min_pixels 10 exceeds max_pixels 5"):
        ImageConfig(min_pixels=10, max_pixels=5)


def test_config_from_hf_preprocessor_json():
    pre = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
           "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    assert ImageConfig.from_hf(pre) == QWEN35
