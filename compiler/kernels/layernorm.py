"""layernorm: the vision tower's LayerNorm with a bias, one block per row: y = bf16((x − mean) · rsqrt(var + eps)
· w + b), statistics and math in fp32 (compiler.reference_vision.layernorm).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "layernorm"
    h: int                 # row width
    m: int                 # rows
    eps: float
    arch: str

    def __post_init__(self):
        if self.h % 8 or self.h < 8 or self.m < 1 or not 0 < self.eps < 1:
            raise ValueError(f"layernorm: h a multiple of 8 (16-byte loads), m ≥ 1 and 0 < eps < 1 expected, got {self}")

    def _name_parts(self):
        return [f"h{self.h}", f"m{self.m}"]


def threads(key: Key) -> int:
    """32 threads up to 256 chunks of 8 values per row (the tower's widths: 64 to 1152), else 128."""
    return 32 if key.h // 8 <= 256 else 128


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.m, 1, 1), (threads(key), 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, h] bf16"), Param("x", "ptr", "in [m, h] bf16"),
            Param("w", "ptr", "weight [h] bf16"), Param("b", "ptr", "bias [h] bf16")]


def reference(key: Key, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.layer_norm(x.float(), (key.h,), w.float(), b.float(), key.eps)
    return y.to(torch.bfloat16)


def emulate(key: Key, buf) -> None:
    """compiler.emulate: the reference over the call's bound buffers."""
    y = reference(key, buf("x", (key.m, key.h), "bf16"), buf("w", (key.h,), "bf16"), buf("b", (key.h,), "bf16"))
    buf("y", (key.m, key.h), "bf16").copy_(y)
