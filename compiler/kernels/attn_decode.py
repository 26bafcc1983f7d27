"""attn_decode: paged attention for decode/verify over INT8-G64 or bf16 KV pages (GQA, causal in T), on
tensor cores (templates/attn_decode.cu.j2).

Pages as qk_rope_kv writes them. `splits` (blocks per kv head and row) comes from the target and the
context bucket, never from B or T, and each row splits its own pages evenly, so a row's result
depends only on its context. splits > 1 writes partials that attn_combine reduces. A block has one
warp per 64 dims; its query rows (a kv head's GROUP·T) are m16 tiles, two at most per block, one with
bf16 KV (`tiling`).

INT8 keys may stage their loads instead (`stages` ≥ 2, templates/attn_decode_ring.cu.j2): each warp cp.asyncs its
K, V and scales `stages` − 1 chunks ahead into its own shared-memory ring — the same grid, partials and bits, more
bytes in flight per SM (the direct-load kernel is latency-bound at long context: session 21's Nsight). `stages`
= 0 keeps the direct loads (bf16 KV always does). It shipped on sm_90 in session 22 (1.19–1.24× the direct loads,
H200) until the keys split below replaced it there; now `lab.attn_long --variant ring` times it.

INT8 keys may instead split a block's keys over its warps (`kw` > 0 chunk lanes, templates/attn_decode_keys.cu.j2):
each warp computes whole 16-key chunks over all D dims for 8 query rows (the m16 side is keys, the n8 side rows),
its chunk lane's warps sharing a `stages`-deep cp.async ring, and the lanes' softmax states merge once at the end —
no block barrier or score exchange per chunk. The same grid, splits and partials; its own bits (a decode row
still equals its verify row). `keys_tiling` gives its warps. `choose_layout` (make_key) ships it on KEYS_ARCHS
(sm_90: 1.10–1.32× the ring, session 23) and the dims split elsewhere. Its `early` field (shipped with it) copies a
chunk lane's first ring stages before the PDL wait — the KV pages of keys written before the run — so only Q waits
for the predecessor: the same bits, 32K decode 31.5 → 27.7 µs chained (H100, session 24).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .._torch import torch

from ..targets import Target, lookup
from . import KernelKey, Launch, Param, ceil_div

SMEM_LIMIT = 48 * 1024      # static shared memory
RESERVED_SMEM = 1024        # shared memory the CUDA runtime keeps per block on sm_80+ (counts against the SM's)
RING_TEMPLATE = "attn_decode_ring.cu.j2"
KEYS_TEMPLATE = "attn_decode_keys.cu.j2"
KEYS_MAX_WARPS = 12         # a `kw` block's warps at most: row tiles past it go to further blocks (row blocks)


@dataclass(frozen=True)
class Tiling:
    """How a key's work is cut (the template computes the same from the key's fields): `mt` m16 tiles of query
    rows per block, `row_blocks` blocks over a kv head's rows, `chunk` keys per step of a block's loop — the
    online softmax's step, the same at every T so that a decode row and a verify row get the same bits."""
    mt: int
    row_blocks: int
    chunk: int
    warps: int


def tiling(key) -> Tiling:
    rows = key.hq // key.hkv * key.t
    tiles = ceil_div(rows, 16)
    mt = min(tiles, 2 if key.kv_dtype == "int8" else 1)      # bf16 rows' K and V take twice the registers
    return Tiling(mt, ceil_div(tiles, mt), 32, key.d // 64)


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "attn_decode"
    hq: int
    hkv: int
    d: int
    b: int
    t: int
    kv_dtype: str
    page: int
    max_pages: int
    splits: int
    gate: bool
    arch: str
    stages: int = 0        # INT8: ≥ 2 = each warp's cp.async ring of that many chunks; 0 = direct loads
    kw: int = 0            # INT8: > 0 = the keys split over that many chunk lanes (attn_decode_keys); 0 = dims split
    early: bool = False    # keys split: the ring's first stages copied before the PDL wait (the same bits)

    def __post_init__(self):
        if self.kv_dtype not in ("int8", "bf16") or self.d % 64 or 256 % self.d or self.page != 64:
            raise ValueError(f"attn_decode: unsupported shape {self}")
        if self.early and not self.kw:
            raise ValueError(f"attn_decode: `early` is a field of the keys split (kw > 0), not of {self.name}")
        if self.kw:
            if self.kv_dtype != "int8" or not 1 <= self.kw <= KEYS_MAX_WARPS or self.stages < 2:
                raise ValueError(f"attn_decode keys split: INT8 KV, 1 ≤ kw ≤ {KEYS_MAX_WARPS} chunk lanes and a ring "
                                 f"of ≥ 2 stages ({self.kv_dtype}, kw {self.kw}, {self.stages} stages asked)")
            need, limit = keys_smem(self), lookup(self.arch).smem_per_block
            if need > limit:
                raise ValueError(f"attn_decode keys split: {need} B of shared memory ({self.kw} lanes × {self.stages} "
                                 f"stages), more than the {limit} B a block may have on {self.arch}")
            return
        if smem_bytes(self) > SMEM_LIMIT:
            raise ValueError(f"attn_decode: {smem_bytes(self)} B of shared memory exceeds {SMEM_LIMIT}")
        if self.stages:
            if self.kv_dtype != "int8":
                raise ValueError(f"attn_decode ring: INT8 KV only ({self.kv_dtype} asked): bf16 keys are 128 bytes "
                                 "a warp, whose ring layout and swizzle the template does not have")
            if self.stages < 2:
                raise ValueError(f"attn_decode ring: {self.stages} stages: a ring needs 2 or more")
            need, limit = ring_smem(self, self.stages), lookup(self.arch).smem_per_block
            if need > limit:
                raise ValueError(f"attn_decode ring: {self.stages} stages take {need} B of shared memory, more "
                                 f"than the {limit} B a block may have on {self.arch}")

    @property
    def template(self) -> str | None:
        """The keys split's or the ring's own kernel; None: the family's, attn_decode.cu.j2 (direct loads)."""
        return KEYS_TEMPLATE if self.kw else RING_TEMPLATE if self.stages else None

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"b{self.b}", f"t{self.t}", self.kv_dtype,
                f"p{self.page}x{self.max_pages}", f"s{self.splits}"] + (["gate"] if self.gate else []) + \
            ([f"kw{self.kw}s{self.stages}"] if self.kw else [f"ring{self.stages}"] if self.stages else []) + \
            (["early"] if self.early else [])

    def dynamic_smem(self) -> int:
        """Dynamic shared memory the key's template declares: none with direct loads (the score exchange is
        static, `smem_bytes`), the whole `keys_smem` with the keys split, `ring_smem` with a ring; `launch` passes
        it on, so the loader sets the opt-in attribute above 48 KiB."""
        return keys_smem(self) if self.kw else ring_smem(self, self.stages) if self.stages else 0


