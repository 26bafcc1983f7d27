"""qk_rope_kv: q/k zero-centred RMSNorm + partial NeoX RoPE + KV append (INT8-G64 or bf16 pages).

Pages: [num_pages, hkv, page, d] codes (int8 or bf16) and, for int8, fp16 scales [num_pages, hkv,
page, d/64]. Token row r = (batch b, token tt) has position pos[r]; its page is
block_table[b, pos // page]. The RoPE table `inv_freq` is a device input made by `inv_freq()`.
M-RoPE (`mrope`: the spec's mrope_section, a prompt with images): the rotation reads the rows' 3-axis
positions `rope_pos` [rows, 3] instead, frequency m at axis spec_vision.mrope_axis(m); `pos` still places
the row in its page. A row with three equal positions gets the 1-D kernel's bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..spec_vision import mrope_axis
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
    mrope: tuple[int, ...] = ()    # M-RoPE section (temporal, height, width frequencies); () = 1-D RoPE

    def __post_init__(self):
        object.__setattr__(self, "mrope", tuple(self.mrope))       # hashable whatever sequence came in
        if self.mrope and (len(self.mrope) != 3 or min(self.mrope) < 0 or sum(self.mrope) != self.rd // 2):
            raise ValueError(f"qk_rope_kv: an M-RoPE section is three counts ≥ 0 summing to rd/2 = {self.rd // 2}, "
                             f"got {list(self.mrope)}")
        e = self.d // 32
        half_lanes = (self.rd // 2) // max(e, 1)
        ok = (self.d % 64 == 0 and self.rd % 2 == 0 and (self.rd // 2) % e == 0 and half_lanes > 0
              and half_lanes & (half_lanes - 1) == 0 and self.kv_dtype in ("int8", "bf16"))
        if not ok:
            raise ValueError(f"qk_rope_kv: unsupported shape {self}")

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"r{self.rd}", f"b{self.b}", f"t{self.t}",
                self.kv_dtype, f"p{self.page}x{self.max_pages}"] + \
            (["mr" + "x".join(map(str, self.mrope))] if self.mrope else [])


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(key.hq + 2 * key.hkv, 4), key.b * key.t, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("q_out", "ptr", "[rows, hq, d] bf16"), Param("q", "ptr", "[rows, hq, 2d] bf16 (query|gate)"),
            Param("k", "ptr", "[rows, hkv, d] bf16"), Param("v", "ptr", "[rows, hkv, d] bf16"),
            Param("q_norm", "ptr", "[d] bf16"), Param("k_norm", "ptr", "[d] bf16"),
            Param("inv_freq", "ptr", "[rd/2] f32"), Param("pos", "ptr", "[rows] int32"),
            Param("block_table", "ptr", "[b, max_pages] int32"), Param("k_pages", "ptr", ""),
            Param("v_pages", "ptr", ""), Param("k_scales", "ptr", "int8 only"), Param("v_scales", "ptr", "")] + \
        ([Param("rope_pos", "ptr", "[rows, 3] int32 M-RoPE positions (temporal, height, width)")] if key.mrope else [])


def inv_freq(theta: float, rd: int) -> torch.Tensor:
    """θ^(−2m/rd), m = 0 … rd/2 − 1, in fp32 as HF computes it."""
    return 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, rd: int, section: tuple = ()) -> torch.Tensor:
    """NeoX rotate-half on the first rd dims of x [rows, heads, d] (fp32). With an M-RoPE `section`, pos is
    [rows, 3] and frequency m turns by the position of axis mrope_axis(m) (the same fp32 product)."""
    if section:
        pos3 = pos.view(-1, 3)
        axes = torch.tensor([mrope_axis(m, tuple(section)) for m in range(rd // 2)], device=pos.device)
        ang = pos3.gather(1, axes.view(1, -1).expand(pos3.shape[0], -1)).float() * freqs.view(1, -1)
    else:
        ang = pos.float().view(-1, 1) * freqs.view(1, -1)                  # [rows, rd/2]
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


def reference(key: Key, q, k, v, q_norm, k_norm, freqs, pos, block_table, pages: dict, rope_pos=None):
    """Returns (q_out, pages') with pages a dict k, v (and k_scales, v_scales for int8), cloned. An M-RoPE key
    takes `rope_pos` [rows, 3] for the rotation; `pos` places the rows in the pages either way."""
    rows = key.b * key.t
    if key.mrope and rope_pos is None:
        raise ValueError(f"{key.name}: an M-RoPE key needs rope_pos [rows, 3]")
    turn = rope_pos if key.mrope else pos
    qf = q.view(rows, key.hq, 2 * key.d)[..., :key.d].float()
    qo = rope(_zcrms(qf, q_norm, key.eps), turn, freqs, key.rd, key.mrope).to(torch.bfloat16)
    kf = rope(_zcrms(k.view(rows, key.hkv, key.d).float(), k_norm, key.eps), turn, freqs, key.rd, key.mrope)
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
