"""gemv_emulator: a numpy model of templates/gemv.cu.j2 on the packed planes, for CPU tests.

It decodes the A fragments with the kernel's own bit arithmetic (common/quant.cuh), places them with
the PTX ISA's m16n8k16 fragment definitions (not with weight_layout's maps), feeds B from the
activations the way `load_x` reads them, and applies scales and epilogues as the kernel does. If the
layout and the kernel disagree about any bit, this model's output is wrong.
"""
from __future__ import annotations

import numpy as np
import torch

from compiler.kernels.weight_layout import group_of, padded_rows


def _halves(masked):
    return (masked & 0xFFFF).astype(np.int64), (masked >> 16).astype(np.int64)


def _q5_field(q, hi, s, p):
    """q5g64 register p of step s (both halves' 5-bit codes) as dq_q5 extracts it."""
    if p < 3:
        return (q[..., s] >> (5 * p)) & 0x001F001F
    if s < 3:
        return (hi >> (5 * s)) & 0x001F001F
    words = [q[..., 0], q[..., 1], q[..., 2], q[..., 3], hi]      # step 3's last register: spare bits 15, 31
    out = 0
    for i, word in enumerate(words):
        out = out | ((word >> (15 - i)) & (0x00010001 << i))
    return out


def _a_regs(fmt, q, hi, s):
    """The four A registers of step s as (low, high) integer/float values per lane: [4][2] arrays."""
    w = lambda i: q[..., i]                                           # noqa: E731  word i of uint4 0
    regs = []
    for p in range(4):
        if fmt == "bf16":
            word = q[..., 4 * s + p]
            lo = (word & 0xFFFF).astype(np.uint32) << 16
            hi_ = (word >> 16).astype(np.uint32) << 16
            regs.append((lo.view(np.float32).astype(np.float64), hi_.view(np.float32).astype(np.float64)))
            continue
        if fmt == "w8g32":
            word = w(2 * s + p // 2)
            sh = 8 * (p % 2)
            lo, hi4 = _halves((word >> sh) & 0x000F000F), _halves((word >> (sh + 4)) & 0x000F000F)
            regs.append(tuple(16 * (h - 8) + l for h, l in zip(hi4, lo)))
            continue
        if fmt == "q5g64":
            regs.append(tuple(v - 16 for v in _halves(_q5_field(q, hi[..., 0], s, p))))
            continue
        masked = (w(s) >> (4 * p)) & 0x000F000F
        if fmt == "q6g64":
            masked |= ((hi[..., s // 2] >> (8 * (s & 1) + 2 * p)) << 4) & 0x00300030
        bias = {"q4g64": 8, "q5g64": 16, "q6g64": 32}[fmt]
        regs.append(tuple(v - bias for v in _halves(masked & 0xFFFFFFFF)))
    return regs


def emulate(fmt, packed, x: torch.Tensor, n: int, epilogue="none", res=None) -> np.ndarray:
    """fp64 model of the kernel's result y [M, N_out] (before the output rounding)."""
    m, k = x.shape
    group = group_of(fmt)
    tiles, units, steps = padded_rows(n) // 16, k // group, group // 16
    lo = packed["lo"].numpy().view(np.uint32).reshape(tiles, units, -1, 32, 4)
    q = lo[:, :, 0] if fmt != "bf16" else lo.transpose(0, 1, 3, 2, 4).reshape(tiles, units, 32, -1)
    hi = None
    if fmt in ("q5g64", "q6g64"):
        hi = packed["hi"].numpy().view(np.uint32).reshape(tiles, units, 32, -1)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    xf = np.zeros((32, k))
    xf[:m] = x.float().numpy()
    acc = np.zeros((tiles, 16, 32))                                   # [tile, row, col m]
    for u in range(units):
        c = np.zeros((tiles, 16, 32))
        for s in range(steps):
            a = np.zeros((tiles, 16, 16))
            for p, (vlo, vhi) in enumerate(_a_regs(fmt, q[:, u], None if hi is None else hi[:, u], s)):
                for half, val in ((0, vlo), (1, vhi)):
                    e = 2 * p + half                                  # PTX: a_e
                    a[:, g + 8 * ((e >> 1) & 1), 2 * t + (e & 1) + 8 * (e >> 2)] = val
            b = np.zeros((16, 32))                                    # [k slot, col]
            for col in range(32):                                     # lane (g = col % 8, t) of n-tile col // 8
                base = u * group + t * (group // 4) + 4 * s
                for i in range(4):                                    # PTX: b_i at k = 2t + (i&1) + 8(i>>1)
                    b[2 * t + (i & 1) + 8 * (i >> 1), col] = xf[col, base + i]
            c += a @ b
        if fmt == "bf16":
            acc += c
        else:
            sc = packed["scales"].float().numpy().reshape(tiles, units, 8, 2)[:, u]   # (row g, row g+8)
            acc += np.concatenate([sc[:, :, 0], sc[:, :, 1]], axis=1)[:, :, None] * c
    if epilogue == "silu_mul":
        gate, up = acc[:, :8, :m], acc[:, 8:, :m]
        return (gate / (1 + np.exp(-gate)) * up).reshape(-1, m).T
    y = acc[:, :, :m].reshape(-1, m).T[:, :n]
    return y + (res.float().numpy() if epilogue == "residual" else 0)
