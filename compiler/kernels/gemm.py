"""gemm: the quantised prefill GEMM (M = a prefill chunk), mma.sync with the gemv weight layout.

Same first six arguments (no split-K workspace), epilogues and reference as gemv; tiles of 64 weight
rows × 64 tokens per block.
Its K order differs from gemv (no split over warps), so prefill and decode agree to rounding only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from . import gemv
from .weight_layout import FORMATS, group_of

BM, ROWS_PER_BLOCK = 64, 64      # must match templates/gemm.cu.j2


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gemm"
    fmt: str
    n: int
    k: int
    m: int                 # tokens per call (the prefill chunk)
    epilogue: str
    out_dtype: str
    arch: str

    def __post_init__(self):
        if self.fmt not in FORMATS or self.k % group_of(self.fmt) or self.m < 1:
            raise ValueError(f"gemm: bad key {self}")
        if self.epilogue not in gemv.EPILOGUES or self.out_dtype not in gemv.OUT_DTYPES:
            raise ValueError(f"gemm: bad epilogue/out_dtype {self.epilogue!r}/{self.out_dtype!r}")

    def _name_parts(self):
        parts = [self.fmt, f"n{self.n}", f"k{self.k}", f"m{self.m}"]
        parts += [] if self.epilogue == "none" else [{"residual": "res", "silu_mul": "silu"}[self.epilogue]]
        return parts + (["f32"] if self.out_dtype == "f32" else [])


def make_key(fmt, n, k, m, target: Target, epilogue="none", out_dtype="bf16") -> Key:
    return Key(fmt, n, k, m, epilogue, out_dtype, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((ceil_div(key.m, BM), ceil_div(ceil_div(key.n, 16), ROWS_PER_BLOCK // 16), 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    """gemv's first six arguments (no split-K workspace)."""
    return [Param("y", "ptr", "out [m, n] (n/2 for silu_mul), bf16 or f32; may alias res"),
            Param("x", "ptr", "activations [m, k] bf16, contiguous"),
            Param("w_lo", "ptr", "packed plane 'lo' (weight_layout.pack_for_device)"),
            Param("w_hi", "ptr", "packed plane 'hi' (q5g64/q6g64; else 0)"),
            Param("w_scales", "ptr", "packed scales (0 for bf16)"),
            Param("res", "ptr", "residual [m, n] bf16 for epilogue 'residual' (else 0)")]


def reference(key: Key, x, w, res=None):
    return gemv.reference(key, x, w, res)
