"""kquant: llama.cpp's k-quant weight formats (Q4_K, Q5_K, Q6_K) as GGUF files store them — the block
layout, `KQTensor` (a matrix's blocks, byte for byte), and the reference dequantisation.

Owns the numerical definition of these formats here: `dequantize` equals the `gguf` package's
dequantisation bit for bit (tests/test_gguf_quants.py), and every k-quant kernel is tested against it.
It never quantises (weights in these formats come from GGUF files) and never decides a device layout.

A row of K values is K/256 super-blocks; a super-block of 256 values is (byte offsets):
  q4_k (144 B): d fp16 [0:2], dmin fp16 [2:4], 12 B of 6-bit (scale, min) pairs [4:16], 128 B nibbles;
                sub-block j (32 values): w = d·sc_j·q − dmin·m_j, q in 0..15 (nibbles: byte i of chunk
                j//2 holds value i of sub-block j in its low (j even) or high (j odd) half)
  q5_k (176 B): as q4_k plus 32 B of high bits [16:48] before the nibbles: bit j of byte i is bit 4 of
                value i of sub-block j; q in 0..31
  q6_k (210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, d fp16 [208:210];
                sub-block j (16 values): w = d·sc_j·(q − 32), q in 0..63
"""
from __future__ import annotations

from dataclasses import dataclass

from ._torch import torch

QK_K = 256                                   # values per super-block
# Bounds the fp32/int temporaries of a dequantisation to a few tens of MiB whatever the matrix size.
_DEQUANT_CHUNK_BLOCKS = 1 << 15


@dataclass(frozen=True)
class KFormat:
    name: str
    ggml_type: int          # GGMLQuantizationType value in GGUF tensor infos
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / QK_K


KFORMATS: dict[str, KFormat] = {
    "q4_k": KFormat("q4_k", 12, 144),
    "q5_k": KFormat("q5_k", 13, 176),
    "q6_k": KFormat("q6_k", 14, 210),
}


def get_kformat(fmt: str) -> KFormat:
    if fmt not in KFORMATS:
        raise ValueError(f"unknown k-quant format {fmt!r} (expected one of: {', '.join(KFORMATS)})")
    return KFORMATS[fmt]


@dataclass(frozen=True)
class KQTensor:
    """A k-quant matrix [N, K]: `blocks` uint8 [N, K/256 · block_bytes], each row's super-blocks as stored."""
    fmt: str
    blocks: torch.Tensor
    k: int

    def __post_init__(self):
        f = get_kformat(self.fmt)
        if self.k <= 0 or self.k % QK_K:
            raise ValueError(f"{self.fmt} needs K (the row length) to be a positive multiple of {QK_K}, got {self.k}")
        want = self.k // QK_K * f.block_bytes
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != want:
            raise ValueError(f"{self.fmt} blocks of a [N, {self.k}] matrix must be uint8 [N, {want}], got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.k)

    @property
    def format(self) -> KFormat:
        return KFORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor | slice) -> "KQTensor":
        """The same format over a selection of rows (blocks never cross rows)."""
        return KQTensor(self.fmt, self.blocks[index].contiguous(), self.k)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 bytes → fp32 [...]."""
    return b.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes of packed 6-bit scales and mins [nb, 12] → (scales, mins) int64 [nb, 8]."""
    s = s.to(torch.int64).view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 128] bytes → [nb, 8, 32] values: sub-block 2c + h is byte i of chunk c shifted by 4h."""
    q = qs.to(torch.int64).view(-1, 4, 1, 32) >> torch.tensor([0, 4], device=qs.device).view(1, 1, 2, 1)
    return (q & 0x0F).view(-1, 8, 32)


def _dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _nibbles(b[:, 16:144]).to(torch.float32)
    # fp32 products in the same order as the reference (d·sc first, then ·q, then − dmin·m): bit-exact.
    scale = (d.unsqueeze(-1) * sc.to(torch.float32)).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * mn.to(torch.float32)).unsqueeze(-1)
    return (scale * q - offset).view(-1, QK_K)


def _dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int64).view(-1, 1, 32) >> torch.arange(8, device=b.device).view(1, 8, 1)
    q = (_nibbles(b[:, 48:176]) | ((qh & 1) << 4)).to(torch.float32)
    scale = (d.unsqueeze(-1) * sc.to(torch.float32)).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * mn.to(torch.float32)).unsqueeze(-1)
    return (scale * q - offset).view(-1, QK_K)


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].to(torch.int64).view(-1, 2, 1, 64) >> torch.tensor([0, 4], device=b.device).view(1, 1, 2, 1)
    qh = b[:, 128:192].to(torch.int64).view(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device).view(1, 1, 4, 1)
    q = ((ql & 0x0F).view(-1, 8, 32) | ((qh & 0x03).view(-1, 8, 32) << 4)) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _fp16(b[:, 208:210])
    scale = (d.unsqueeze(-1) * scales).unsqueeze(-1)                         # [nb, 16, 1]
    return (scale * q.view(-1, 16, 16).to(torch.float32)).view(-1, QK_K)


_DEQUANT = {"q4_k": _dequant_q4_k, "q5_k": _dequant_q5_k, "q6_k": _dequant_q6_k}


def dequantize_blocks(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, block_bytes] super-blocks → fp32 [nb, 256], in chunks (bounded temporaries)."""
    f = get_kformat(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != f.block_bytes:
        raise ValueError(f"{fmt} super-blocks must be uint8 [n, {f.block_bytes}], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    out = torch.empty(blocks.shape[0], QK_K, dtype=torch.float32, device=blocks.device)
    for b0 in range(0, blocks.shape[0], _DEQUANT_CHUNK_BLOCKS):
        out[b0:b0 + _DEQUANT_CHUNK_BLOCKS] = _DEQUANT[fmt](blocks[b0:b0 + _DEQUANT_CHUNK_BLOCKS])
    return out


def dequantize(w: KQTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The matrix [N, K] the blocks encode, computed in fp32; returned in `dtype` (default fp32)."""
    n, k = w.shape
    flat = w.blocks.reshape(-1, w.format.block_bytes)
    return dequantize_blocks(w.fmt, flat).view(n, k).to(dtype or torch.float32)


def random_kquant(fmt: str, n: int, k: int, gen: torch.Generator | None = None, device=None,
                  scale: float = 0.02) -> KQTensor:
    """Random super-blocks with valid fp16 scales (test and bench inputs; k-quants have no quantiser
    here): every code byte uniform, d and dmin drawn in (0.1, 1) · `scale`, so values are O(scale)."""
    f = get_kformat(fmt)
    device = device if device is not None else (gen.device if gen is not None else "cpu")
    nb = n * (k // QK_K)
    blocks = torch.randint(0, 256, (nb, f.block_bytes), generator=gen, dtype=torch.uint8, device=device)
    d = ((torch.rand(nb, 2, generator=gen, device=device) * 0.9 + 0.1) * scale)
    if fmt == "q6_k":               # int8 sub-scales reach ±128 and codes ±32
        blocks[:, 208:210] = (d[:, :1] / (128 * 32)).to(torch.float16).view(torch.uint8)
    else:                           # 6-bit sub-scales and mins reach 63 and codes 15 or 31
        top = 63 * (15 if fmt == "q4_k" else 31)
        blocks[:, 0:4] = (d / top).to(torch.float16).view(torch.uint8)
    return KQTensor(fmt, blocks.view(n, -1), k)
