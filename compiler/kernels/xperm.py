"""xperm: the activations of a prefill GEMM rearranged for gemm_wg's 16-byte staging.

x [M, K] bf16 → xp [K/64, M, 64] bf16: unit-major (a gemm_wg tile of one unit is then BN contiguous
128-byte rows), each row's 64 columns in the k-slot order of the weight layout
(compiler/kernels/weight_layout.py): k slot 16s + 8h + 2t' + e holds column 16t' + 4s + 2h + e. The
lowering emits one before every gemm_wg call, writing the call's workspace `xp`
(templates/xperm.cu.j2); the swizzle stays gemm_wg's business (shared memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div

ROWS = 32                       # rows of one unit per block (templates/xperm.cu.j2), 8 threads per row


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "xperm"
    m: int
    k: int
    arch: str

    def __post_init__(self):
        if self.m < 1 or self.k < 64 or self.k % 64:
            raise ValueError(f"xperm: bad key {self} (k a multiple of 64)")

    def _name_parts(self):
        return [f"m{self.m}", f"k{self.k}"]


def make_key(m: int, k: int, target: Target) -> Key:
    return Key(m, k, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    """Block (row group, unit): 32 rows × 64 columns, one 16-byte chunk per thread."""
    return Launch((ceil_div(key.m, ROWS), key.k // 64, 1), (8 * ROWS, 1, 1), 0)


def workspace(key: Key) -> dict[str, int]:
    """The permuted copy (the same name and size as the gemm_wg call it feeds: one region)."""
    return {"xp": 2 * key.m * key.k}


def params(key: Key) -> list[Param]:
    return [Param("xp", "ptr", "out [K/64, M, 64] bf16 in k-slot order"), Param("x", "ptr", "in [M, K] bf16")]


def slot_columns() -> torch.Tensor:
    """Column of each k slot within a 64-column unit (int64 [64])."""
    p = torch.arange(64)
    s, h, t, e = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
    return 16 * t + 4 * s + 2 * h + e


def reference(key: Key, x: torch.Tensor) -> torch.Tensor:
    units = x.view(key.m, key.k // 64, 64)[:, :, slot_columns().to(x.device)]
    return units.permute(1, 0, 2).contiguous()
