"""gdn_chunk: Gated DeltaNet chunked prefill (WY/UT form) for one sequence: same function as gdn_step in
mode "step" (o for every token, final state written back to slots[0]), computed in chunks of C tokens.

Per chunk (γ = inclusive cumsum of g inside the chunk, decay_ij = exp(γ_i − γ_j), i ≥ j):
  L = strictly_lower(diag(β)·K·Kᵀ ⊙ decay),  R = diag(β)·(V − diag(e^γ)·K·S)
  v' = (I + L)⁻¹ R        (16×16 diagonal blocks inverted per warp, then block forward substitution)
  o  = diag(e^γ)·Q·S + (causal Q·Kᵀ ⊙ decay)·v'
  S ← e^{γ_C}·S + (K ⊙ e^{γ_C − γ})ᵀ·v'
The value columns are independent, so `dv_split` blocks share a head's columns (S-independent terms are
recomputed per block). Products run on mma.sync bf16 with an fp32 operand split into bf16 hi + lo and
three products (hi·hi + hi·lo + lo·hi): ~16 mantissa bits per operand, fp32 accumulate.
The last chunk may be ragged (t a multiple of 16): padded tokens have k = q = v = 0, β = 0, g = 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import Target
from . import KernelKey, Launch, Param, gdn_step


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "gdn_chunk"
    hk: int
    hv: int
    dk: int
    dv: int
    t: int
    chunk: int             # C tokens per chunk: 32 or 64 (THREADS = 4·C)
    dv_split: int          # blocks per value head (column slices of dv / dv_split)
    arch: str

    def __post_init__(self):
        if (self.chunk not in (32, 64) or self.dk % 32 or self.hv % self.hk or self.dv % self.dv_split
                or (self.dv // self.dv_split) % 32 or self.t % 16 or self.t <= 0):
            raise ValueError(f"gdn_chunk: bad key {self}")

    def _name_parts(self):
        return [f"hk{self.hk}", f"hv{self.hv}", f"dk{self.dk}", f"dv{self.dv}", f"t{self.t}", f"c{self.chunk}",
                f"s{self.dv_split}"]


def smem_bytes(chunk: int, dk: int, dvb: int) -> int:
    """Dynamic shared memory of one block (floats × 4); mirrors the template's carve-up."""
    ldk, ldc, ldv = dk + 8, chunk + 8, dvb + 4
    qreg = max(chunk * ldk, chunk * ldc + chunk * ldv)          # Qs, later Ms + Oq
    floats = chunk * ldk + qreg + dvb * ldk + chunk * ldc + 2 * chunk * ldv + (chunk // 16) * 256 + 3 * chunk
    return 4 * floats


def make_key(hk, hv, dk, dv, t, target: Target, chunk: int | None = None, dv_split: int | None = None) -> Key:
    """Columns split until the grid covers the SMs (≥ 32 columns per block); C = 32 lets three blocks
    share an SM (C = 64 needs ~130 KB per block at 32 columns)."""
    split = dv_split
    if split is None:
        split = 1
        while hv * split < target.sms and dv // (split * 2) >= 32 and dv % (split * 2) == 0:
            split *= 2
    c = chunk or 32
    if smem_bytes(c, dk, dv // split) > target.smem_per_block:
        c = 32
    return Key(hk, hv, dk, dv, t, c, split, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.hv, key.dv_split, 1), (4 * key.chunk, 1, 1),
                  smem_bytes(key.chunk, key.dk, key.dv // key.dv_split))


def params(key: Key) -> list[Param]:
    return [Param("o", "ptr", "out [t, hv, dv] f32"),
            Param("qkv", "ptr", "conv output [t, 2·hk·dk + hv·dv] bf16"),
            Param("a", "ptr", "[t, hv] f32"), Param("b", "ptr", "[t, hv] f32"),
            Param("a_log", "ptr", "[hv] f32"), Param("dt_bias", "ptr", "[hv] f32"),
            Param("state", "ptr", "[slots, hv, dk, dv] f32"), Param("slots", "ptr", "[1] int32, < 0 = skip")]


def step_key(key: Key) -> gdn_step.Key:
    return gdn_step.Key(key.hk, key.hv, key.dk, key.dv, 1, key.t, "step", 1, key.arch)


def reference(key: Key, state, slots, qkv, a, b, a_log, dt_bias):
    """(o [t, hv, dv] f32, new state): gdn_step's sequential reference in mode "step", batch 1."""
    o, s, _ = gdn_step.reference(step_key(key), state, slots[:1], qkv.reshape(1, key.t, -1),
                                 a.reshape(1, key.t, -1), b.reshape(1, key.t, -1), a_log, dt_bias)
    return o[0], s
