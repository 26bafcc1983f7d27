"""qk_rope_kv: q/k zero-centred RMSNorm + partial NeoX RoPE + KV append (INT8-G64 or bf16 pages).

Pages: [num_pages, hkv, page, d] codes (int8 or bf16) and, for int8, fp16 scales [num_pages, hkv,
page, d/64]. Token row r = (batch b, token tt) has position pos[r]; its page is
block_table[b, pos // page]. The RoPE table `inv_freq` is a device input made by `inv_freq()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "qk_rope_kv"
    hq: int
    hkv: int
    d: int
    rd: int                # rotary dims (the first rd of each head)
    b: int
    t: int
    kv_dtype: str          # "int8" or "bf16"
    page: int
    max_pages: int         # block table row length
    eps: float
    arch: str

    def __post_init__(self):
        e = self.d // 32
        half_lanes = (self.rd // 2) // max(e, 1)
        ok = (self.d % 64 == 0 and self.rd % 2 == 0 and (self.rd // 2) % e == 0 and half_lanes > 0
              and half_lanes & (half_lanes - 1) == 0 and self.kv_dtype in ("int8", "bf16"))
        if not ok:
            raise ValueError(f"qk_rope_kv: unsupported shape {self}")

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"r{self.rd}", f"b{self.b}", f"t{self.t}",
                self.kv_dtype, f"p{self.page}x{self.max_pages}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(key.hq + 2 * key.hkv, 4), key.b * key.t, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("q_out", "ptr", "[rows, hq, d] bf16"), Param("q", "ptr", "[rows, hq, 2d] bf16 (query|gate)"),
            Param("k", "ptr", "[rows, hkv, d] bf16"), Param("v", "ptr", "[rows, hkv, d] bf16"),
            Param("q_norm", "ptr", "[d] bf16"), Param("k_norm", "ptr", "[d] bf16"),
            Param("inv_freq", "ptr", "[rd/2] f32"), Param("pos", "ptr", "[rows] int32"),
            Param("block_table", "ptr", "[b, max_pages] int32"), Param("k_pages", "ptr", ""),
            Param("v_pages", "ptr", ""), Param("k_scales", "ptr", "int8 only"), Param("v_scales", "ptr", "")]


def inv_freq(theta: float, rd: int) -> torch.Tensor:
    """θ^(−2m/rd), m = 0 … rd/2 − 1, in fp32 as HF computes it."""
    return 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, rd: int) -> torch.Tensor:
    """NeoX rotate-half on the first rd dims of x [rows, heads, d] (fp32)."""
    ang = pos.float().view(-1, 1) * freqs.view(1, -1)                      # [rows, rd/2]
    cos, sin = torch.cos(ang).unsqueeze(1), torch.sin(ang).unsqueeze(1)
    a, b = x[..., :rd // 2], x[..., rd // 2:rd]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rd:]], dim=-1)


def quantize_kv(x: torch.Tensor):
    """INT8-G64 (MODEL.md §9) over the last dim: (codes int8, scales fp16 [..., d/64])."""
    g = x.float().view(*x.shape[:-1], -1, 64)
    scale = (g.abs().amax(-1) / 127.0).half()
    s = scale.float().unsqueeze(-1)
    codes = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)).clamp(-127, 127), 0)
    return codes.to(torch.int8).flatten(-2), scale


def _zcrms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def reference(key: Key, q, k, v, q_norm, k_norm, freqs, pos, block_table, pages: dict):
    """Returns (q_out, pages') with pages a dict k, v (and k_scales, v_scales for int8), cloned."""
    rows = key.b * key.t
    qf = q.view(rows, key.hq, 2 * key.d)[..., :key.d].float()
    qo = rope(_zcrms(qf, q_norm, key.eps), pos, freqs, key.rd).to(torch.bfloat16)
    kf = rope(_zcrms(k.view(rows, key.hkv, key.d).float(), k_norm, key.eps), pos, freqs, key.rd)
    vf = v.view(rows, key.hkv, key.d).float()
    out = {name: t.clone() for name, t in pages.items()}
    for r in range(rows):
        p = int(pos[r])
        page = int(block_table[r // key.t, p // key.page])
        for name, val in (("k", kf[r]), ("v", vf[r])):
            if key.kv_dtype == "int8":
                codes, scales = quantize_kv(val)
                out[name][page, :, p % key.page] = codes
                out[name + "_scales"][page, :, p % key.page] = scales
            else:
                out[name][page, :, p % key.page] = val.to(torch.bfloat16)
    return qo, out
