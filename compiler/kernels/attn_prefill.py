"""attn_prefill: causal paged attention for one prefill chunk (flash-attention style, mma.sync).

The chunk's T queries sit at positions L−T … L−1 (L = seq_len[0], a device input); pages as
qk_rope_kv writes them (that kernel runs first, so the chunk attends to itself). One sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param
from .attn_decode import gather_kv


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
    arch: str

    def __post_init__(self):
        if self.t % 16 or self.d % 64 or self.d > 256 or self.page % 32 or self.kv_dtype not in ("int8", "bf16"):
            raise ValueError(f"attn_prefill: unsupported shape {self}")

    def _name_parts(self):
        return [f"q{self.hq}", f"kv{self.hkv}", f"d{self.d}", f"t{self.t}", self.kv_dtype,
                f"p{self.page}x{self.max_pages}"] + (["gate"] if self.gate else [])


def make_key(hq, hkv, d, t, kv_dtype, max_pages, target: Target, gate=True, page=64) -> Key:
    return Key(hq, hkv, d, t, kv_dtype, page, max_pages, gate, target.arch)


def smem_bytes(key: Key) -> int:
    """Dynamic shared memory: the block's Q rows (16 per query head) and one K and one V tile of 32 keys,
    bf16 rows padded by 8 values (templates/attn_prefill.cu.j2)."""
    return (key.hq // key.hkv * 16 + 2 * 32) * (key.d + 8) * 2


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((key.t // 16, key.hkv, 1), (32 * (key.hq // key.hkv), 1, 1), smem_bytes(key))


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
