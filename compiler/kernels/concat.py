"""concat: two bf16 row blocks side by side, y[m, :k1] = a[m], y[m, k1:] = b[m] — the MTP layer's
input, [normed embedding | normed hidden], before its fc projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "concat"
    m: int
    k1: int
    k2: int
    arch: str

    def __post_init__(self):
        if self.m < 1 or self.k1 % 8 or self.k2 % 8:
            raise ValueError(f"concat: rows ≥ 1 and widths multiples of 8 (16-byte copies) expected, got {self}")

    def _name_parts(self):
        return [f"m{self.m}", f"k{self.k1}", f"k{self.k2}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div((key.k1 + key.k2) // 8, 128), key.m, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, k1 + k2] bf16"), Param("a", "ptr", "[m, k1] bf16"),
            Param("b", "ptr", "[m, k2] bf16")]


def reference(key: Key, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, b], dim=1).to(torch.bfloat16)
