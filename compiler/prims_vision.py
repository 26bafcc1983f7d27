"""prims_vision: shape/dtype rules of the vision encoder's primitives and of the two that bring images into the
text model (image tokens in place of placeholders, M-RoPE), with their torch references (compiler.reference_vision).
`compiler.prims` registers every entry of `RULES` in the primitive table. The fused primitives of the encoder's
pass pipeline (compiler.passes_vision) come last, each with the composition it replaces as its reference; the
lowering rules are compiler.lower_vision's.
"""
from __future__ import annotations

from typing import Callable

from . import reference_vision as ref
from .ir import AVal


def _check(cond: bool, msg: Callable[[], str]) -> None:
    if not cond:
        raise TypeError(msg())


def _linear_bias(x, w, b):
    _check(len(x.shape) == 2 and len(w.shape) == 2 and x.shape[1] == w.shape[1] and b.shape == (w.shape[0],),
           lambda: f"linear_bias: x {x}, weight {w}, bias {b}")
    return [AVal((x.shape[0], w.shape[0]), x.dtype)]


def _layernorm(x, w, b, *, eps):
    _check(w.shape == b.shape == (x.shape[-1],), lambda: f"layernorm: weight {w}, bias {b} for {x}")
    return [x]


def _gelu(x, *, approximate):
    _check(approximate in ("none", "tanh"), lambda: f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return [x]


def _coords(coords, rows: int, name: str) -> None:
    _check(coords.dtype == "i32" and coords.shape == (rows, 4),
           lambda: f"{name}: coords must be i32[{rows},4], got {coords}")


def _pos_embed_bilinear(table, coords, *, side, dtype):
    _check(len(table.shape) == 2 and table.shape[0] == side * side,
           lambda: f"pos_embed_bilinear: table {table}, side {side}")
    _coords(coords, coords.shape[0], "pos_embed_bilinear")
    return [AVal((coords.shape[0], table.shape[1]), dtype)]


def _rope_2d(x, coords, *, theta):
    _check(len(x.shape) == 3 and x.shape[2] % 4 == 0, lambda: f"rope_2d: x must be [N, heads, 4k], got {x}")
    _coords(coords, x.shape[0], "rope_2d")
    return [x]


def _segment_attention(q, k, v, cu_seqlens, *, scale):
    _check(len(q.shape) == 3 and q.shape == k.shape == v.shape, lambda: f"segment_attention: {q} {k} {v}")
    _check(cu_seqlens.dtype == "i32" and len(cu_seqlens.shape) == 1 and cu_seqlens.shape[0] >= 2,
           lambda: f"segment_attention: cu_seqlens must be i32[segments + 1], got {cu_seqlens}")
    return [q]


def _embed_images(x, ids, images, *, token_id):
    _check(len(x.shape) == 2 and ids.dtype == "i32" and ids.shape == (x.shape[0],),
           lambda: f"embed_images: {x} ids {ids}")
    _check(len(images.shape) == 2 and images.shape[1] == x.shape[1] and images.dtype == x.dtype,
           lambda: f"embed_images: image tokens {images} for {x}")
    return [x]


def _mrope(x, pos3, *, rotary_dim, theta, section):
    _check(len(x.shape) == 3 and pos3.dtype == "i32" and pos3.shape == (x.shape[0], 3),
           lambda: f"mrope: {x} with {pos3}")
    _check(rotary_dim % 2 == 0 and rotary_dim <= x.shape[2] and sum(section) == rotary_dim // 2,
           lambda: f"mrope: rotary_dim {rotary_dim}, section {section} for {x}")
    return [x]


def _linear_bias_gelu(x, w, b, *, approximate):
    _gelu(x, approximate=approximate)
    return _linear_bias(x, w, b)


def _linear_bias_residual(x, w, b, res):
    out = _linear_bias(x, w, b)
    _check(res.shape == out[0].shape and res.dtype == x.dtype, lambda: f"linear_bias_residual: residual {res}")
    return out


def _pos_embed_add(x, table, coords, *, side, dtype):
    out = _pos_embed_bilinear(table, coords, side=side, dtype=dtype)
    _check(out[0] == x, lambda: f"pos_embed_add: {x} plus {out[0]}")
    return [x]


def _vision_attention(qkv, coords, cu_seqlens, *, heads, theta, scale):
    n, width = qkv.shape
    _check(len(qkv.shape) == 2 and width % (3 * heads) == 0, lambda: f"vision_attention: qkv {qkv}, {heads} heads")
    d = width // (3 * heads)
    q = AVal((n, heads, d), qkv.dtype)
    _rope_2d(q, coords, theta=theta)
    return _segment_attention(q, q, q, cu_seqlens, scale=scale)


def _ref_vision_attention(qkv, coords, cu_seqlens, *, heads, theta, scale):
    """The traced composition: [n, 3, heads, d] split, rope_2d on q and k, segment_attention."""
    q, k, v = (part.reshape(qkv.shape[0], heads, -1) for part in qkv.reshape(qkv.shape[0], 3, heads, -1).unbind(1))
    return ref.segment_attention(ref.rope_2d(q, coords, theta=theta), ref.rope_2d(k, coords, theta=theta), v,
                                 cu_seqlens, scale=scale)


# name → (shape rule, torch reference)
RULES = {
    "linear_bias": (_linear_bias, ref.linear_bias),
    "layernorm": (_layernorm, ref.layernorm),
    "gelu": (_gelu, ref.gelu),
    "pos_embed_bilinear": (_pos_embed_bilinear, ref.pos_embed_bilinear),
    "rope_2d": (_rope_2d, ref.rope_2d),
    "segment_attention": (_segment_attention, ref.segment_attention),
    "embed_images": (_embed_images, ref.embed_images),
    "mrope": (_mrope, ref.mrope),
    # fused by compiler.passes_vision: references are the compositions they replace (bit for bit)
    "linear_bias_gelu": (_linear_bias_gelu,
                         lambda x, w, b, *, approximate: ref.gelu(ref.linear_bias(x, w, b), approximate=approximate)),
    "linear_bias_residual": (_linear_bias_residual, lambda x, w, b, res: res + ref.linear_bias(x, w, b)),
    "pos_embed_add": (_pos_embed_add, lambda x, table, coords, *, side, dtype:
                      x + ref.pos_embed_bilinear(table, coords, side=side, dtype=dtype)),
    "vision_attention": (_vision_attention, _ref_vision_attention),
}
