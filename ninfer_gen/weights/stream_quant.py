"""stream_quant: the spec's quantisation recipe applied to one tensor on whatever device holds it (the
GPU during a streaming load), giving the codes and scales of `compiler.quant` bit for bit.

`compiler.quant` is the numerical definition and works on CPU copies; this module repeats its arithmetic
with every operation IEEE-exact on both CPU and CUDA, in row chunks so temporaries stay small. Owns no
format and no rounding rule of its own.
"""
from __future__ import annotations

import torch

from compiler.quant import FLOAT_FORMATS, QTensor, get_format

# Values per row chunk (groups never cross rows): a few fp32 temporaries of 2 MiB on the host, 128 MiB
# on a GPU (fewer, larger launches).
CHUNK_ELEMS = {"cpu": 1 << 19, "cuda": 1 << 25}
_FLOAT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def quantize(w: torch.Tensor, fmt: str, chunk_elems: int | None = None) -> QTensor:
    """`compiler.quant.quantize(w, fmt)` computed on w's device: scale = fp16(max|x| / qmax),
    code = round-half-even(x · fp32(1/scale)) clamped; a zero scale gives codes 0."""
    f = get_format(fmt)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{fmt} quantises 2-D floating-point [N, K] matrices, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k % f.group:
        raise ValueError(f"{fmt} needs K (the last dim) to be a multiple of {f.group}, got shape {tuple(w.shape)}")
    codes = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, k // f.group, dtype=torch.float16, device=w.device)
    # A device tensor, not a Python number: CUDA divides by a host scalar as a multiply by its
    # reciprocal, which is not the IEEE quotient compiler.quant's CPU division gives.
    qmax = torch.tensor(float(f.qmax), dtype=torch.float32, device=w.device)
    chunk_elems = chunk_elems or CHUNK_ELEMS.get(w.device.type, CHUNK_ELEMS["cpu"])
    rows = max(1, chunk_elems // max(k, 1))
    for r in range(0, n, rows):
        x = w[r:r + rows].to(torch.float32).reshape(-1, k // f.group, f.group)
        amax = x.abs().amax(dim=-1)            # NaN propagates, inf stays: one check covers both
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(f"cannot quantise a tensor of shape {tuple(w.shape)} holding inf or NaN "
                             f"(first in rows {r}..{r + x.shape[0] - 1})")
        s = (amax / qmax).to(torch.float16)
        if bool(torch.isinf(s).any()):
            raise ValueError(f"{fmt}: max |x| = {amax.max().item():.6g} overflows the fp16 scale in a tensor "
                             f"of shape {tuple(w.shape)}")
        s32 = s.to(torch.float32)
        inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
        q = torch.round(x * inv.unsqueeze(-1)).clamp_(f.lo, f.hi)
        codes[r:r + rows] = q.reshape(-1, k).to(torch.int8)
        scales[r:r + rows] = s
    return QTensor(fmt, codes, scales)


def to_format(w: torch.Tensor, fmt: str) -> QTensor | torch.Tensor:
    """`compiler.quant.convert(w, fmt)` on w's device: a QTensor, or w cast to bf16 / fp32."""
    if fmt in FLOAT_FORMATS:
        return w.detach().to(_FLOAT[fmt])
    return quantize(w, fmt)


def check_finite(w: torch.Tensor) -> bool:
    """Whether every value is finite (a cheap guard against corrupt data in float-format tensors)."""
    return not w.is_floating_point() or bool(torch.isfinite(w).all())
