"""gated_rmsnorm: the GDN output norm y = o · rsqrt(mean(o²) + eps) · w · silu(z) per value head.

The weight multiplies directly (MODEL.md §3.6, not zero-centred). o is the fp32 output of gdn_step.
`key_heads` > 0 writes the heads in llama.cpp's tiled order (passes.fuse_tiled_heads: a GGUF k-quant
out_proj's columns): head h = kh·group + j at output head j·key_heads + kh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gated_rmsnorm"
    hv: int
    dv: int
    m: int                 # rows (batch · tokens)
    eps: float
    arch: str
    key_heads: int = 0     # > 0: output heads in tiled order over this many key heads

    def __post_init__(self):
        if self.dv % 32:
            raise ValueError(f"gated_rmsnorm: dv = {self.dv} must be a multiple of 32")
        if self.key_heads < 0 or (self.key_heads and self.hv % self.key_heads):
            raise ValueError(f"gated_rmsnorm: {self.hv} value heads do not tile over {self.key_heads} key heads")

    def _name_parts(self):
        return [f"h{self.hv}", f"d{self.dv}", f"m{self.m}"] + ([f"t{self.key_heads}"] if self.key_heads else [])


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(key.m * key.hv, 4), 1, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, hv·dv] bf16 (heads tiled when key_heads > 0)"), Param("o", "ptr", "gdn output [m, hv, dv] f32"),
            Param("z", "ptr", "gate [m, hv·dv] bf16"), Param("w", "ptr", "norm weight [dv] bf16")]


def reference(key: Key, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    of = o.float().view(key.m, key.hv, key.dv)
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + key.eps) * w.float()
    y = y * torch.nn.functional.silu(z.float().view(key.m, key.hv, key.dv))
    if key.key_heads:
        y = y.view(key.m, key.key_heads, key.hv // key.key_heads, key.dv).transpose(1, 2)
    return y.reshape(key.m, key.hv * key.dv).to(torch.bfloat16)
