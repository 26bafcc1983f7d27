"""vision_model: the Qwen3.5-family vision encoder written ONCE against `compiler.ops` — patch embedding (the
checkpoint's conv3d, whose stride equals its kernel, is a matmul over flattened patches), the learned position
grid resampled bilinearly per image, pre-norm blocks of 2-D-rotary attention within each image and a GELU MLP,
then the 2×2 patch merger into the text model's width.

Traced by `compiler.trace.trace_vision`, or run eagerly (`encode`). A call encodes several images at once:
patches [N, C·T·P·P] in the preprocessor's order (2×2 merge blocks), with per-patch geometry and per-image
segment bounds from `encoder_inputs` (host-side, like every per-call value).
"""
from __future__ import annotations

from .ops import EagerOps, Ops
from .spec import ModelSpec
from .spec_vision import VisionSpec

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def vision_block(ops: Ops, v: VisionSpec, W, p: str, x, coords, cu_seqlens):
    """x + attention(LN1(x)), then + MLP(LN2(x)); attention is non-causal within each image's patches."""
    n, d, heads = x.shape[0], v.head_dim, v.num_heads
    h = ops.layernorm(x, W(f"{p}norm1.weight"), W(f"{p}norm1.bias"), v.layer_norm_eps)
    qkv = ops.reshape(ops.linear_bias(h, W(f"{p}attn.qkv.weight"), W(f"{p}attn.qkv.bias")), n, 3, heads, d)
    q, k, val = (ops.reshape(ops.slice(qkv, 1, i, i + 1), n, heads, d) for i in range(3))
    q, k = ops.rope_2d(q, coords, v.rope_theta), ops.rope_2d(k, coords, v.rope_theta)
    o = ops.reshape(ops.segment_attention(q, k, val, cu_seqlens, d ** -0.5), n, v.hidden_size)
    x = ops.add(x, ops.linear_bias(o, W(f"{p}attn.proj.weight"), W(f"{p}attn.proj.bias")))
    h = ops.layernorm(x, W(f"{p}norm2.weight"), W(f"{p}norm2.bias"), v.layer_norm_eps)
    h = ops.gelu(ops.linear_bias(h, W(f"{p}mlp.linear_fc1.weight"), W(f"{p}mlp.linear_fc1.bias")), _GELU[v.hidden_act])
    return ops.add(x, ops.linear_bias(h, W(f"{p}mlp.linear_fc2.weight"), W(f"{p}mlp.linear_fc2.bias")))


def patch_merger(ops: Ops, v: VisionSpec, W, x):
    """LayerNorm per patch, then each merge block's patches (consecutive rows) side by side → MLP (exact GELU)."""
    h = ops.layernorm(x, W("visual.merger.norm.weight"), W("visual.merger.norm.bias"), v.layer_norm_eps)
    h = ops.reshape(h, x.shape[0] // v.merge_unit, v.hidden_size * v.merge_unit)
    h = ops.gelu(ops.linear_bias(h, W("visual.merger.linear_fc1.weight"), W("visual.merger.linear_fc1.bias")), "none")
    return ops.linear_bias(h, W("visual.merger.linear_fc2.weight"), W("visual.merger.linear_fc2.bias"))


def vision_forward(ops: Ops, spec: ModelSpec, W, pixels, coords, cu_seqlens):
    """Patches [N, C·T·P·P] → image tokens [N / merge², out_hidden_size]."""
    v = spec.vision
    proj = ops.reshape(W("visual.patch_embed.proj.weight"), v.hidden_size, v.patch_dim)
    x = ops.linear_bias(pixels, proj, W("visual.patch_embed.proj.bias"))
    x = ops.add(x, ops.pos_embed_bilinear(W("visual.pos_embed.weight"), coords, v.grid_side))
    for i in range(v.depth):
        x = vision_block(ops, v, W, f"visual.blocks.{i}.", x, coords, cu_seqlens)
    return patch_merger(ops, v, W, x)


def encoder_inputs(grids, merge: int, patches: int | None = None, images: int | None = None):
    """Per-call inputs of an encoder call over images of `grids` (t, h, w in patches), padded to a bucket of
    `patches` rows and `images` segments: coords i32[patches, 4] = (row, col, height, width) of each patch in
    the preprocessor's merge-block order (padding rows all 0), cu_seqlens i32[images + 1] (padding segments
    empty)."""
    from ._torch import torch

    total = sum(t * h * w for t, h, w in grids)
    patches = total if patches is None else patches
    images = len(grids) if images is None else images
    if patches < total or images < len(grids):
        raise ValueError(f"{len(grids)} images of {total} patches do not fit a bucket of {images} images, "
                         f"{patches} patches")
    coords, bounds = [], [0]
    for t, h, w in grids:
        if t != 1 or h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)}: expected one frame and sides that are multiples of {merge}")
        i = torch.arange(h * w)
        blocks_w = w // merge
        row = i // (merge * merge * blocks_w) * merge + (i // merge) % merge
        col = (i // (merge * merge)) % blocks_w * merge + i % merge
        coords.append(torch.stack([row, col, torch.full_like(i, h), torch.full_like(i, w)], dim=1))
        bounds.append(bounds[-1] + h * w)
    coords.append(torch.zeros(patches - total, 4, dtype=torch.long))
    bounds += [bounds[-1]] * (images - len(grids))
    return torch.cat(coords).to(torch.int32), torch.tensor(bounds, dtype=torch.int32)


def encode(spec: ModelSpec, params: dict, pixels, grids):
    """Eager encoder over one request's images: pixels [Σ patches, C·T·P·P] (tensor), grids [(t, h, w)] →
    image tokens [Σ tokens, out_hidden_size] in the pixels' dtype."""
    import torch

    dtype = "bf16" if pixels.dtype == torch.bfloat16 else "f32"
    coords, cu_seqlens = encoder_inputs(grids, spec.vision.spatial_merge_size)
    return vision_forward(EagerOps(dtype), spec, params.__getitem__, pixels, coords.to(pixels.device),
                          cu_seqlens.to(pixels.device))
