"""attn_prefill: causal paged attention for one prefill chunk (flash-attention style, mma.sync).

The chunk's T queries sit at positions L−T … L−1 (L = seq_len[0], a device input); pages as
qk_rope_kv writes them (that kernel runs first, so the chunk attends to itself). One sequence.
INT8 pages (templates/attn_prefill_int8.cu.j2): a kv head's GROUP·T query rows flattened into blocks of
`warps` × 16 rows, K/V codes cp.async'd into a 2-stage ring and converted once per block to fp16
code·scale in a double buffer between the QK mma, `tk` keys per tile (`tiling`: the most warps and keys
whose shared memory fits the card). On sm_90 the INT8 tiling is WG_TILING (templates/attn_prefill_wg.cu.j2,
compiled for sm_90a): two warpgroups × 64 flattened rows, 64-key tiles, both products on wgmma — every K/V byte a
warpgroup reads from shared memory serves 64 rows (mma.sync: 16). bf16 pages (templates/attn_prefill.cu.j2): a
block of 16 query tokens, one warp per query head of a kv head, 32-key bf16 tiles through registers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div
from . import gemm_wg
from .attn_decode import gather_kv

# (warps, keys per tile) of the INT8 kernel, tried in order: 8 warps × 16 rows keep the tensor pipe of every
# SMSP busy (the one block per SM is bound by O's registers); 32-key tiles halve the barriers per key
TILINGS = ((8, 32), (8, 16), (4, 16))
INT8_TEMPLATE = "attn_prefill_int8.cu.j2"
WG_TILING = (8, 64)         # the wgmma kernel's (warps, keys per tile), sm_90 only
WG_TEMPLATE = "attn_prefill_wg.cu.j2"


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "attn_prefill"
    hq: int
    hkv: int
    d: int
    t: int                 # chunk tokens, a multiple of 16
    kv_dtype: str
    page: int
    max_pages: int
    gate: bool
    warps: int             # INT8: 16 flattened query rows each; bf16: one per query head of a kv head
    tk: int                # keys per tile
    arch: str

    def __post_init__(self):
        if self.t % 16 or self.d % 64 or self.d > 256 or self.page % 32 or self.kv_dtype not in ("int8", "bf16"):
            raise ValueError(f"attn_prefill: unsupported shape {self}")
        tilings = TILINGS + (WG_TILING,) if self.kv_dtype == "int8" else ((self.hq // self.hkv, 32),)
        if (self.warps, self.tk) not in tilings or self.page % self.tk:
            raise ValueError(f"attn_prefill: unsupported tiling {self.warps} warps × {self.tk} keys for {self}")
        if self.wg and not gemm_wg.arch_supported(self.arch):
            raise ValueError(f"attn_prefill: the {WG_TILING[0]} × {WG_TILING[1]} tiling is the wgmma kernel's, "
                             f"sm_90 only (compiled for sm_90a), not {self.arch}")

    @property
    def wg(self) -> bool:
        """Whether the key is the wgmma kernel's (INT8, WG_TILING)."""
        return self.kv_dtype == "int8" and (self.warps, self.tk) == WG_TILING

    @property
    def template(self) -> str | None:
        """INT8 pages' own kernels (wgmma or mma.sync); None: the family's, attn_prefill.cu.j2 (bf16)."""
        return (WG_TEMPLATE if self.wg else INT8_TEMPLATE) if self.kv_dtype == "int8" else None

    @property
    def compile_arch(self) -> str:
        return self.arch + "a" if self.wg else self.arch

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"t{self.t}", self.kv_dtype,
                f"p{self.page}x{self.max_pages}"] + (["gate"] if self.gate else []) + [f"w{self.warps}k{self.tk}"]


