"""gemv: the quantised skinny GEMM family (decode, verify and cohorts, M ≤ 32) on mma.sync.

y[M, N_out] = epilogue(x[M, K] · W[N, K]ᵀ) with W in a weight_layout format. The config that fixes the
reduction order (`warps`, the K split) depends on (fmt, N, K, target) only, never on M: that is what
makes decode, verify and every cohort produce identical bits per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from .weight_layout import FORMATS, dequantize, group_of

EPILOGUES = ("none", "residual", "silu_mul")
OUT_DTYPES = ("bf16", "f32")


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gemv"
    fmt: str
    n: int                 # weight rows (for silu_mul: 2·F, gate and up fused)
    k: int
    m: int                 # activation rows, 1..32
    epilogue: str
    out_dtype: str
    warps: int             # warps per block, each owning units u ≡ warp (mod warps): fixes the order
    tiles: int             # 16-row tiles per block
    arch: str

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"gemv: unknown weight format {self.fmt!r} (expected {', '.join(FORMATS)})")
        if not 1 <= self.m <= 32:
            raise ValueError(f"gemv: m = {self.m} outside 1..32 (use the prefill GEMM)")
        if self.k % group_of(self.fmt):
            raise ValueError(f"gemv: k = {self.k} not a multiple of the {self.fmt} group")
        if self.epilogue not in EPILOGUES or self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"gemv: bad epilogue/out_dtype {self.epilogue!r}/{self.out_dtype!r}")
        if self.epilogue == "silu_mul" and (self.n % 16):
            raise ValueError("gemv: silu_mul needs n = 2·F with F a multiple of 8")

    def _name_parts(self):
        parts = [self.fmt, f"n{self.n}", f"k{self.k}", f"m{self.m}"]
        parts += [] if self.epilogue == "none" else [{"residual": "res", "silu_mul": "silu"}[self.epilogue]]
        parts += ["f32"] if self.out_dtype == "f32" else []
        return parts + [f"w{self.warps}t{self.tiles}"]


def config(fmt: str, n: int, k: int, m: int, target: Target) -> tuple[int, int]:
    """(warps, tiles). `warps` fixes the reduction order, so it reads the shape and the card only,
    never M (batch invariance); `tiles` (row tiles per block, reusing activations) may follow M."""
    row_tiles = ceil_div(n, 16)
    units = k // group_of(fmt)
    warps = 8 if row_tiles < 2 * target.sms and units >= 32 else 4
    tiles = 2 if m > 8 and row_tiles >= 16 * target.sms else 1
    return warps, tiles


def make_key(fmt: str, n: int, k: int, m: int, target: Target, epilogue: str = "none",
             out_dtype: str = "bf16") -> Key:
    warps, tiles = config(fmt, n, k, m, target)
    return Key(fmt, n, k, m, epilogue, out_dtype, warps, tiles, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(ceil_div(key.n, 16), key.tiles), 1, 1), (32 * key.warps, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "out [m, n] (n/2 for silu_mul), bf16 or f32; may alias res"),
            Param("x", "ptr", "activations [m, k] bf16, contiguous"),
            Param("w_lo", "ptr", "packed plane 'lo' (weight_layout.pack_for_device)"),
            Param("w_hi", "ptr", "packed plane 'hi' (q5g64/q6g64; else 0)"),
            Param("w_scales", "ptr", "packed scales (0 for bf16)"),
            Param("res", "ptr", "residual [m, n] bf16 for epilogue 'residual' (else 0)")]


def reference(key: Key, x: torch.Tensor, w, res: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 math on the dequantised weight; `w` is the logical (unpacked) matrix or QMatrix."""
    y = x.float() @ dequantize(w).to(x.device).T
    if key.epilogue == "silu_mul":
        f = key.n // 2
        y = torch.nn.functional.silu(y[:, :f]) * y[:, f:]
    elif key.epilogue == "residual":
        y = y + res.float()
    return y if key.out_dtype == "f32" else y.to(torch.bfloat16)