@dataclass(frozen=True)
class KeysTiling:
    """A `kw` key's warps (the template computes the same): `row_tiles` tiles of 8 query rows a block (each tile a
    warp per chunk lane), `row_blocks` blocks over a kv head's rows, `warps` a block."""
    row_tiles: int
    row_blocks: int
    warps: int


def keys_tiling(key: Key) -> KeysTiling:
    tiles = ceil_div(key.hq // key.hkv * key.t, 8)
    nrb = min(tiles, max(1, KEYS_MAX_WARPS // key.kw))
    return KeysTiling(nrb, ceil_div(tiles, nrb), key.kw * nrb)


def keys_smem(key: Key, stages: int | None = None) -> int:
    """The keys split's dynamic shared memory (the template asserts the same): the larger of its rings (per chunk
    lane `stages` stages of a 16-key chunk's K and V codes, D bytes a key each, and their fp16 scales) and the
    merge of the lanes' Oᵀ, m and l in fp32."""
    stage, stages = 32 * key.d + 64 * (key.d // 64), key.stages if stages is None else stages
    return max(key.kw * stages * stage, key.kw * 8 * keys_tiling(key).row_tiles * (key.d + 2) * 4)


def keys_stages(key: Key) -> int:
    """The most stages (2–4) for a `kw` key with which its blocks per SM still fit in shared memory — two a SM when
    its row tiles are one (a decode), else one (its registers allow no more) — or 0 where not even 2 fit."""
    target, blocks = lookup(key.arch), 2 if keys_tiling(key).row_tiles == 1 else 1
    for stages in (4, 3, 2):
        need = keys_smem(key, stages)
        if need <= target.smem_per_block and blocks * (need + RESERVED_SMEM) <= target.smem_per_sm:
            return stages
    return 0


def smem_bytes(key: Key) -> int:
    """The warps' partial scores, double-buffered (none with one warp)."""
    t = tiling(key)
    return 2 * t.warps * t.mt * (t.chunk // 8) * 32 * 16 if t.warps > 1 else 16


def ring_smem(key: Key, stages: int) -> int:
    """The ring template's dynamic shared memory (it asserts the same): the score exchange (static in the
    direct-load kernel, `smem_bytes`) and per warp `stages` stages of a chunk's K and V codes (64 bytes a key) and
    its K and V scales of every group (fp16)."""
    t = tiling(key)
    exchange = smem_bytes(key) if t.warps > 1 else 0
    return exchange + stages * t.warps * (2 * t.chunk * 64 + 2 * t.chunk * (key.d // 64) * 2)


def ring_stages(key: Key, blocks: tuple[int, ...] = (2, 1)) -> int:
    """The most stages (2–4) with which two blocks still fit an SM of the key's arch — the direct-load kernel's
    occupancy, one wave of the 27B's 264 blocks on 132 SMs: 4 on sm_90, 3 (one row tile) or 2 (two) on sm_80. Where
    not even 2 do (sm_86/89, 100 KB an SM: the exchange and two stages are 52–68 KB a block), the most for one
    block an SM (4 / 3), unless `blocks` leaves 1 out (then 0: no ring)."""
    target = lookup(key.arch)
    for n in blocks:
        for stages in (4, 3, 2):
            need = ring_smem(key, stages)
            if need <= target.smem_per_block and n * (need + RESERVED_SMEM) <= target.smem_per_sm:
                return stages
    if 1 not in blocks:
        return 0
    raise ValueError(f"attn_decode ring: no ring of 2 stages fits {target.name}'s shared memory ({key.name})")


KEYS_LANES = 4              # a `kw` key's chunk lanes: the direct-load kernel's warps at one row tile


def keys_split(key: Key, kw: int = KEYS_LANES) -> Key:
    """`key` with its keys split over `kw` chunk lanes (templates/attn_decode_keys.cu.j2) and the most stages that
    keep its blocks per SM (`keys_stages`; 2 where even those do not)."""
    k = replace(key, kw=kw, stages=2)
    return replace(k, stages=keys_stages(k) or 2)


KEYS_ARCHS = ("sm_90",)     # where the keys split was timed against the ring (H100, session 23: 1.10–1.32×)


def choose_layout(key: Key) -> Key:
    """The shipped division of an attn_decode key's work: INT8 KV on KEYS_ARCHS splits the keys over chunk lanes
    (`keys_split`) with its first copies `early`; elsewhere (bf16 KV, and sm_80/86/89, where nothing else was timed)
    the warps split the dims with direct loads."""
    base = replace(key, kw=0, stages=0, early=False)
    return replace(keys_split(base), early=True) if base.kv_dtype == "int8" and base.arch in KEYS_ARCHS else base


def choose_splits(hkv: int, max_pages: int, target: Target) -> int:
    """Enough blocks for two waves over the SMs at batch 1; at most one page per split."""
    return max(1, min(max_pages, ceil_div(2 * target.sms, hkv)))


def make_key(hq, hkv, d, b, t, kv_dtype, max_pages, target: Target, gate=True, page=64) -> Key:
    return choose_layout(Key(hq, hkv, d, b, t, kv_dtype, page, max_pages, choose_splits(hkv, max_pages, target), gate,
                             target.arch))


def launch(key: Key, target: Target | None = None) -> Launch:
    cut = keys_tiling(key) if key.kw else tiling(key)
    return Launch((key.splits, key.hkv * cut.row_blocks, key.b), (32 * cut.warps, 1, 1), key.dynamic_smem())


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[b, t, hq, d] bf16 (splits == 1)"),
            Param("part_o", "ptr", "[b·t, hq, splits, d] f32 (splits > 1)"),
            Param("part_ml", "ptr", "[b·t, hq, splits] float2 (m, l)"),
            Param("q", "ptr", "[b, t, hq, d] bf16 (normed, roped)"),
            Param("gate_src", "ptr", "[b·t, hq, 2d] bf16, gate in the second half"),
            Param("k_pages", "ptr", ""), Param("v_pages", "ptr", ""), Param("k_scales", "ptr", "int8"),
            Param("v_scales", "ptr", "int8"), Param("block_table", "ptr", "[b, max_pages] int32"),
            Param("seq_lens", "ptr", "[b] int32 keys incl. the t new tokens; 0 = padded row")]


def workspace(key: Key) -> dict[str, int]:
    """Bytes of the split partials attn_combine reduces (none when splits == 1)."""
    if key.splits == 1:
        return {}
    rows = key.b * key.t * key.hq * key.splits
    return {"part_o": rows * key.d * 4, "part_ml": rows * 8}


def gather_kv(pages: dict, name: str, table_row, length: int, hkv: int, d: int, page: int) -> torch.Tensor:
    """fp32 [length, hkv, d] for one sequence from its pages."""
    ids = [int(table_row[i]) for i in range(ceil_div(length, page))]
    codes = pages[name][ids].float()                                      # [n, hkv, page, d]
    if name + "_scales" in pages:
        codes = codes * pages[name + "_scales"][ids].float().repeat_interleave(64, dim=-1)
    return codes.permute(0, 2, 1, 3).reshape(-1, hkv, d)[:length]


def reference(key: Key, q, gate_src, pages: dict, block_table, seq_lens) -> torch.Tensor:
    """bf16 [b, t, hq, d]; rows with seq_len 0 stay zero."""
    out = torch.zeros(key.b, key.t, key.hq, key.d, device=q.device)
    grp = key.hq // key.hkv
    for b in range(key.b):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        k = gather_kv(pages, "k", block_table[b], n, key.hkv, key.d, key.page).repeat_interleave(grp, 1)
        v = gather_kv(pages, "v", block_table[b], n, key.hkv, key.d, key.page).repeat_interleave(grp, 1)
        s = torch.einsum("thd,nhd->htn", q[b].float(), k) / key.d ** 0.5
        qpos = n - key.t + torch.arange(key.t, device=q.device).view(-1, 1)
        s = s.masked_fill(torch.arange(n, device=q.device).view(1, -1) > qpos, float("-inf"))
        o = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v)
        if key.gate:
            g = gate_src.view(key.b, key.t, key.hq, 2 * key.d)[b, ..., key.d:].float()
            o = o * torch.sigmoid(g)
        out[b] = o
    return out.to(torch.bfloat16)
