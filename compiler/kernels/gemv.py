"""gemv: the quantised skinny GEMM family (decode, verify and cohorts, M ≤ 32) on mma.sync.

y[M, N_out] = epilogue(x[M, K] · W[N, K]ᵀ) with W in a weight_layout format, or a GGUF k-quant's blocks as
stored (q4_k, q5_k, q6_k: templates/gemv_kq.cu.j2, one super-block of 256 columns per unit). The config that fixes the
reduction order (`warps`, `splits` / `stream_k`: the K split over warps and over blocks) depends on (fmt, N, K,
target) only, never on M: that is what makes decode, verify and every cohort produce identical bits
per row. Which fields a shape gets (warps, splits, tiles and how units stream) is gemv_config's: measured choices.

The RMSNorm between two decode projections is split over them (passes.fold_norms_into_projections):
`norm_out` keys (a residual projection) also write xn = bf16(h·(1 + norm_w)) and per-tile sums of h²;
`scale_in` keys (the projections reading xn) scale their rows by rsqrt(Σ / K + eps). A `conv` key (the
GDN qkv projection of a one-token step, passes.fold_conv_into_projection) runs the depthwise conv + SiLU
and the slot history update of gdn_conv 'update' in its epilogue.

splits > 1 needs a workspace (`workspace(key)`: an fp32 [splits, m, n] buffer and one u32 ticket per
row tile, zero before the first launch); the kernel leaves the tickets at zero, so one allocation
serves every launch and graph replay. A k-quant `stream_k` grid (G blocks over the units flattened tile-major, in
place of splits; also reduction order, from gemv_config) takes the same tickets and a [G + tiles, m, 16] buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..kquant import KFORMATS
from ..reference_fused import inverse_rms, norm_tile_sums
from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from .gemv_config import STAGE_X_LIMIT, config, load_batches, order_depth, staged_bytes, stream_config, unit_of
from .weight_layout import FORMATS, dequantize, group_of

EPILOGUES = ("none", "residual", "silu_mul")
# The vision tower's epilogues (the prefill GEMM only, gemm.BIAS_EPILOGUES): + bias, then GELU (erf or tanh) or
# + a residual, each rounded to bf16 where the reference rounds (compiler.reference_vision).
BIAS_EPILOGUES = ("bias", "bias_gelu", "bias_gelu_tanh", "bias_residual")
OUT_DTYPES = ("bf16", "f32")
_SHORT = {"residual": "res", "silu_mul": "silu", "bias": "b", "bias_gelu": "bgelu", "bias_gelu_tanh": "bgelut",
          "bias_residual": "bres"}


def check_epilogue(key, extra: tuple[str, ...] = ()) -> None:
    """The epilogue checks every matrix-multiply key (gemv, gemm, gemm_wg) makes; `extra`: the family's own."""
    if key.epilogue not in EPILOGUES + extra or key.out_dtype not in OUT_DTYPES:
        raise ValueError(f"{key.family}: bad epilogue/out_dtype {key.epilogue!r}/{key.out_dtype!r}")
    if key.epilogue == "silu_mul" and key.n % 16:
        raise ValueError(f"{key.family}: silu_mul needs n = 2·F with F a multiple of 8")


