"""pos_embed: the vision tower's learned position grid added to the patch embeddings, in place — row r of x gains
bf16(the side × side table resampled bilinearly at the patch's (row, col) of its image's (height, width)), as
compiler.reference_vision.pos_embed_bilinear computes it and an `add` sums it; padding rows (height 0) gain 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "pos_embed"
    h: int                 # embedding width
    m: int                 # patch rows
    side: int              # the grid's side (table rows = side²)
    arch: str

    def __post_init__(self):
        if self.h % 8 or self.h < 8 or self.m < 1 or self.side < 1:
            raise ValueError(f"pos_embed: h a multiple of 8, m ≥ 1 and side ≥ 1 expected, got {self}")

    def _name_parts(self):
        return [f"h{self.h}", f"m{self.m}", f"s{self.side}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    """One block per patch row, a thread per 8 values."""
    return Launch((key.m, 1, 1), (min(128, 32 * -(-key.h // 256)), 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("x", "ptr", "in place [m, h] bf16: the patch embeddings"),
            Param("table", "ptr", "[side², h] bf16 learned positions"),
            Param("coords", "ptr", "[m, 4] int32 (row, col, height, width) in patches; height 0: padding")]


def reference(key: Key, x: torch.Tensor, table: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    from ..reference_vision import pos_embed_bilinear

    pos = pos_embed_bilinear(table, coords, side=key.side, dtype="bf16")
    return (x.float() + pos.float()).to(torch.bfloat16)


def emulate(key: Key, buf) -> None:
    """compiler.emulate: the reference over the call's bound buffers (x in place)."""
    x = buf("x", (key.m, key.h), "bf16")
    x.copy_(reference(key, x, buf("table", (key.side ** 2, key.h), "bf16"), buf("coords", (key.m, 4), "i32")))
