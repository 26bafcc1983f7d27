"""quant: the weight formats of MODEL.md §8 (symmetric, fp16 scale × integer code, groups along K).

Owns quantise / dequantise on torch CPU tensors and the dense bit packing of codes. It is the
numerical definition every GPU kernel is tested against; it never decides a device layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._torch import torch

FP16_MAX = 65504.0
# Bounds the int64 working set of pack/unpack to a few tens of MiB whatever the matrix size.
_PACK_CHUNK_CODES = 1 << 22


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int
    group: int
    qmax: int
    lo: int
    hi: int

    @property
    def bits_per_weight(self) -> float:
        return self.bits + 16 / self.group  # one fp16 scale per group


FORMATS: dict[str, QuantFormat] = {
    "q4g64": QuantFormat("q4g64", bits=4, group=64, qmax=7, lo=-8, hi=7),
    "q5g64": QuantFormat("q5g64", bits=5, group=64, qmax=15, lo=-16, hi=15),
    "q6g64": QuantFormat("q6g64", bits=6, group=64, qmax=31, lo=-32, hi=31),
    "w8g32": QuantFormat("w8g32", bits=8, group=32, qmax=127, lo=-127, hi=127),
}
FLOAT_FORMATS = ("bf16", "fp32")      # unquantised weight formats (torch dtypes of the same names)
# pack_codes only knows a width; each width belongs to exactly one format, which gives its offset.
_FORMAT_BY_BITS = {f.bits: f for f in FORMATS.values()}


def get_format(fmt: str) -> QuantFormat:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantised weight format {fmt!r} (expected one of: {', '.join(FORMATS)})")
    return FORMATS[fmt]


@dataclass(frozen=True)
class QTensor:
    """A quantised matrix: `codes` int8 [N, K], `scales` fp16 [N, K // group]; w = scale × code."""
    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        f = get_format(self.fmt)
        if self.codes.dtype != torch.int8 or self.codes.dim() != 2:
            raise ValueError(f"QTensor codes must be a 2-D int8 tensor, got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        n, k = self.codes.shape
        if k % f.group or self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (n, k // f.group):
            raise ValueError(f"QTensor {self.fmt} scales must be float16 [{n}, {k} // {f.group}] for codes "
                             f"[{n}, {k}], got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        """Packed size: `bits` per code (rows padded to a byte) plus 2 bytes per scale."""
        n, k = self.shape
        return n * math.ceil(k * self.format.bits / 8) + 2 * self.scales.numel()


def _check_matrix(w: torch.Tensor, f: QuantFormat) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{f.name} quantises 2-D [N, K] matrices, got shape {shape}")
    if not w.is_floating_point():
        raise ValueError(f"{f.name} quantises floating-point tensors, got {w.dtype}")
    if w.shape[1] % f.group:
        raise ValueError(f"{f.name} needs K (the last dim) to be a multiple of {f.group}, "
                         f"got shape {tuple(w.shape)}")


def quantize(w: torch.Tensor, fmt: str) -> QTensor:
    """Quantise a 2-D float matrix: per group scale = fp16(max|x|/qmax), code = rne(x · fp32(1/scale))."""
    f = get_format(fmt)
    _check_matrix(w, f)
    n, k = w.shape
    x = w.detach().to("cpu", torch.float32).reshape(n, k // f.group, f.group)
    if not torch.isfinite(x).all():
        raise ValueError(f"cannot quantise a tensor of shape {tuple(w.shape)} holding inf or NaN")
    amax = x.abs().amax(dim=-1)
    scales = (amax / f.qmax).to(torch.float16)
    if torch.isinf(scales).any():
        raise ValueError(f"{fmt}: max |x| = {amax.max().item():.6g} overflows the fp16 scale "
                         f"(limit ≈ {FP16_MAX * f.qmax:.6g}) in a tensor of shape {tuple(w.shape)}")
    s32 = scales.to(torch.float32)
    # A zero scale (all-zero group, or one whose scale underflows fp16) gets codes 0, not 0 · inf = NaN.
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.round(x * inv.unsqueeze(-1)).clamp_(f.lo, f.hi)
    return QTensor(fmt, codes.reshape(n, k).to(torch.int8), scales)


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w = scale × code, computed in fp32 (exact: an fp16 scale times a ≤ 8-bit code fits fp32);
    returned in `dtype` (default fp32)."""
    n, k = q.shape
    g = q.format.group
    w = q.codes.to(torch.float32).reshape(n, k // g, g) * q.scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype or torch.float32)


def convert(w: torch.Tensor, fmt: str) -> QTensor | torch.Tensor:
    """A tensor in weight format `fmt`: a QTensor for quantised formats, else the tensor cast to bf16/fp32."""
    if fmt in FLOAT_FORMATS:
        return w.detach().to({"bf16": torch.bfloat16, "fp32": torch.float32}[fmt])
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (expected one of: "
                         f"{', '.join([*FORMATS, *FLOAT_FORMATS])})")
    return quantize(w, fmt)


def _pack_format(bits: int) -> QuantFormat:
    if bits not in _FORMAT_BY_BITS:
        raise ValueError(f"no weight format has {bits}-bit codes (expected one of: "
                         f"{', '.join(map(str, sorted(_FORMAT_BY_BITS)))})")
    return _FORMAT_BY_BITS[bits]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int8 codes [..., K] into uint8 [..., ceil(K·bits/8)]: field i of a row holds (code − lo) in
    stream bits [i·bits, (i+1)·bits), stream bit j being bit j % 8 of byte j // 8 (little-endian)."""
    f = _pack_format(bits)
    if codes.dim() < 1 or codes.dtype != torch.int8:
        raise ValueError(f"pack_codes expects an int8 tensor of codes, got {codes.dtype} {tuple(codes.shape)}")
    if codes.numel() and (codes.min() < f.lo or codes.max() > f.hi):
        raise ValueError(f"{bits}-bit codes must lie in [{f.lo}, {f.hi}], got [{codes.min()}, {codes.max()}]")
    *lead, k = codes.shape
    rows = codes.reshape(-1, k)
    row_bytes = math.ceil(k * bits / 8)
    blocks = math.ceil(k / 8)
    # Eight fields of `bits` bits are exactly `bits` whole bytes, so rows are packed 8 codes at a time.
    shifts = torch.arange(8, dtype=torch.int64) * bits
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    out = torch.empty(rows.shape[0], blocks * bits, dtype=torch.uint8)
    step = max(1, _PACK_CHUNK_CODES // max(k, 1))
    for r in range(0, rows.shape[0], step):
        u = rows[r:r + step].to(torch.int64) - f.lo
        u = torch.nn.functional.pad(u, (0, blocks * 8 - k)).reshape(u.shape[0], blocks, 8)
        # Wrap-around past bit 63 (bits = 8) is harmless: the masks below read bytes back bit-exactly.
        word = (u << shifts).sum(dim=-1, keepdim=True)
        out[r:r + step] = ((word >> byte_shifts) & 0xFF).reshape(u.shape[0], -1).to(torch.uint8)
    return out[:, :row_bytes].reshape(*lead, row_bytes)


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., ceil(K·bits/8)] back to int8 codes of `shape` [..., K]."""
    f = _pack_format(bits)
    shape = tuple(shape)
    if not shape:
        raise ValueError("unpack_codes needs a shape with a last dim K")
    *lead, k = shape
    row_bytes = math.ceil(k * bits / 8)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (*lead, row_bytes):
        raise ValueError(f"{bits}-bit codes of shape {shape} pack to uint8 {(*lead, row_bytes)}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    rows = packed.reshape(-1, row_bytes)
    blocks = math.ceil(k / 8)
    shifts = torch.arange(8, dtype=torch.int64) * bits
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    out = torch.empty(rows.shape[0], k, dtype=torch.int8)
    step = max(1, _PACK_CHUNK_CODES // max(k, 1))
    for r in range(0, rows.shape[0], step):
        b = torch.nn.functional.pad(rows[r:r + step].to(torch.int64), (0, blocks * bits - row_bytes))
        word = (b.reshape(b.shape[0], blocks, bits) << byte_shifts).sum(dim=-1, keepdim=True)
        u = ((word >> shifts) & ((1 << bits) - 1)).reshape(b.shape[0], blocks * 8)[:, :k]
        out[r:r + step] = (u + f.lo).to(torch.int8)
    return out.reshape(shape)
