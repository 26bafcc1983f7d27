"""gemm: the quantised prefill GEMM (M = a prefill chunk), mma.sync with the gemv weight layout.

Same first six arguments as gemv (no split-K workspace), same epilogues and reference; for bf16 weights also
the vision tower's bias epilogues (gemv.BIAS_EPILOGUES, a seventh argument) and a K that is a multiple of 8
only (the planes hold K padded to whole units with zero columns: `weight_layout.pack_for_device(pad_k=True)`).
GGUF k-quant formats (q4_k, q5_k, q6_k) read their blocks as stored: templates/gemm_kq.cu.j2, one
super-block per stage, warp tiles of at most 4 token tiles. A block is wr × wc warps, each owning 32 weight
rows × 8·nt tokens; activations and weight fragments go through a `stages`-deep cp.async ring in dynamic
shared memory (templates/gemm.cu.j2). The tile comes from (fmt, n, k, m, target): prefill
results need not be M-invariant. Its K order differs from gemv (no split over warps), so prefill and
decode agree to rounding only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch
from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from . import gemv
from .weight_layout import FORMATS, group_of
from ..kquant import KFORMATS

TR = 2                  # row tiles (16 rows) per warp: must match templates/gemm.cu.j2
MAX_STAGES = 4
# (wr, wc, nt): rows per block = 32·wr, tokens = 8·nt·wc. nt ≤ 8: wider warp tiles (nt = 10, 12 at
# up to 96 accumulators) sit at 255 registers and spill on some arch/format/stage combinations; odd nt
# measured slower than the wave count suggests (gemm v2 notes: down at nt = 7 −7 % against nt = 8).
TILINGS = tuple((wr, wc, nt) for wr, wc in ((4, 1), (8, 1), (4, 2), (2, 2)) for nt in (8, 6, 4, 2))
# k-quants keep a unit's scaled partials beside the accumulators: at most 4 token tiles per warp.
KQ_TILINGS = tuple(t for t in TILINGS if t[2] <= 4)
KQ_SLOT = {"q4_k": 144, "q5_k": 176, "q6_k": 224}   # bytes of a weight row's block in a stage (gemm_kq.cu.j2)
UNIT_OVERHEAD = 4.3     # a warp's per-unit cost outside its mma, in n8 tiles (H200 sweep, gemm v2 notes)
REGS = 256              # ptxas allocates ~210–255 registers at nt ≥ 5, < 170 below


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gemm"
    fmt: str
    n: int
    k: int
    m: int                 # tokens per call (the prefill chunk)
    epilogue: str
    out_dtype: str
    wr: int                # warps along weight rows (32 rows each)
    wc: int                # warps along tokens
    nt: int                # n8 token tiles per warp
    stages: int            # cp.async ring depth (units of G columns)
    arch: str

    def __post_init__(self):
        # bf16 takes a K tail (the vision tower's 4304): the last unit's columns past K read as zero
        grain = 8 if self.fmt == "bf16" else gemv.unit_of(self.fmt)
        if self.fmt not in FORMATS and self.fmt not in KFORMATS or self.k % grain or self.m < 1:
            raise ValueError(f"gemm: bad key {self}")
        gemv.check_epilogue(self, gemv.BIAS_EPILOGUES if self.fmt == "bf16" and self.out_dtype == "bf16" else ())
        if not (1 <= self.wr * self.wc <= 16 and self.nt >= 1 and self.stages >= 2):
            raise ValueError(f"gemm: bad tiling {self}")
        if self.fmt in KFORMATS and self.nt > 4:
            raise ValueError(f"gemm: {self.fmt} warp tiles take at most 4 token tiles, got {self.nt}")

    @property
    def template(self) -> str | None:
        """The k-quants' own template (their blocks as stored); None: the family's, gemm.cu.j2."""
        return "gemm_kq.cu.j2" if self.fmt in KFORMATS else None

    def _name_parts(self):
        return gemv.shape_name_parts(self) + [f"r{self.wr}c{self.wc}n{self.nt}s{self.stages}"]


def tile_unit_bytes(fmt: str) -> int:
    """Bytes of one (16-row tile, unit) in the packed planes: codes, hi plane, scales (weight_layout)."""
    lo = 4 * 512 if fmt == "bf16" else 512
    hi = {"q5g64": 128, "q6g64": 256}.get(fmt, 0)
    return lo + hi + (0 if fmt == "bf16" else 32)


def stage_bytes(fmt: str, wr: int, wc: int, nt: int) -> int:
    """Shared memory of one ring stage (the template's STAGE): activations + weight planes (k-quants: 528-byte
    activation rows of a super-block, one block slot per weight row)."""
    if fmt in KFORMATS:
        return 8 * nt * wc * 528 + 32 * wr * KQ_SLOT[fmt]
    row = 144 if group_of(fmt) == 64 else 64
    return 8 * nt * wc * row + wr * TR * tile_unit_bytes(fmt)


def _regs(nt: int) -> int:
    return REGS if nt >= 5 else 168


def _cost(fmt, n, k, m, tiling, stages, target: Target) -> float:
    """Relative time of one call on the busiest SM: its blocks run `resident` at a time, each round
    taking a block's padded work ÷ the SM's speed. Speed: a warp's mma share nt / (UNIT_OVERHEAD + nt)
    of its per-unit time; a lone block loses ~13 % to its barrier bubbles (H200: 8 warps × 256 × 64 =
    278 TFLOP/s, 2 blocks × 4 warps × 128 × 64 = 319); fewer than 8 warps lose issue slots."""
    wr, wc, nt = tiling
    bm, bn, warps = 32 * wr, 8 * nt * wc, wr * wc
    resident = max(1, min(65536 // (32 * warps * _regs(nt)), 32 // warps,
                          target.smem_per_sm // (stages * stage_bytes(fmt, *tiling))))
    load = ceil_div(ceil_div(m, bn) * ceil_div(ceil_div(n, 16), TR * wr), target.sms)
    running = min(load, resident)
    speed = nt / (UNIT_OVERHEAD + nt) * (1.0 if running > 1 else 0.87) * min(1.0, running * warps / 8)
    return ceil_div(load, resident) * running * bm * bn / speed


def config(fmt: str, n: int, k: int, m: int, target: Target) -> tuple[int, int, int, int]:
    """(wr, wc, nt, stages): the cheapest tiling and ring depth (2–4 stages) that fit the card's shared
    memory (ties: the earlier in TILINGS, then more stages)."""
    best = None
    for tiling in KQ_TILINGS if fmt in KFORMATS else TILINGS:
        fit = target.smem_per_block // stage_bytes(fmt, *tiling)
        for stages in range(min(MAX_STAGES, fit), 1, -1):
            cost = _cost(fmt, n, k, m, tiling, stages, target)
            if best is None or cost < best[0]:
                best = (cost, (*tiling, stages))
    return best[1]


def make_key(fmt, n, k, m, target: Target, epilogue="none", out_dtype="bf16") -> Key:
    return Key(fmt, n, k, m, epilogue, out_dtype, *config(fmt, n, k, m, target), target.arch)


def smem_bytes(key: Key) -> int:
    return key.stages * stage_bytes(key.fmt, key.wr, key.wc, key.nt)


def launch(key: Key, target: Target | None = None) -> Launch:
    grid = (ceil_div(key.m, 8 * key.nt * key.wc), ceil_div(ceil_div(key.n, 16), TR * key.wr), 1)
    return Launch(grid, (32 * key.wr * key.wc, 1, 1), smem_bytes(key))


def params(key: Key) -> list[Param]:
    """gemv's arguments without the split-K workspace; the bias epilogues add the bias."""
    bias = [Param("bias", "ptr", "[n] bf16 bias")] if key.epilogue in gemv.BIAS_EPILOGUES else []
    return list(gemv.MATMUL_PARAMS) + bias


