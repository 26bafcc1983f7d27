"""gemm_wg: the quantised prefill GEMM on Hopper warpgroup MMA (wgmma, compiled for sm_90a).

Same arguments, epilogues and reference as gemm (its mma.sync sibling, which every other arch and the
W8G32 format use), same weight layout: the per-lane fragments of a (16-row tile, 64-column unit) are
wgmma's register-A fragments as they are; the activations come rearranged by xperm (the lowering runs
it first, into this call's workspace `xp`) into the matching k-slot order, unit-major, and are staged
with 16-byte copies into 128-byte-swizzled shared memory for the B descriptor (templates/gemm_wg.cu.j2). A block is `wgs`
warpgroups × `rt` groups of 64 weight rows × `bn` tokens. Group scales are applied by rescaling the
accumulators between units (exact codes in the tensor cores, fp32 throughout): the result agrees with
gemm to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from . import gemm, gemv

FMTS = ("q4g64", "q5g64", "q6g64", "bf16")       # group 64 (a unit is one 128-byte activation row)
MIN_M = 64                                        # below, the token tile is mostly padding: use gemm
MIN_N = 256                                       # below (the a/b projections), gemm's narrow tiles win
# (wgs, rt, bn): rows per block 64·rt·wgs, tokens bn. rt·bn/2 fp32 accumulators per thread ≤ 128.
# Two warpgroups: one alone has nothing to overlap its waits with (H200: 1.3–1.9× slower, v1/v2 sweeps).
TILINGS = ((2, 1, 256), (2, 2, 128), (2, 1, 128), (2, 1, 64))
MAX_STAGES = 6
CONFIG_STAGES = 4                                 # H200 kernel-lab sweep: 4 beat 6
UNIT_CYCLES, CYCLES_PER_ELEMENT = 278, 8.29 / 128  # per unit of a block (see _cost)


def arch_supported(arch: str) -> bool:
    """wgmma is sm_90a only: not sm_80–89, and not forward compatible beyond Hopper."""
    return arch == "sm_90"


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gemm_wg"
    fmt: str
    n: int
    k: int
    m: int
    epilogue: str
    out_dtype: str
    wgs: int               # warpgroups per block (2 share the staged activations)
    rt: int                # 64-row groups per warpgroup
    bn: int                # tokens per block = wgmma N
    stages: int            # shared-memory ring slots (stages - 2 units in flight)
    arch: str

    def __post_init__(self):
        if self.fmt not in FMTS or self.k % 64 or self.m < 1:
            raise ValueError(f"gemm_wg: bad key {self} (formats {', '.join(FMTS)}, k a multiple of 64)")
        gemv.check_epilogue(self)
        if self.wgs not in (1, 2) or self.rt not in (1, 2) or self.bn not in (64, 128, 256) \
                or self.rt * self.bn > 256 or not 3 <= self.stages <= MAX_STAGES:
            raise ValueError(f"gemm_wg: bad tiling {self}")

    def check_arch(self) -> None:
        super().check_arch()
        if not arch_supported(self.arch):
            raise ValueError(f"gemm_wg needs sm_90 (wgmma), not {self.arch}")

    @property
    def compile_arch(self) -> str:
        """wgmma needs the arch-specific target: cubin sm_90a, PTX compute_90a."""
        return self.arch + "a"

    def _name_parts(self):
        return gemv.shape_name_parts(self) + [f"g{self.wgs}r{self.rt}n{self.bn}s{self.stages}"]


def stage_bytes(fmt: str, wgs: int, rt: int, bn: int) -> int:
    """One ring slot (the template's STAGE): activations, then the weight planes, rounded to 1 KB."""
    return ceil_div(bn * 128 + 4 * rt * wgs * gemm.tile_unit_bytes(fmt), 1024) * 1024


def shared_bytes(fmt: str, wgs: int, rt: int, bn: int, stages: int) -> int:
    """The ring plus 1 KB to align its first slot to a swizzle atom."""
    return stages * stage_bytes(fmt, wgs, rt, bn) + 1024


def smem_bytes(key: Key) -> int:
    return shared_bytes(key.fmt, key.wgs, key.rt, key.bn, key.stages)


def _cost(n: int, k: int, m: int, tiling, target: Target) -> float:
    """Cycles of one call on the busiest SM: one block per SM at a time (registers), blocks in rounds
    of `target.sms`, each unit of a block taking UNIT_CYCLES + CYCLES_PER_ELEMENT × its 64·rt·wgs × bn
    output tile (fitted to the H200 sweep of gemm_wg v2: 809 / 1482 / 2400 cycles per unit at 64 / 128
    / 256 tokens × 128 rows)."""
    wgs, rt, bn = tiling
    blocks = ceil_div(m, bn) * ceil_div(ceil_div(n, 16), 4 * rt * wgs)
    return ceil_div(blocks, target.sms) * (k // 64) * (UNIT_CYCLES + CYCLES_PER_ELEMENT * 64 * rt * wgs * bn)


def config(fmt: str, n: int, k: int, m: int, target: Target) -> tuple[int, int, int, int]:
    """(wgs, rt, bn, stages): the cheapest tiling by `_cost` (ties: the earlier in TILINGS) with
    CONFIG_STAGES ring slots, fewer where shared memory is short."""
    fits = [t for t in TILINGS if shared_bytes(fmt, *t, 3) <= target.smem_per_block]
    best = min(fits, key=lambda t: _cost(n, k, m, t, target))
    stages = max(s for s in range(3, CONFIG_STAGES + 1) if shared_bytes(fmt, *best, s) <= target.smem_per_block)
    return (*best, stages)


def eligible(fmt: str, n: int, k: int, m: int, target: Target) -> bool:
    """Whether the prefill matmul of this shape runs on gemm_wg rather than gemm (H200: the bf16 a/b
    projection, N = 96, 40 µs on gemm_wg against 27 on gemm)."""
    return arch_supported(target.arch) and fmt in FMTS and k % 64 == 0 and m >= MIN_M and n >= MIN_N


def make_key(fmt, n, k, m, target: Target, epilogue="none", out_dtype="bf16") -> Key:
    return Key(fmt, n, k, m, epilogue, out_dtype, *config(fmt, n, k, m, target), target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    grid = (ceil_div(key.m, key.bn), ceil_div(ceil_div(key.n, 16), 4 * key.rt * key.wgs), 1)
    return Launch(grid, (128 * key.wgs, 1, 1), smem_bytes(key))


def workspace(key: Key) -> dict[str, int]:
    """`xp`: the activations as xperm leaves them (the lowering runs xperm first, into this region)."""
    return {"xp": 2 * key.m * key.k}


def params(key: Key) -> list[Param]:
    """gemm's arguments, `x` being xperm's output (unit-major, k-slot order), not the activations."""
    return [Param(p.name, p.kind, "activations after xperm: [K/64, M, 64] bf16") if p.name == "x" else p
            for p in gemm.params(key)]


def reference(key: Key, x, w, res=None):
    return gemv.reference(key, x, w, res)
