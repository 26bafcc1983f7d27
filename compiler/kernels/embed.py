"""embed: token embedding gather from a W8G32 (row-major codes + scales) or bf16 table.

The table is the QTensor's own row-major `codes` [V, H] and `scales` [V, H/32]: a gather reads whole
rows, so it does not use the GEMM fragment layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "embed"
    fmt: str               # "w8g32" or "bf16"
    h: int
    m: int
    arch: str

    def __post_init__(self):
        if self.fmt not in ("w8g32", "bf16") or self.h % 32:
            raise ValueError(f"embed: fmt w8g32/bf16 and h a multiple of 32 expected, got {self}")

    def _name_parts(self):
        return [self.fmt, f"h{self.h}", f"m{self.m}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.m, 1, 1), (128 if key.h >= 2048 else 32, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, h] bf16"), Param("ids", "ptr", "token ids [m] int32"),
            Param("table", "ptr", "codes [V, h] int8 or bf16 [V, h]"),
            Param("scales", "ptr", "[V, h/32] fp16 (0 for bf16)")]


def reference(key: Key, ids: torch.Tensor, table) -> torch.Tensor:
    rows = ids.long()
    if key.fmt == "bf16":
        return table[rows].to(torch.bfloat16)
    codes, scales = table.codes[rows].float(), table.scales[rows].float()
    return (codes * scales.repeat_interleave(32, dim=1)).to(torch.bfloat16)
