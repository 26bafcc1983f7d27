"""attn_decode: paged attention for decode/verify over INT8-G64 or bf16 KV pages (GQA, causal in T), on
tensor cores (templates/attn_decode.cu.j2).

Pages as qk_rope_kv writes them. `splits` (blocks per kv head and row) comes from the target and the
context bucket, never from B or T, and each row splits its own pages evenly, so a row's result
depends only on its context. splits > 1 writes partials that attn_combine reduces. A block has one
warp per 64 dims; its query rows (a kv head's GROUP·T) are m16 tiles, two at most per block, one with
bf16 KV (`tiling`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div

SMEM_LIMIT = 48 * 1024      # static shared memory


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

    def __post_init__(self):
        if self.kv_dtype not in ("int8", "bf16") or self.d % 64 or 256 % self.d or self.page != 64:
            raise ValueError(f"attn_decode: unsupported shape {self}")
        if smem_bytes(self) > SMEM_LIMIT:
            raise ValueError(f"attn_decode: {smem_bytes(self)} B of shared memory exceeds {SMEM_LIMIT}")

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"b{self.b}", f"t{self.t}", self.kv_dtype,
                f"p{self.page}x{self.max_pages}", f"s{self.splits}"] + (["gate"] if self.gate else [])

    def dynamic_smem(self) -> int:
        """Dynamic shared memory the key's template declares: none here (the score exchange is static,
        `smem_bytes`); a lab variant with a shared-memory ring (lab/attn_long.py's RingKey) declares its own, and
        `launch` passes it on, so the loader sets the opt-in attribute above 48 KiB."""
        return 0


def smem_bytes(key: Key) -> int:
    """The warps' partial scores, double-buffered (none with one warp)."""
    t = tiling(key)
    return 2 * t.warps * t.mt * (t.chunk // 8) * 32 * 16 if t.warps > 1 else 16


def choose_splits(hkv: int, max_pages: int, target: Target) -> int:
    """Enough blocks for two waves over the SMs at batch 1; at most one page per split."""
    return max(1, min(max_pages, ceil_div(2 * target.sms, hkv)))


def make_key(hq, hkv, d, b, t, kv_dtype, max_pages, target: Target, gate=True, page=64) -> Key:
    return Key(hq, hkv, d, b, t, kv_dtype, page, max_pages, choose_splits(hkv, max_pages, target), gate,
               target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    t = tiling(key)
    return Launch((key.splits, key.hkv * t.row_blocks, key.b), (32 * t.warps, 1, 1), key.dynamic_smem())


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