def wg_smem_bytes(d: int, warps: int, tk: int) -> int:
    """The wgmma kernel's shared memory (it asserts the same): Q (16·warps rows) and one K and one V tile as fp16,
    two ring stages of codes and fp16 scales as the mma.sync kernel's, and 1 KB to align the swizzle atoms."""
    return 16 * warps * d * 2 + 2 * tk * d * 2 + 2 * (2 * tk * d + 2 * tk * (d // 64) * 2) + 1024


def int8_smem_bytes(d: int, warps: int, tk: int) -> int:
    """The INT8 kernel's shared memory: Q rows (fp16, rows padded by 8 values), two fp16 K+V tile buffers, two
    ring stages of K and V codes and their fp16 scales (the template asserts the same total)."""
    row = (d + 8) * 2
    return 16 * warps * row + 2 * 2 * tk * row + 2 * (2 * tk * d + 2 * tk * (d // 64) * 2)


def tiling(hq: int, hkv: int, d: int, kv_dtype: str, page: int, target: Target) -> tuple[int, int]:
    """(warps, tk): INT8, WG_TILING where wgmma runs (sm_90) and its shared memory fits, else the first of TILINGS
    whose shared memory fits one block of the card (sm_80: 8 × 16, sm_86/sm_89: 4 × 16); bf16, one warp per query
    head and 32 keys."""
    if kv_dtype != "int8":
        return hq // hkv, 32
    if (gemm_wg.arch_supported(target.arch) and page % WG_TILING[1] == 0
            and wg_smem_bytes(d, *WG_TILING) <= target.smem_per_block):
        return WG_TILING
    return mma_tiling(d, page, target)


def mma_tiling(d: int, page: int, target: Target) -> tuple[int, int]:
    """(warps, tk) of the mma.sync INT8 kernel: the first of TILINGS whose shared memory fits one block of the card."""
    for warps, tk in TILINGS:
        if page % tk == 0 and int8_smem_bytes(d, warps, tk) <= target.smem_per_block:
            return warps, tk
    raise ValueError(f"attn_prefill: no INT8 tiling of d = {d} fits {target.smem_per_block} B of shared memory")


def make_key(hq, hkv, d, t, kv_dtype, max_pages, target: Target, gate=True, page=64) -> Key:
    return Key(hq, hkv, d, t, kv_dtype, page, max_pages, gate, *tiling(hq, hkv, d, kv_dtype, page, target),
               target.arch)


def smem_bytes(key: Key) -> int:
    """Dynamic shared memory. bf16: the block's Q rows (16 per query head) and one K and one V tile of 32 keys,
    bf16 rows padded by 8 values."""
    if key.kv_dtype == "int8":
        return (wg_smem_bytes if key.wg else int8_smem_bytes)(key.d, key.warps, key.tk)
    return (key.hq // key.hkv * 16 + 2 * 32) * (key.d + 8) * 2


def launch(key: Key, target: Target | None = None) -> Launch:
    """INT8: blocks of 16·warps flattened rows (row r = token r / group, head r % group) per kv head;
    bf16: blocks of 16 tokens per kv head, a warp per query head."""
    if key.kv_dtype == "int8":
        rows = key.hq // key.hkv * key.t
        return Launch((ceil_div(rows, 16 * key.warps), key.hkv, 1), (32 * key.warps, 1, 1), smem_bytes(key))
    return Launch((key.t // 16, key.hkv, 1), (32 * key.warps, 1, 1), smem_bytes(key))


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[t, hq, d] bf16"), Param("q", "ptr", "[t, hq, d] bf16 (normed, roped)"),
            Param("gate_src", "ptr", "[t, hq, 2d] bf16, gate in the second half"),
            Param("k_pages", "ptr", ""), Param("v_pages", "ptr", ""), Param("k_scales", "ptr", "int8"),
            Param("v_scales", "ptr", "int8"), Param("block_table", "ptr", "[max_pages] int32"),
            Param("seq_len", "ptr", "[1] int32: keys including the chunk")]


def reference(key: Key, q, gate_src, pages: dict, block_table, seq_len) -> torch.Tensor:
    n = int(seq_len[0])
    grp = key.hq // key.hkv
    k = gather_kv(pages, "k", block_table, n, key.hkv, key.d, key.page).repeat_interleave(grp, 1)
    v = gather_kv(pages, "v", block_table, n, key.hkv, key.d, key.page).repeat_interleave(grp, 1)
    s = torch.einsum("thd,nhd->htn", q.float(), k) / key.d ** 0.5
    qpos = n - key.t + torch.arange(key.t, device=q.device).view(-1, 1)
    s = s.masked_fill(torch.arange(n, device=q.device).view(1, -1) > qpos, float("-inf"))
    o = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v)
    if key.gate:
        o = o * torch.sigmoid(gate_src.view(key.t, key.hq, 2 * key.d)[..., key.d:].float())
    return o.to(torch.bfloat16)
