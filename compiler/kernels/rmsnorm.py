"""rmsnorm: fused residual add + zero-centred RMSNorm (MODEL.md §2), one block per row.

`add=True`: x ← bf16(x + delta) is written back (the residual stream) and then normalised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "rmsnorm"
    h: int
    m: int
    add: bool
    out_dtype: str         # "bf16" or "f32"
    eps: float
    arch: str

    def __post_init__(self):
        if self.h % 8 or self.out_dtype not in ("bf16", "f32"):
            raise ValueError(f"rmsnorm: h must be a multiple of 8 and out_dtype bf16/f32, got {self}")

    def _name_parts(self):
        return [f"h{self.h}", f"m{self.m}"] + (["add"] if self.add else []) + \
            (["f32"] if self.out_dtype == "f32" else [])


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.m, 1, 1), (128 if key.h // 8 >= 512 else 32, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "normalised out [m, h]"),
            Param("x", "ptr", "residual stream [m, h] bf16 (updated in place when add)"),
            Param("delta", "ptr", "[m, h] bf16 added to x (0 unless add)"),
            Param("w", "ptr", "norm weight [h] bf16, used as (1 + w)")]


def reference(key: Key, x: torch.Tensor, w: torch.Tensor, delta: torch.Tensor | None = None):
    """Returns (y, new x)."""
    if key.add:
        x = (x.float() + delta.float()).to(torch.bfloat16)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + key.eps) * (1.0 + w.float())
    return (y if key.out_dtype == "f32" else y.to(torch.bfloat16)), x
