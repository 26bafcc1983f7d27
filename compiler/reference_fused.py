"""reference_fused: torch references of the fused primitives the passes make (compiler.passes) — each a
composition of the primitives' own references in reference_ops, so a fused graph computes what the
unfused one does: add + norm, norm + RoPE (+ the KV append), the GDN gates + step, a projection with its
residual, SiLU·mul, conv, or its RMSNorm split into tile sums and a scale, and the gated attention output.
"""
from __future__ import annotations

from ._torch import F, torch
from .reference_ops import (gated_rmsnorm, gdn_conv, gdn_gates, gdn_recurrence, kv_append, linear, paged_attention,
                            rmsnorm, rope)


def bind_torch() -> None:
    """As reference_ops.bind_torch: the real torch modules from here on."""
    global torch, F
    import torch as real
    torch, F = real, real.nn.functional


def add_rmsnorm(x, y, w, *, eps, offset):
    total = x + y
    return total, rmsnorm(total, w, eps=eps, offset=offset)


def silu_mul(a, b):
    return F.silu(a) * b


def norm_rope(x, w, pos, *, eps, offset, rotary_dim, theta, section=()):
    """`section` (M-RoPE): `pos` is i32[N, 3], the rotation reference_vision.mrope's; else 1-D RoPE."""
    normed = rmsnorm(x, w, eps=eps, offset=offset)
    if section:
        from .reference_vision import mrope
        return mrope(normed, pos, rotary_dim=rotary_dim, theta=theta, section=section)
    return rope(normed, pos, rotary_dim=rotary_dim, theta=theta)


def qk_rope_kv(q, k, v, q_norm, k_norm, row_pos, block_table, pos, *cache, eps, offset, rotary_dim, theta,
               page_size, section=()):
    """q and k normed and roped, K/V appended to the pages; returns the roped q. `section` (M-RoPE):
    `row_pos` is the rows' 3-axis positions i32[N, 3]; the cache positions are always `pos` + t."""
    rope_params = dict(eps=eps, offset=offset, rotary_dim=rotary_dim, theta=theta, section=section)
    k_roped = norm_rope(k, k_norm, row_pos, **rope_params).reshape(v.shape)
    kv_append(k_roped, v, block_table, pos, *cache, page_size=page_size)
    return norm_rope(q, q_norm, row_pos, **rope_params)


def gdn_step(q, k, v, a, b, a_log, dt_bias, state, slots):
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    shape = v.shape[:3]
    return gdn_recurrence(q, k, v, g.reshape(shape), beta.reshape(shape), state, slots)


def linear_residual(x, w, residual):
    return residual + linear(x, w)


def linear_silu_mul(x, w_gate, w_up):
    return silu_mul(linear(x, w_gate), linear(x, w_up))


# The RMSNorm split over the projections around it (passes.fold_norms_into_projections): the producer
# writes h, xn = h·(offset + w) and Σ h² per 16-column tile; a reader scales its products by
# rsqrt(Σ / H + eps). Exact in real arithmetic; in bf16 the normalised activations are rounded before
# the scale instead of after it.
def norm_tile_sums(h):
    """[rows, n] → [rows, n/16] fp32: Σ h² over each 16-column tile."""
    return h.float().pow(2).reshape(h.shape[0], -1, 16).sum(-1)


def inverse_rms(ssq, eps):
    """[rows, n/16] tile sums → [rows, 1] rsqrt(mean(h²) + eps)."""
    return torch.rsqrt(ssq.float().sum(-1, keepdim=True) / (16 * ssq.shape[-1]) + eps)


def linear_residual_norm(x, w, residual, norm_w, *, offset):
    h = linear_residual(x, w, residual)
    return h, (h.float() * (offset + norm_w.float())).to(h.dtype), norm_tile_sums(h)


def scaled_linear(xn, ssq, w, *, eps):
    return ((xn.float() @ w.float().t()) * inverse_rms(ssq, eps)).to(xn.dtype)


def linear_conv(x, w, conv_w, history, slots):
    """The GDN qkv projection of a one-token step with its conv (passes.fold_conv_into_projection)."""
    y = linear(x, w)
    return gdn_conv(y.reshape(y.shape[0], 1, y.shape[1]), conv_w, history, slots)


def scaled_linear_conv(xn, ssq, w, conv_w, history, slots, *, eps):
    y = scaled_linear(xn, ssq, w, eps=eps)
    return gdn_conv(y.reshape(y.shape[0], 1, y.shape[1]), conv_w, history, slots)


def scaled_linear_silu_mul(xn, ssq, w_gate, w_up, *, eps):
    r = inverse_rms(ssq, eps)
    return silu_mul((xn.float() @ w_gate.float().t()) * r, (xn.float() @ w_up.float().t()) * r).to(xn.dtype)


def gated_paged_attention(q, gate, block_table, pos, *cache, page_size, scale):
    o = paged_attention(q, block_table, pos, *cache, page_size=page_size, scale=scale)
    return o.reshape(gate.shape) * torch.sigmoid(gate)


def gated_rmsnorm_tiled(x, z, w, *, eps, key_heads):
    """gated_rmsnorm, its value heads then in llama.cpp's tiled order [N, group, key_heads, dv] (what a GGUF
    k-quant out_proj's columns take: compiler.model's transpose, fused)."""
    y = gated_rmsnorm(x, z, w, eps=eps)
    n, hv, dv = y.shape
    return y.reshape(n, key_heads, hv // key_heads, dv).transpose(1, 2).contiguous()
