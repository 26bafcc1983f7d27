"""reference_vision: torch references of the vision encoder's primitives — linear with bias, LayerNorm, GELU, the
learned position grid resampled bilinearly at each patch, 2-D rotary by (row, col), and non-causal attention within
each image's patches (segments given by cu_seqlens) — and of the two that bring images into the text model: image
tokens replacing the placeholders' embeddings, and M-RoPE (3-axis positions). Plain torch, fp32 or bf16
activations; norms, rotary angles and softmax in fp32.

Per-patch geometry comes in `coords` i32[N, 4] = (row, col, image height, image width) in patches; a row with
height 0 is padding (position embedding 0, attention output 0).
"""
from __future__ import annotations

from ._torch import F, torch
from .reference_ops import torch_dtype
from .spec_vision import mrope_axis


def bind_torch() -> None:
    """As reference_ops.bind_torch: the real torch modules from here on."""
    global torch, F
    import torch as real
    torch, F = real, real.nn.functional


def linear_bias(x, w, b):
    return F.linear(x, w.to(x.dtype), b.to(x.dtype))


def layernorm(x, w, b, *, eps):
    y = F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps)
    return y.to(x.dtype)


def gelu(x, *, approximate):
    return F.gelu(x, approximate=approximate)


def _axis_taps(index, size, side: int):
    """Bilinear taps on one axis of a `side`-long grid for positions `index` of `size` (align_corners: the ends
    map to 0 and side − 1): (taps [N, 2] long, weights [N, 2] fp32)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def pos_embed_bilinear(table, coords, *, side, dtype):
    """table [side², H] resampled at each patch: the four grid neighbours of (row, col) scaled onto the grid,
    weighted by the bilinear weights (in fp32); padding rows (height 0) give zeros."""
    coords = coords.long()
    row, col, height, width = coords.unbind(1)
    h_taps, h_w = _axis_taps(row, height, side)
    w_taps, w_w = _axis_taps(col, width, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    out = (table[index].float() * weight[:, :, None]).sum(1)
    return torch.where((height > 0)[:, None], out, torch.zeros_like(out)).to(torch_dtype(dtype))


def rope_2d(x, coords, *, theta):
    """x [N, heads, D], NeoX rotate-half over all D dims in fp32. The D/2 angles are the patch row times the D/4
    frequencies θ^(−4i/D), then its column times the same frequencies."""
    d = x.shape[-1]
    quarter = torch.arange(0, d // 2, 2, dtype=torch.float, device=x.device)
    return rope_2d_freqs(x, coords, 1.0 / (theta ** (quarter / (d // 2))))


def rope_2d_freqs(x, coords, inv_freq):
    """rope_2d with its D/4 fp32 frequencies given (the attention kernel's constant table)."""
    d = x.shape[-1]
    pos = coords[:, :2].float()
    freqs = (pos[:, :, None] * inv_freq).reshape(pos.shape[0], -1)          # [N, D/2]: rows' then columns'
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    xf = x.float()
    rotated = torch.cat((-xf[..., d // 2:], xf[..., :d // 2]), dim=-1)
    return (xf * emb.cos() + rotated * emb.sin()).to(x.dtype)


def segment_attention(q, k, v, cu_seqlens, *, scale):
    """Non-causal softmax attention of each patch over the patches of its own segment [cu[i], cu[i+1]);
    q, k, v [N, heads, D]; rows past the last segment are padding (zeros)."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            # [1, heads, n, D] contiguous: the shape torch's fused kernels take (O(n) memory on a GPU); strided 3-D
            # views fell back to the math kernel, whose [heads, n, n] fp32 scores (1 GiB at 4,096 patches) did
            # not fit the 27B's memory plan on the H100
            qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0]
            out[lo:hi] = o.transpose(0, 1)
    return out


def embed_images(x, ids, images, *, token_id):
    """x [N, H] with the rows whose token is `token_id` replaced, in order, by image tokens [M, H]; rows of
    `images` past the placeholders are padding."""
    rows = (ids.reshape(-1) == token_id).nonzero().reshape(-1)
    if rows.numel() > images.shape[0]:
        raise ValueError(f"embed_images: {rows.numel()} image placeholders but {images.shape[0]} image tokens")
    out = x.clone()
    out[rows] = images[: rows.numel()].to(x.dtype)
    return out


_MROPE_AXES: dict = {}


def _mrope_axes(section: tuple, frequencies: int, device):
    """The position axis of each RoPE frequency (compiler.spec_vision.mrope_axis), as an index tensor."""
    key = (section, frequencies, device)
    if key not in _MROPE_AXES:
        _MROPE_AXES[key] = torch.tensor([mrope_axis(j, section) for j in range(frequencies)], device=device)
    return _MROPE_AXES[key]


def mrope(x, pos3, *, rotary_dim, theta, section):
    """RoPE as `reference_ops.rope` (NeoX rotate-half on the first `rotary_dim` dims, the same angle arithmetic)
    with frequency j at the position of axis mrope_axis(j) of pos3 [N, 3] (temporal, height, width). Rows whose
    three positions are equal get exactly `rope`'s result."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=x.device) / rotary_dim))
    axes = _mrope_axes(tuple(section), rotary_dim // 2, x.device)
    pos = pos3.float().gather(1, axes[None, :].expand(pos3.shape[0], -1))         # [N, rotary_dim / 2]
    freqs = pos * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