def reference(key: Key, x, w, res=None, bias=None):
    return gemv.reference(key, x, w, res, bias=bias)


def emulate(key: Key, buf) -> None:
    """compiler.emulate: the reference over the call's bound buffers, the weight unpacked from its planes (so the
    planes' packing is checked too). Float and group formats (not the k-quants' blocks)."""
    from .weight_layout import padded_k, unpack_from_device

    if key.fmt in KFORMATS or key.epilogue == "silu_mul":
        raise NotImplementedError(f"gemm.emulate: {key.fmt} / {key.epilogue} is not emulated")
    kp = padded_k(key.fmt, key.k) if key.fmt == "bf16" else key.k
    planes = {p: buf(f"w_{p}") for p in ("lo", "hi", "scales")}
    planes = {p: t if t is not None else torch.zeros(0, dtype=torch.uint8) for p, t in planes.items()}
    w = unpack_from_device(planes, key.fmt, key.n, kp)
    w = w[:, :key.k] if key.fmt == "bf16" else w
    bias = key.epilogue in gemv.BIAS_EPILOGUES
    res = buf("res", (key.m, key.n), "bf16") if key.epilogue in ("residual", "bias_residual") else None
    y = reference(key, buf("x", (key.m, key.k), "bf16"), w, res, buf("bias", (key.n,), "bf16") if bias else None)
    buf("y", (key.m, key.n), key.out_dtype).copy_(y)