def shape_name_parts(key) -> list[str]:
    """The leading name parts of every matrix-multiply key: format, shape, epilogue, output dtype."""
    parts = [key.fmt, f"n{key.n}", f"k{key.k}", f"m{key.m}"]
    parts += [] if key.epilogue == "none" else [_SHORT[key.epilogue]]
    return parts + (["f32"] if key.out_dtype == "f32" else [])


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
    splits: int = 1        # K slices over blocks (whole order batches), summed in slice order by the last block
    prefetch: int = 0      # order batches the block asks L2 to fetch ahead of its loads (0: none)
    interleave: bool = False  # ptxas may interleave a batch's units (more registers)
    min_blocks: int = 2    # __launch_bounds__ blocks per SM: caps the registers so a grid fits fewer waves
    norm_out: bool = False  # also xn = bf16(y·(1 + norm_w)) and ssq_out [m, n/16] (Σ y² per 16-row tile)
    scale_in: bool = False  # x is xn: row m's products × rsqrt(Σ ssq_in[m] / k + eps) before the epilogue
    eps: float = 0.0        # (scale_in)
    conv: int = 0           # > 0: the GDN conv of this width (+ SiLU) on each row's one new column, in the epilogue
    stage_x: bool = False   # right after the dependency wait each warp copies its units' activations to shared
                            # memory, and its loop reads them there (same bits)
    stage_w: int = 0        # k-quants: > 0 stages a unit's 16 block rows global → shared with 16-byte cp.async, this
                            # many units ahead per warp (same bits: the lanes read the same bytes)
    code_bias: bool = False  # Q4_K/Q5_K: the mma takes each code + 128 as PRMT leaves it (no HFMA2 per pair) and
                             # 128·d·Σ_j sc_j·S_j leaves with the mins (other bits than without, fp32 accuracy)
    depth: int = 0          # units per warp loaded together (PD in templates/gemv.cu.j2; 0: the order batch, OB): how
                            # far a warp's loads run ahead of its mma, never the order (same bits)
    x_early: bool = False   # a load batch's activations loaded right after its weights, before its mma (same bits)
    kq_lean: bool = False   # Q4_K/Q5_K with code_bias: Σ x by one mma per sub-block (halves added in fp32), d·sc by one
                            # FFMA, no FFMA for token columns past M (other bits than code_bias alone, the same at every
                            # M; shipped with code_bias: gemv_config.kquant_stream_config)
    stream_k: int = 0       # k-quants, in place of splits: a grid of this many blocks over the tiles' units flattened
                            # tile-major (whole waves; a tile's partials summed in block order: other bits, the same
                            # at every M)
    q6_lean: bool = False   # Q6_K: the same bits in fewer instructions — staged rows of 17 chunks whose copies share
                            # one offset a unit, aligned words read without a shift, the PRMT constants in registers,
                            # d·sc by one FFMA, no FFMA for token columns past M (common/kq_units.j2)

    def __post_init__(self):
        if self.fmt not in FORMATS and self.fmt not in KFORMATS:
            raise ValueError(f"gemv: unknown weight format {self.fmt!r} (expected {', '.join([*FORMATS, *KFORMATS])})")
        if not 1 <= self.m <= 32:
            raise ValueError(f"gemv: m = {self.m} outside 1..32 (use the prefill GEMM)")
        if self.k % unit_of(self.fmt):
            unit = "super-block" if self.fmt in KFORMATS else "group"
            raise ValueError(f"gemv: k = {self.k} not a multiple of the {self.fmt} {unit}")
        if self.stage_w and (self.fmt not in KFORMATS or not 2 <= self.stage_w <= 6
                             or stage_w_bytes(self) > STAGE_W_LIMIT):
            raise ValueError(f"gemv: stage_w = {self.stage_w} needs a k-quant, 2..6 stages and ≤ {STAGE_W_LIMIT} B of "
                             f"shared memory, got {self.fmt}, {stage_w_bytes(self)} B")
        if self.code_bias and self.fmt not in ("q4_k", "q5_k"):
            raise ValueError(f"gemv: code_bias needs a k-quant with mins (q4_k, q5_k), not {self.fmt}")
        if self.q6_lean and self.fmt != "q6_k":
            raise ValueError(f"gemv: q6_lean is Q6_K's unit math, not {self.fmt}'s")
        if self.kq_lean and not self.code_bias:
            raise ValueError(f"gemv: kq_lean needs code_bias (a q4_k or q5_k key), got {self.fmt} without it")
        if self.fmt in KFORMATS and (self.tiles != 1 or self.prefetch or self.interleave or self.stage_x):
            raise ValueError(f"gemv: {self.fmt} streams one row tile per block, one unit at a time (tiles 1, no "
                             f"prefetch, interleave or stage_x), got {self.tiles}/{self.prefetch}/{self.interleave}/"
                             f"{self.stage_x}")
        units = ceil_div(self.n, 16) * (self.k // unit_of(self.fmt))     # a stream-K grid's work, tile-major
        if self.stream_k and (self.fmt not in KFORMATS or self.splits != 1 or self.conv
                              or not 1 <= self.stream_k <= units):
            raise ValueError(f"gemv: stream_k = {self.stream_k} needs a k-quant without splits or conv and 1 … "
                             f"{units} blocks (one unit each at least), got {self.fmt}, splits {self.splits}, "
                             f"conv {self.conv}")
        check_epilogue(self)
        if not 1 <= self.splits <= load_batches(self.fmt, self.k, self.warps):
            raise ValueError(f"gemv: splits = {self.splits} outside "
                             f"1..{load_batches(self.fmt, self.k, self.warps)} "
                             "(every slice needs a whole order batch)")
        if not 0 <= self.prefetch <= 8:
            raise ValueError(f"gemv: prefetch = {self.prefetch} outside 0..8 batches")
        if not 1 <= self.min_blocks <= 16:
            raise ValueError(f"gemv: min_blocks = {self.min_blocks} outside 1..16")
        if self.norm_out and (self.epilogue == "silu_mul" or self.out_dtype != "bf16" or self.n % 16):
            raise ValueError(f"gemv: norm_out writes the bf16 residual stream (n a multiple of 16, epilogue "
                             f"none/residual), got {self.epilogue}/{self.out_dtype}, n = {self.n}")
        if self.conv and (self.conv < 2 or self.epilogue != "none" or self.out_dtype != "bf16" or self.n % 16
                          or self.norm_out):
            raise ValueError(f"gemv: conv (width {self.conv} ≥ 2) needs a plain bf16 projection with n a multiple "
                             f"of 16, got {self.epilogue}/{self.out_dtype}, n = {self.n}")
        if self.stage_x and stage_x_bytes(self) > STAGE_X_LIMIT:
            raise ValueError(f"gemv: stage_x needs {stage_x_bytes(self)} B of shared memory for the activations "
                             f"(limit {STAGE_X_LIMIT}); m = {self.m}, k = {self.k}, splits = {self.splits}")
        if self.fmt in KFORMATS and (self.depth or self.x_early):
            raise ValueError(f"gemv: {self.fmt} streams one unit at a time (depth 0, no x_early), got depth "
                             f"{self.depth}, x_early {self.x_early}")
        if not 0 <= self.depth <= 8 or not 1 <= self.tiles <= 4:
            raise ValueError(f"gemv: depth {self.depth} / tiles {self.tiles} outside 0..8 / 1..4")
        if static_smem_bytes(self) > STATIC_SMEM:
            raise ValueError(f"gemv: {self.warps} warps × {self.tiles} row tiles × m = {self.m} need "
                             f"{static_smem_bytes(self)} B of shared memory ({reduce_bytes(self)} B for the warp "
                             f"reduction; static limit {STATIC_SMEM})")
        if self.scale_in and (self.k % 64 or self.eps <= 0):
            raise ValueError(f"gemv: scale_in needs k a multiple of 64 and eps > 0, got k = {self.k}, eps = {self.eps}")

    @property
    def template(self) -> str | None:
        """The k-quants' own template (their blocks as stored); None: the family's, gemv.cu.j2."""
        return "gemv_kq.cu.j2" if self.fmt in KFORMATS else None

    def _name_parts(self):
        return (shape_name_parts(self) + [f"w{self.warps}t{self.tiles}"] + ([f"s{self.splits}"] if self.splits > 1 else [])
                + ([f"p{self.prefetch}"] if self.prefetch else []) + (["il"] if self.interleave else [])
                + ([f"b{self.min_blocks}"] if self.min_blocks != 2 else [])
                + (["hn"] if self.norm_out else []) + (["rs"] if self.scale_in else [])
                + ([f"cv{self.conv}"] if self.conv else []) + (["xs"] if self.stage_x else [])
                + ([f"sw{self.stage_w}"] if self.stage_w else [])
                + (["cb"] if self.code_bias else []) + ([f"d{self.depth}"] if self.depth else [])
                + (["xe"] if self.x_early else []) + (["kl"] if self.kq_lean else [])
                + (["ql"] if self.q6_lean else []) + ([f"sk{self.stream_k}"] if self.stream_k else []))


STATIC_SMEM = 48 * 1024      # a kernel's static shared memory


def reduce_bytes(key: Key) -> int:
    """Shared memory of the warp reduction (red in templates/gemv.cu.j2): fp32 [warps, tiles, NT, 4, 32]."""
    return key.warps * key.tiles * ((key.m + 7) // 8) * 512


def static_smem_bytes(key: Key) -> int:
    """The group-64 template's static shared memory (templates/gemv.cu.j2 with common/gemv_folds.j2): the warp
    reduction, staged activations, the folds' arrays and the split-K flag; 0 for the k-quants (gemv_kq.cu.j2
    checks its own: stage_w_bytes)."""
    if key.fmt in KFORMATS:
        return 0
    m, total = key.m, reduce_bytes(key) + (stage_x_bytes(key) if key.stage_x else 0) + (key.splits > 1)
    if key.scale_in:
        tile_sums = m * (key.k // 16) * 4
        total += (tile_sums if tile_sums <= 12 * 1024 else 0) + 4 * m     # ssq_s (unused unless SS_ASYNC), rstd_s
    if key.conv:
        total += key.tiles * 16 * key.conv * 2 + m * (key.conv - 1) * key.tiles * 32 + 4 * m   # taps_s, win_s, slot_s
    return total


STAGE_W_LIMIT = 36 * 1024    # bytes of weight stages a `stage_w` block may hold (beside its reduction buffer)


def stage_w_bytes(key: Key) -> int:
    """Shared memory a `stage_w` key stages weights in: per warp, stage_w units of 16 block rows."""
    return staged_bytes(key.fmt, key.warps, key.stage_w, key.q6_lean) if key.stage_w else 0


def stage_x_bytes(key: Key) -> int:
    """Shared memory a `stage_x` key stages activations in: m rows of the block's units (one slice of them
    when split), each row 16 bytes longer (xs in templates/gemv.cu.j2)."""
    g, units = group_of(key.fmt), key.k // group_of(key.fmt)
    batch = key.warps * order_depth(key.fmt)
    if key.splits > 1:
        units = min(units, ceil_div(ceil_div(units, batch), key.splits) * batch)
    return key.m * (units * g + 8) * 2


def make_key(fmt: str, n: int, k: int, m: int, target: Target, epilogue: str = "none",
             out_dtype: str = "bf16") -> Key:
    """The shipped key of one decode matrix multiply (experiment rules, CompileOptions.gemv, replace its fields in
    the lowering, after the passes' folds: gemv_rules.apply_overrides from lower_rules._matmul)."""
    warps, tiles, splits, stream_k = config(fmt, n, k, m, target)
    return Key(fmt, n, k, m, epilogue, out_dtype, warps, tiles, target.arch, splits, stream_k=stream_k,
               **stream_config(fmt, n, k, m, warps, target, epilogue, splits, stream_k))


def norm_outputs(key: Key, y: torch.Tensor, norm_w: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a `norm_out` key writes beside y (the bf16 stream as returned by `reference`): xn, ssq_out."""
    h = y.float()
    return {"xn": (h * (1.0 + norm_w.float())).to(torch.bfloat16), "ssq_out": norm_tile_sums(h)}


def conv_reference(key: Key, y: torch.Tensor, conv_w: torch.Tensor, hist: torch.Tensor, slots: torch.Tensor):
    """A `conv` key's (y, new history) from its plain bf16 projection y: gdn_conv 'update' on one column."""
    from . import gdn_conv
    ck = gdn_conv.Key(key.n, key.m, 1, key.conv, "update", key.arch)
    out, new_hist = gdn_conv.reference(ck, hist, slots, y.view(key.m, 1, key.n), conv_w)
    return out.view(key.m, key.n).to(y.device), new_hist


def launch(key: Key, target: Target | None = None) -> Launch:
    blocks = key.stream_k or ceil_div(ceil_div(key.n, 16), key.tiles) * key.splits
    return Launch((blocks, 1, 1), (32 * key.warps, 1, 1), 0)


def workspace(key: Key) -> dict[str, int]:
    """Bytes of each workspace argument (by parameter name); {} when splits == 1 and no stream_k. Stream-K: a 16-row
    partial of each row per (block, tile) slot, slot = block + tile (a block's tiles are consecutive, so are a
    tile's blocks)."""
    tiles = ceil_div(key.n, 16)
    if key.stream_k:
        return {"ws": 4 * (key.stream_k + tiles) * key.m * 16, "tickets": 4 * tiles}
    if key.splits == 1:
        return {}
    return {"ws": 4 * key.splits * key.m * key.n, "tickets": 4 * tiles}


# The arguments every quantised matrix multiply takes (gemv, and gemm, which has no split-K workspace).
def bias_epilogue(epilogue: str, y: torch.Tensor, bias: torch.Tensor, res: torch.Tensor | None = None):
    """fp32 products y → bf16 as the vision tower's reference computes them: h = bf16(y + bias), then bf16(GELU(h))
    or bf16(res + h) (each torch op of the reference rounds its bf16 result once)."""
    h = (y + bias.float()).to(torch.bfloat16)
    if epilogue == "bias_residual":
        return (res.float() + h.float()).to(torch.bfloat16)
    if epilogue in ("bias_gelu", "bias_gelu_tanh"):
        approximate = "tanh" if epilogue == "bias_gelu_tanh" else "none"
        return torch.nn.functional.gelu(h.float(), approximate=approximate).to(torch.bfloat16)
    return h


MATMUL_PARAMS = (Param("y", "ptr", "out [m, n] (n/2 for silu_mul), bf16 or f32; may alias res"),
                 Param("x", "ptr", "activations [m, k] bf16, contiguous"),
                 Param("w_lo", "ptr", "packed plane 'lo' (weight_layout.pack_for_device)"),
                 Param("w_hi", "ptr", "packed plane 'hi' (q5g64/q6g64; else 0)"),
                 Param("w_scales", "ptr", "packed scales (0 for bf16)"),
                 Param("res", "ptr", "residual [m, n] bf16 for epilogue 'residual' (else 0)"))


def params(key: Key) -> list[Param]:
    return [*MATMUL_PARAMS,
            Param("ws", "ptr", "f32 workspace [splits, m, n] (splits > 1), [stream_k + tiles, m, 16] (stream_k); else 0"),
            Param("tickets", "ptr", "u32 [row tiles] arrival counters: zero before the first launch, left zero "
                  "(splits > 1 or stream_k, else 0)")] + \
        ([Param("xn", "ptr", "out [m, n] bf16: bf16(y · (1 + norm_w)), the next projections' input"),
          Param("ssq_out", "ptr", "out [m, n/16] f32: Σ y² over each 16-row tile (y as stored)"),
          Param("norm_w", "ptr", "RMSNorm weight [n] bf16, used as (1 + w)")] if key.norm_out else []) + \
        ([Param("ssq_in", "ptr", "[m, k/16] f32 tile sums of squares of the un-normalised rows")]
         if key.scale_in else []) + \
        ([Param("conv_w", "ptr", "conv taps [n, conv] bf16"),
          Param("hist", "ptr", "conv history [slots, conv − 1, n] bf16, updated in place"),
          Param("slots", "ptr", "[m] int32 state slot per row (< 0: a padded row, nothing written)")]
         if key.conv else [])


def reference(key, x: torch.Tensor, w, res: torch.Tensor | None = None, ssq_in: torch.Tensor | None = None,
              bias: torch.Tensor | None = None):
    """fp32 math on the dequantised weight; `w` is the logical (unpacked) matrix or QMatrix. Shared by
    every matrix-multiply key (gemv, gemm, gemm_wg: fields n, epilogue, out_dtype). A `scale_in` key
    scales by reference_fused.inverse_rms(ssq_in) before the epilogue."""
    y = x.float() @ dequantize(w).to(x.device).T
    if key.epilogue in BIAS_EPILOGUES:
        return bias_epilogue(key.epilogue, y, bias, res)
    if getattr(key, "scale_in", False):
        y = y * inverse_rms(ssq_in, key.eps)
    if key.epilogue == "silu_mul":
        f = key.n // 2
        y = torch.nn.functional.silu(y[:, :f]) * y[:, f:]
    elif key.epilogue == "residual":
        y = y + res.float()
    return y if key.out_dtype == "f32" else y.to(torch.bfloat16)
