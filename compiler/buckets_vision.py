"""buckets_vision: the vision encoder's static shapes and their Plans — traced (compiler.trace.trace_vision), fused
(compiler.passes_vision) and lowered like the text model's buckets. A bucket is a count of image tokens (merged
patches; patches = tokens × merge²): 16·2^i up to the largest image the runtime holds, and that largest itself,
so an image runs in the smallest bucket that fits it, its rows past the image's patches padding (zero geometry,
an empty segment tail: zero attention output, rows the caller drops). `images`: the segments one call holds.
"""
from __future__ import annotations

from .options import CompileOptions
from .passes_vision import run_vision_pipeline
from .plan import Plan
from .spec import ModelSpec
from .targets import Target
from .trace import trace_vision

MIN_TOKENS = 16            # the smallest bucket: 64 patches of 2×2 merge blocks (the GEMM's and attention's tiles)
DEFAULT_PATCHES = 4096     # as executor.vision_encoder.DEFAULT_PATCHES: one megapixel on 16-pixel patches


def vision_buckets(spec: ModelSpec, max_patches: int = DEFAULT_PATCHES) -> list[int]:
    """Image-token counts of the encoder's buckets, smallest first: 16·2^i below the most tokens `max_patches`
    patches make, then that count."""
    if spec.vision is None:
        raise ValueError(f"spec {spec.name!r} has no vision section")
    most = max_patches // spec.vision.merge_unit
    if most < 1:
        raise ValueError(f"max_patches {max_patches}: fewer than one merged token of {spec.vision.merge_unit} patches")
    sizes, t = [], MIN_TOKENS
    while t < most:
        sizes.append(t)
        t *= 2
    return sizes + [most]


def bucket_for(tokens: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `tokens` image tokens."""
    fits = [b for b in buckets if b >= tokens]
    if not fits:
        raise ValueError(f"an image of {tokens} tokens exceeds the largest encoder bucket ({max(buckets)} tokens)")
    return min(fits)


def plan_vision(spec: ModelSpec, target: Target, tokens: int, images: int = 1,
                options: CompileOptions = CompileOptions()) -> Plan:
    """The encoder's plan for `tokens` image tokens (tokens × merge² patches) of up to `images` images, bf16."""
    graph = trace_vision(spec, tokens * spec.vision.merge_unit, images, "bf16")
    from .lower import lower
    return lower(run_vision_pipeline(graph, options), spec, target, options)


def plan_vision_profile(spec: ModelSpec, target: Target, max_patches: int = DEFAULT_PATCHES, images: int = 1,
                        options: CompileOptions = CompileOptions()) -> dict[int, Plan]:
    """Every bucket's plan, by image-token count."""
    return {t: plan_vision(spec, target, t, images, options) for t in vision_buckets(spec, max_patches)}
