"""cases_vision: Case builders for the vision encoder's own families (layernorm, pos_embed, attn_vision); its GEMMs
are lab.cases' (bias epilogues). Segment bounds and patch geometry come from compiler.vision_model.encoder_inputs:
images of different sizes, padding rows after them (zero outputs, compared too)."""
from __future__ import annotations

import torch

from compiler.kernels import attn_vision, layernorm, pos_embed
from compiler.vision_model import encoder_inputs
from lab.cases import Case, randn


def grids_for(m: int, segments: int) -> list[tuple[int, int, int]]:
    """`segments` images of even sides and different sizes in ≤ m patches, leaving padding rows after them where
    m has room for them (so the kernels' padding path runs too)."""
    grids, left = [], m - (4 if m > 4 * segments else 0)
    for s in range(segments):
        share = max(4, left // (2 ** (segments - s)) if s < segments - 1 else left)
        h = max(2, int(share ** 0.5) // 2 * 2)
        w = max(2, share // h // 2 * 2)
        grids.append((1, h, w))
        left -= h * w
    assert left >= 0, (m, segments, grids)
    return grids


def _layernorm(key: layernorm.Key, g) -> Case:
    x, w, b = randn((key.m, key.h), g, scale=2.0), 1 + randn((key.h,), g, scale=0.1), randn((key.h,), g)
    y = torch.empty_like(x)
    return Case([(key, [y, x, w, b])], {"y": y}, {}, lambda: {"y": layernorm.reference(key, x, w, b)}, {"y": "bf16"},
                4 * key.m * key.h, 8 * key.m * key.h)


def _pos_embed(key: pos_embed.Key, g) -> Case:
    coords, _ = encoder_inputs(grids_for(key.m, 2), 2, key.m, 2)
    coords = coords.to(g.device)
    x, table = randn((key.m, key.h), g), randn((key.side ** 2, key.h), g)
    x0 = x.clone()
    return Case([(key, [x, table, coords])], {}, {"x": x}, lambda: {"x": pos_embed.reference(key, x0, table, coords)},
                {"x": "bf16"}, 4 * key.m * key.h * 2 + key.m * 16, 8 * key.m * key.h)


def _attn_vision(key: attn_vision.Key, g, theta: float = 10000.0) -> Case:
    coords, cu = encoder_inputs(grids_for(key.m, key.segments), 2, key.m, key.segments)
    coords, cu = coords.to(g.device), cu.to(g.device)
    qkv = randn((key.m, 3 * key.heads * key.d), g)
    freqs = attn_vision.inv_freq(theta, key.d).to(g.device)
    out = torch.empty(key.m, key.heads, key.d, device=g.device, dtype=torch.bfloat16)
    lens = (cu[1:] - cu[:-1]).double()
    flops = int(4 * key.heads * key.d * (lens ** 2).sum().item())
    return Case([(key, [out, qkv, coords, cu, freqs])], {"out": out}, {},
                lambda: {"out": attn_vision.reference(key, qkv, coords, cu, freqs)}, {"out": "bf16"},
                qkv.numel() * 2 + out.numel() * 2, flops)


BUILDERS = {"layernorm": _layernorm, "pos_embed": _pos_embed, "attn_vision": _attn_vision}
