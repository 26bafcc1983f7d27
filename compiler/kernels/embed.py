"""embed: token embedding gather from a W8G32 (row-major codes + scales), bf16 or GGUF k-quant table.

The table is the QTensor's own row-major `codes` [V, H] and `scales` [V, H/32], or a k-quant's rows of
super-blocks as stored (compiler.kquant): a gather reads whole rows, so it does not use the GEMM
fragment layout. A k-quant row is decoded with the reference's fp32 operations in its order (bit-exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..kquant import KFORMATS, KQTensor, QK_K
from ..kquant import dequantize as dequantize_kquant
from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "embed"
    fmt: str               # "w8g32", "bf16" or a k-quant (q4_k, q5_k, q6_k)
    h: int
    m: int
    arch: str

    def __post_init__(self):
        if self.fmt not in ("w8g32", "bf16", *KFORMATS) or self.h % (QK_K if self.fmt in KFORMATS else 32):
            raise ValueError(f"embed: fmt w8g32/bf16 and h a multiple of 32, or a k-quant and h a multiple of "
                             f"{QK_K}, expected, got {self}")

    def _name_parts(self):
        return [self.fmt, f"h{self.h}", f"m{self.m}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.m, 1, 1), (128 if key.h >= 2048 else 32, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, h] bf16"), Param("ids", "ptr", "token ids [m] int32"),
            Param("table", "ptr", "codes [V, h] int8, bf16 [V, h], or k-quant super-blocks [V, h/256 · block bytes]"),
            Param("scales", "ptr", "[V, h/32] fp16 (w8g32; else 0)")]


def reference(key: Key, ids: torch.Tensor, table) -> torch.Tensor:
    rows = ids.long()
    if isinstance(table, KQTensor):
        return dequantize_kquant(table.rows(rows.to(table.blocks.device))).to(torch.bfloat16).to(ids.device)
    if key.fmt == "bf16":
        return table[rows].to(torch.bfloat16)
    codes, scales = table.codes[rows].float(), table.scales[rows].float()
    return (codes * scales.repeat_interleave(32, dim=1)).to(torch.bfloat16)
