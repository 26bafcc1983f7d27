"""attn_vision: the vision tower's attention — 2-D rotary on q and k, then non-causal softmax attention of each
patch over the patches of its own image (segments [cu[i], cu[i+1]) of cu_seqlens), every head, in one launch
(compiler.reference_vision: rope_2d, segment_attention; passes_vision.fuse_vision_attention).

Reads the qkv projection's rows [m, 3, heads, d] as written (no split copies). A block takes 64 queries of one
segment and one head: it rotates them into shared memory (bf16, as the reference rounds them), then walks the
segment's keys 64 at a time (rotated likewise) with mma.sync bf16 tensor cores and an fp32 online softmax; the
probabilities enter the P·V product as bf16. Rows past the last segment (padding) get zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param, ceil_div

QT = 64                    # queries per block (4 warps × 16 rows): must match templates/attn_vision.cu.j2


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "attn_vision"
    heads: int
    d: int                 # head width
    m: int                 # patch rows of the call
    segments: int          # images (segments of cu_seqlens)
    scale: float           # softmax scale (d^-1/2)
    arch: str

    def __post_init__(self):
        if self.d % 8 or self.d > 256 or self.heads < 1 or self.m < 1 or self.segments < 1:
            raise ValueError(f"attn_vision: d a multiple of 8 up to 256 (n8 output tiles, rotated in quarters), "
                             f"heads, m and segments ≥ 1 expected, got {self}")

    def _name_parts(self):
        return [f"h{self.heads}", f"d{self.d}", f"m{self.m}", f"s{self.segments}"]


def blocks(key: Key) -> int:
    """Query tiles along x: Σ ceil(len_i / 64) over the segments plus the padding rows' ≤ ceil(m / 64) + segments
    + 1 (each segment and the padding wastes less than one tile); blocks past the real tiles return at once."""
    return ceil_div(key.m, QT) + key.segments + 1


def launch(key: Key, target: Target | None = None) -> Launch:
    return Launch((blocks(key), key.heads, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("out", "ptr", "[m, heads, d] bf16 attention output"),
            Param("qkv", "ptr", "[m, 3, heads, d] bf16: the qkv projection's rows"),
            Param("coords", "ptr", "[m, 4] int32 (row, col, height, width) of each patch"),
            Param("cu_seqlens", "ptr", "[segments + 1] int32 segment bounds (cu[0] = 0, non-decreasing)"),
            Param("inv_freq", "ptr", "[d / 4] f32 rotary frequencies (const rope2d_inv_freq)")]


def inv_freq(theta: float, d: int) -> torch.Tensor:
    """The d/4 frequencies θ^(−4i/d), in fp32 exactly as compiler.reference_vision.rope_2d computes them."""
    quarter = torch.arange(0, d // 2, 2, dtype=torch.float)
    return 1.0 / (theta ** (quarter / (d // 2)))


def reference(key: Key, qkv: torch.Tensor, coords: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor):
    """[m, heads, d] bf16: 2-D rotary with the frequencies `freqs` (`inv_freq`) on q and k, then segment_attention
    (compiler.reference_vision: with inv_freq(theta, d), the traced primitives' result bit for bit)."""
    from ..reference_vision import rope_2d_freqs, segment_attention

    q, k, v = qkv.reshape(key.m, 3, key.heads, key.d).unbind(1)
    freqs = freqs.to(qkv.device)
    q, k = rope_2d_freqs(q, coords, freqs), rope_2d_freqs(k, coords, freqs)
    return segment_attention(q, k, v, cu_seqlens, scale=key.scale)


def emulate(key: Key, buf) -> None:
    """compiler.emulate: the reference over the call's bound buffers."""
    out = reference(key, buf("qkv", (key.m, 3 * key.heads * key.d), "bf16"), buf("coords", (key.m, 4), "i32"),
                    buf("cu_seqlens", (key.segments + 1,), "i32"), buf("inv_freq", (key.d // 4,), "f32"))
    buf("out", (key.m, key.heads, key.d), "bf16").copy_(out)
