"""gemv_config: the shipped choice of a decode GEMV key's fields for a shape and a card — `config` (warps, row
tiles, split-K), which fixes the reduction order from (fmt, N, K, target) alone, never M, and `stream_config`
(how units stream: prefetch, interleave, load depth, register caps, staging), which never changes the bits and may
follow M — with the measurements behind each rule, and the K-grain arithmetic they read (units, order batches).
`gemv.make_key` builds a key from them; experiment rules (gemv_rules) may replace fields after.
"""
from __future__ import annotations

from ..kquant import KFORMATS, QK_K
from ..targets import Target
from . import ceil_div
from .weight_layout import group_of

def unit_of(fmt: str) -> int:
    """Columns per unit (the K grain of the reduction order): the format's group, a k-quant's super-block."""
    return QK_K if fmt in KFORMATS else group_of(fmt)


STAGE_X_LIMIT = 24 * 1024    # bytes of activations a `stage_x` block may stage (static shared memory is 48 KiB)


def order_depth(fmt: str) -> int:
    """Units per warp in one order batch (OB in templates/gemv.cu.j2; 1 in gemv_kq.cu.j2): split-K slices are
    whole order batches."""
    return 1 if fmt in KFORMATS else 2 if fmt == "bf16" else 4


def load_batches(fmt: str, k: int, warps: int) -> int:
    """Order batches along K per block (warps · OB units each): the grain of split-K slices."""
    return ceil_div(k // unit_of(fmt), warps * order_depth(fmt))


def split_count(fmt: str, n: int, k: int, warps: int, target: Target) -> int:
    """Blocks per row-tile group along K (reads the shape and the card, never M).

    Measured on the H200 (kernel lab): a split costs every block a partial write,
    a fence, an atomic and a barrier, which the one-block-per-tile kernel, occupancy/latency-bound at
    ~36 warps per SM, pays in throughput (the LM head lost 9 points at S = 2, gate/up 7). It pays only
    where one block per tile gives less than a wave of blocks and each block walks a long K (Q5 down
    39 → 48 % at S = 6, W8 down 42 → 61 % at S = 7). So: split when there is less than one wave of
    tiles (≈ 36 resident warps per SM) and K has ≥ 8 load batches, or when there are fewer tiles than
    SMs; then take the largest even cut of the batches (⌈nb / b⌉ for b batches per block) that keeps
    the grid within two waves. A k-quant wave is four 4-warp blocks an SM (their registers and staging rings; the
    group-64 kernels hold ~36 warps): the down projections (5,120 × 17,408) cut in 3, not 6 — each warp then walks
    ~6 units after filling its ring once (session 26, H100 kernel lab `kqsplits`, chained, M = 1: Q4_K 23.8 → 23.2
    µs, Q6_K 35.1 → 34.0; the GGUF step 7.187 → 7.116 ms in the same call; on the 3090's 82 SMs the same rule cuts
    2, unmeasured there). Since session 27 such split k-quant grids run as one stream-K wave (stream_k_blocks)."""
    nb, row_tiles = load_batches(fmt, k, warps), ceil_div(n, 16)
    wave = target.sms * ((16 if fmt in KFORMATS else 36) // warps)
    if row_tiles >= wave or (nb < 8 and row_tiles >= target.sms):
        return 1
    cuts = {ceil_div(nb, b) for b in range(1, nb + 1)}
    return max(s for s in cuts if s == 1 or row_tiles * s <= 2 * wave)


def kquant_wave(fmt: str, target: Target) -> int:
    """Resident 4-warp k-quant blocks a card holds at once: up to four an SM (≤ 128 registers: min_blocks 4 where a
    stream-K grid asks for it), fewer where two stages' blocks (kquant_block_smem) do not fit four in shared memory
    (Q6_K on sm_86's 100 KB: two)."""
    return target.sms * min(4, target.smem_per_sm // kquant_block_smem(fmt, 2, fmt == "q6_k"))


def stream_k_blocks(fmt: str, n: int, k: int, warps: int, splits: int, target: Target) -> int:
    """The stream-K grid (`stream_k`, gemv_kq.cu.j2) that replaces a k-quant's K splits, or 0 (reads the shape and the
    card, never M). A split grid is rarely whole waves — the down projections (5,120 × 17,408) at 3 splits are 960
    blocks, 1.8 waves of four 4-warp blocks an SM on 132 SMs — and every block pays the ring's first fill and the
    split's partial, fence and ticket; one wave of blocks over the tiles' units flattened tile-major has every SM
    stream the same number of units, each block one partial per tile it touches. Session 27, H100 kernel lab
    `streamk` (chained, M = 1): Q6_K down 34.9 → 32.7 µs at one wave of four (3 an SM 38.6, 5 41.7, two waves
    36.0), Q4_K down 23.7 → 23.2; the GGUF step 7.249 → 7.181 ms (same call). Unsplit grids under a wave lost (the
    output projection 10.4 → 11.8 µs, the GDN input 8.8 → 11.3; the one-wave Q5_K 10,240 rows 14.0 → 18.4) and stay
    as they are; so do split grids whose blocks would hold under 32 units (the 1,024-row projections: 2.4).
    Measured on sm_90; the 3090's grid (Q6_K: two blocks an SM, 164; Q4_K four, 328) is the same rule, unmeasured."""
    if fmt not in KFORMATS or warps != 4 or splits == 1:
        return 0
    blocks = kquant_wave(fmt, target)
    return blocks if ceil_div(n, 16) * (k // QK_K) >= 32 * blocks else 0


def config(fmt: str, n: int, k: int, m: int, target: Target) -> tuple[int, int, int, int]:
    """(warps, tiles, splits, stream_k). `warps`, `splits` and `stream_k` fix the reduction order, so they read the
    shape and the card only, never M (batch invariance); `tiles` (row tiles per block, reusing activations) may
    follow M. A stream-K grid replaces the splits (splits 1)."""
    row_tiles = ceil_div(n, 16)
    units = k // unit_of(fmt)
    warps = 8 if row_tiles < 2 * target.sms and units >= 32 else 4
    splits = split_count(fmt, n, k, warps, target)
    # Under 3 waves of 4-warp blocks and unsplit (H200 kernel-lab sweep): 8 warps gave Q5 6144×5120
    # 35.8 → 39.2 % and Q5 5120×6144 32.3 → 35.3 %; split shapes lost.
    if warps == 4 and splits == 1 and row_tiles < 3 * target.sms and units >= 64:
        warps = 8
        splits = split_count(fmt, n, k, warps, target)
    # M > 8: each unit's activations (8 × 16 B per lane at M = 32, 8× the Q4 weight bytes) serve two row tiles in
    # 4-warp blocks (kernel lab `verify`, chained, with `depth` 2 from stream_config: the C8 verify's GEMVs 14.73 →
    # 13.31 ms on an H100; Q4 10240×5120 40.2 → 25.7 µs, Q5 down 49.8 → 42.5; 8-warp blocks within ±3 % either way).
    # The LM heads had two tiles before (row tiles ≥ 16 waves' worth); they keep them.
    tiles = 2 if m > 8 and warps == 4 and fmt not in KFORMATS else 1
    stream_k = stream_k_blocks(fmt, n, k, warps, splits, target)
    return warps, tiles, 1 if stream_k else splits, stream_k


def stream_config(fmt: str, n: int, k: int, m: int, warps: int, target: Target, epilogue: str = "none",
                  splits: int = 1, stream_k: int = 0) -> dict:
    """How units stream (fields that never change the bits, so they may follow M), measured in the 27B
    decode step on the H200 (lab/step_ab.py). M ≤ 8: no L2 prefetch — with the lean decode loop
    (whole-code Q5, batch pointers) the prefetch costs more than it hides (step 6.45 → 5.99 ms without
    it); ptxas interleaves a batch's units in
    4-warp blocks (gate/up, split-K down: interleaved −0.6 %) but not in 8-warp ones (Q5 5120×6144 and
    6144×5120: −1.1 %, −0.6 %); grids of many waves (the LM heads) stream best as they are (W8 106.6 %
    of copy against 96–97 with interleave or prefetch). M > 8 keeps units apart (interleaved they spill
    or lose 5–10 points) with one batch ahead (kernel lab). L2 prefetch is measured on sm_90 only, so it
    is off for the other archs; the interleave rule is the H200's, applied to every arch (no other card is
    at hand to measure it).
    One row (step A/B at the bench's context): an unsplit 8-warp residual projection
    (the 5120×6144 output projections) stages its activations in shared memory (`stage_x`, −0.6 % per
    step; everywhere else staging lost: gate/up +12 %, the z projection +1.6 %, their activations being
    L1 hits); an unsplit interleaved grid of more than two waves (gate/up, 2,176 blocks) asks for six
    blocks per SM (`min_blocks` 6: 89 → 80 registers, 20 → 24 warps per SM; −1.7 % per step; 7 blocks
    −0.3 %, and the same cap on the ≈ one-wave qkv and q projections ±0)."""
    waves = ceil_div(n, 16) / (target.sms * 9)
    if fmt in KFORMATS:           # gemv_kq.cu.j2 has its own fields (min_blocks, code_bias, stage_w)
        return kquant_stream_config(fmt, n, m, target, splits, stream_k)
    if m > 8:   # one batch ahead in L2; 4-warp blocks load a batch's activations right after its weights
                # (`x_early`), and but for the LM heads one unit per batch under a 4-block register cap (16 warps
                # per SM: the C8 verify's GEMVs 14.99 → 14.41 ms, C8 MTP / plain end to end 1.56 → 1.60×, H100,
                # session 21); the LM heads keep the order batch's depth (the W8 LM head at 32 rows, H200: 475 µs
                # at two tiles with four units per batch, 534 at one tile with two; H100: 686 µs at two tiles with
                # two). 8-warp blocks (sm_90's Q5 projections) stay as they are: under a cap they spill. The cap is
                # sm_90's alone (on sm_86 the Q5 down projection with the next norm folded spills under it), and
                # not for an unsplit residual projection, whose epilogue may take the norm fold (`norm_out`, set
                # after this choice: the tiny spec's 128-row projections spill under the cap).
        fields = {"prefetch": 1 if target.arch == "sm_90" else 0}
        if warps == 4:
            fields["x_early"] = True
            if waves < 4:
                fields["depth"] = 1
                if target.arch == "sm_90" and not (epilogue == "residual" and splits == 1):
                    fields["min_blocks"] = 4
        return fields
    if waves >= 4:
        return {}
    fields = {"interleave": warps == 4}
    if m == 1 and splits == 1 and warps == 8 and epilogue == "residual" and (k + 8) * 2 <= STAGE_X_LIMIT:
        fields["stage_x"] = True    # (k + 8) · 2 B: stage_x_bytes of one unsplit row; wider rows stream from L1
    if m == 1 and splits == 1 and warps == 4 and ceil_div(n, 16) > 2 * 5 * target.sms:
        fields["min_blocks"] = 6
    return fields


def staged_row_bytes(fmt: str, q6_lean: bool = False) -> int:
    """Shared memory one block row of a k-quant unit takes when staged (`stage_w`): its block (Q6_K's 210-byte
    blocks: the 14 16-byte chunks from its start rounded down, 17 with `q6_lean` so that the rows a lane group reads
    sit in distinct banks)."""
    return {"q4_k": 144, "q5_k": 176, "q6_k": 272 if q6_lean else 224}.get(fmt, 0)


def staged_bytes(fmt: str, warps: int, stages: int, q6_lean: bool = False) -> int:
    """Shared memory a `stage_w` block stages weights in: per warp, `stages` units of 16 block rows."""
    return warps * stages * 16 * staged_row_bytes(fmt, q6_lean)


def kquant_block_smem(fmt: str, stages: int, q6_lean: bool) -> int:
    """Shared memory a staged 4-warp k-quant block holds on an SM at M ≤ 8: its weight stages, its reduction (512 B a
    warp) and the 1 KB the driver reserves a block."""
    return staged_bytes(fmt, 4, stages, q6_lean) + 4 * 512 + 1024


def kquant_stream_config(fmt: str, n: int, m: int, target: Target, splits: int = 1, stream_k: int = 0) -> dict:
    """How the k-quant GEMVs stream (kernel lab and the 27B Q4_K_M GGUF's step, H100, sm_90; lab/NOTES.md sessions
    18–19, lab/results/kquant_lab_h100_*_s18, gguf_ab*_h100_*_s19):
    - `code_bias` for Q4_K and Q5_K at every M (so a row's bits never depend on M): the mma takes the codes + 128
      and the 128s leave with the mins, 64 fewer instructions per unit (Nsight: 515 per unit against the q4g64
      twin's 270);
    - `stage_w` 2 at M ≤ 8: a unit's block rows copied to shared memory by whole 16-byte chunks instead of each
      lane loading 8 (4) bytes that straddle sectors (Q6_K 50 → 76–88 % of copy at gate/up and the LM head,
      Q4_K 57 → 64 %, same bits); M > 8 unmeasured, left as loaded;
    - three blocks per SM for Q5_K and Q6_K at M ≤ 8 (≤ 168 registers: 9–24 % less time at every 27B shape but
      Q6_K's grids of many waves; Q4_K gained nothing from three or four).
    Together, the GGUF's plain step 11.26 → 8.72 ms (48.2 → 63.6 % of copy; the A/B's three other rules 62.2–62.4).
    - `kq_lean` with code_bias, at every M (session 23, H100, lab/results/s23_kqlean_lab_*, s23_gguf_plain_*): the
      unit math in a third fewer instructions (common/kq_lean.j2): Q4_K gate/up 49.5 → 45.0 µs at M = 1, the other
      Q4_K/Q5_K shapes 6–14 % less; the GGUF's plain step 8.42 → 7.80 ms (64.2 → 69.4 % of copy).
    - `q6_lean` for Q6_K at every M (session 25): the same bits in fewer instructions (SASS per staged unit 779 → 566 at
      the down projection, M = 1) and 108 registers instead of 168; H100 kernel lab (`q6lean`, chained): down
      38.3 → 34.7 µs, the LM head 384 → 355 µs (91 → 99 % of copy), gate/up 59.1 → 55.9; the GGUF step 7.67 → 7.52 ms.
    - five blocks an SM at M ≤ 8 when an unsplit grid is 4–5 blocks an SM (10,240 rows on 132 SMs: one wave instead of
      1.2 of four; session 25, H100 kernel lab, chained, M = 1): Q4_K 16.2 → 12.7 µs, Q5_K 18.7 → 15.6, Q6_K 24.4 →
      18.6 (M = 8 alike); at 6,144 rows (one wave already) or 34,816 (many) five blocks lost or tied.
    - the blocks in 16-row tile order (the device layout since session 26: compiler/kernels/weight_layout.py) left
      `stage_w` at 2: three stages gained in the lab (Q4_K gate/up 36.8 → 35.4 µs chained, M = 1) but not in the
      GGUF step (7.170 ms with two, 7.231 with three; same H100 call, lab/results/s26_ship_*).
    Measured on sm_90, applied to every arch (the same register file per SM; no spills on sm_86 either)."""
    fields = {"code_bias": True, "kq_lean": True} if fmt in ("q4_k", "q5_k") else {"q6_lean": True}
    if m > 8:
        return fields
    fields["stage_w"] = 2
    if fmt != "q4_k" and not (fmt == "q6_k" and ceil_div(n, 16) >= 16 * target.sms):
        fields["min_blocks"] = 3
    block_smem = kquant_block_smem(fmt, fields["stage_w"], fields.get("q6_lean", False))
    if splits == 1 and not stream_k and 4 * target.sms < ceil_div(n, 16) <= 5 * target.sms \
            and 5 * block_smem <= target.smem_per_sm:
        fields["min_blocks"] = 5    # one wave of five blocks an SM instead of 1.2 waves of four
    if stream_k and stream_k >= 4 * target.sms:
        fields["min_blocks"] = 4    # the wave stream_k_blocks counted: ≤ 128 registers (Q6_K down 128 at 3, hn)
    return fields
