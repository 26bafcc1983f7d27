"""kq_emulator: a Python model of templates/gemv_kq.cu.j2 on the k-quant planes, for CPU tests.

Each lane's loads, bit operations (PRMT, LOP3, funnel shifts, shuffles) and registers are transcribed
from the template and common/kquant.cuh one for one; the registers are placed with the PTX ISA's
m16n8k16 / m16n8k8 fragment definitions (not with the kernel's comments), and the mma products are
summed in float64. If the template's view of the blocks and the byte layout disagree anywhere, this
model's output is wrong (the tests compare it with compiler.kquant's dequantisation)."""
from __future__ import annotations

import numpy as np
import torch

from compiler.kquant import KFORMATS, QK_K

M32 = 0xFFFFFFFF


def byte_perm(x: int, y: int, s: int) -> int:
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


def and_or(a, b, c):
    return ((a & b) | c) & M32


def shift_r(x, sh):
    return (x >> sh) if sh >= 0 else (x << -sh) & M32


def funnelshift_r(lo, hi, sh):
    return (((hi << 32) | lo) >> (sh & 31)) & M32


def f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def bf16_halves(word: int) -> tuple[float, float]:
    return f32((word & 0xFFFF) << 16), f32(word & 0xFFFF0000)


def bf16_rn(v: float) -> int:
    """float32 → bf16 bits, round to nearest even (cvt.rn.bf16.f32)."""
    b = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def kq_pair(codes: int, sel: int, off: int) -> tuple[float, float]:
    lo, hi = bf16_halves(byte_perm(codes, 0x43, 0x4040 | sel))
    return lo - (128 + off), hi - (128 + off)           # __hfma2(v, 1, −(128 + off)), exact here


def byte_as_f32(w, i):
    return f32(byte_perm(w, 0x4B000000, 0x7650 | i)) - 8388608.0


def biased_s8_as_f32(w, i):
    return f32(byte_perm(w, 0x4B000000, 0x7650 | i)) - 8388736.0


def split3(a: float, b: float) -> list[tuple[float, float]]:
    parts = []
    a, b = np.float32(a), np.float32(b)
    for _ in range(3):
        h = (bf16_rn(a), bf16_rn(b))
        hf = (f32(h[0] << 16), f32(h[1] << 16))
        parts.append(hf)
        a, b = np.float32(a - np.float32(hf[0])), np.float32(b - np.float32(hf[1]))
    return parts


# PTX fragment layouts (lane = 4g + t): register → (row, col) of each half (low half first).
def a16_coords(g, t):      # m16n8k16 A (16×16): a0..a3
    return [((g, 2 * t), (g, 2 * t + 1)), ((g + 8, 2 * t), (g + 8, 2 * t + 1)),
            ((g, 2 * t + 8), (g, 2 * t + 9)), ((g + 8, 2 * t + 8), (g + 8, 2 * t + 9))]


def b16_coords(g, t):      # m16n8k16 B (16×8, [k][n]): b0, b1
    return [((2 * t, g), (2 * t + 1, g)), ((2 * t + 8, g), (2 * t + 9, g))]


def c_coords(g, t):        # m16n8 C/D (16×8): d0..d3
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def a8_coords(g, t):       # m16n8k8 A (16×8): a0, a1
    return [((g, 2 * t), (g, 2 * t + 1)), ((g + 8, 2 * t), (g + 8, 2 * t + 1))]


def b8_coords(g, t):       # m16n8k8 B (8×8): b0
    return [((2 * t, g), (2 * t + 1, g))]


def place(shape, lanes, coords, halves):
    """A matrix from per-lane registers given as (low, high) float pairs."""
    out = np.zeros(shape)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, pos in zip(halves[lane], coords(g, t)):
            for v, (r, c) in zip(reg, pos):
                out[r, c] = v
    return out


def words_of(x_row: np.ndarray, col: int, n: int) -> list[int]:
    """n u32 words of bf16 activations from column `col` of one row (uint16 bits)."""
    return [int(x_row[col + 2 * i]) | (int(x_row[col + 2 * i + 1]) << 16) for i in range(n)]


def _u(plane: bytes, off: int, n: int = 4) -> int:
    return int.from_bytes(plane[off:off + n], "little")


def emulate(fmt: str, plane: torch.Tensor, x: torch.Tensor, n: int, lean: bool = False) -> np.ndarray:
    """y [M, N] (float64) as the kernel computes it from the packed `lo` plane and bf16 activations x; `lean`: the
    Q4_K/Q5_K unit math of key `kq_lean` (templates/common/kq_lean.j2, codes + 128)."""
    m, k = x.shape
    qb, units = KFORMATS[fmt].block_bytes, k // QK_K
    rb = units * qb
    buf = bytes(plane.cpu().numpy().tobytes())
    xb = x.cpu().contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    nt = (m + 7) // 8
    tiles = -(-n // 16)
    y = np.zeros((m, tiles * 16))
    for tile in range(tiles):
        for u in range(units):
            unit = _unit_q6 if fmt == "q6_k" else _unit_q45_lean if lean else _unit_q45
            acc = unit(fmt, buf, xb, tile, u, rb, qb, nt, m)
            for jj in range(nt):
                for tok in range(8):
                    if 8 * jj + tok < m:
                        y[8 * jj + tok, tile * 16:(tile + 1) * 16] += acc[jj][:, tok]
    return y[:, :n]


def _xrow(xb, m, jj, g):
    return xb[min(8 * jj + g, m - 1)]


def block_offset(row: int, u: int, units: int, qb: int) -> int:
    """Byte offset of row `row`'s super-block u in the device layout (16-row tile order; common/kquant.cuh
    kq_block_offset)."""
    return (((row >> 4) * units + u) * 16 + (row & 15)) * qb


def _lane_rows(fmt, buf, tile, u, rb, qb):
    """Per lane (g, t), its two rows' (g, g + 8) unit header as the kernel reads it: codes, high bits (Q5_K), d, the
    packed 6-bit scales, and the lane's pair of mins and of scales (`amin`, `ascl`)."""
    qs_at = 16 if fmt == "q4_k" else 48
    lanes = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        rows = []
        for h in range(2):
            blk = block_offset(tile * 16 + g + 8 * h, u, rb // qb, qb)
            hd = [_u(buf, blk + 4 * i) for i in range(4)]
            qh = [_u(buf, blk + 16 + 8 * t), _u(buf, blk + 16 + 8 * t + 4)] if fmt == "q5_k" else None
            qs = [[_u(buf, blk + qs_at + 32 * c + 8 * t), _u(buf, blk + qs_at + 32 * c + 8 * t + 4)] for c in range(4)]
            d = np.frombuffer(buf[blk:blk + 4], dtype=np.float16).astype(np.float64)
            sc = [hd[1] & 0x3F3F3F3F, and_or(hd[3], 0x0F0F0F0F, (hd[1] >> 2) & 0x30303030)]
            mins = hd[2] & 0x3F3F3F3F if t < 2 else and_or(hd[3] >> 4, 0x0F0F0F0F, (hd[2] >> 2) & 0x30303030)
            pick = ((2 * t) & 3) | ((((2 * t) & 3) + 1) << 8)
            rows.append({"qs": qs, "qh": qh, "d": d, "sc": sc, "amin": kq_pair(mins, pick, 0),
                         "ascl": kq_pair(sc[0] if t < 2 else sc[1], pick, 0)})
        lanes.append(rows)
    return lanes


def _codes(fmt, row, j, e):
    """Word e of sub-block j's 4-bit codes (Q5_K: with their fifth bit) of one lane's row, one code a byte."""
    q = row["qs"][j >> 1][e] >> (4 * (j & 1))
    if fmt == "q5_k":
        return and_or(q, 0x0F0F0F0F, shift_r(row["qh"][e], j - 4) & 0x10101010)
    return q & 0x0F0F0F0F


def _code_frags(fmt, lanes, j, bias):
    """Sub-block j's codes as the two 16×16 A fragments of the product mma (code + bias as fp16)."""
    a = []
    for e in range(2):
        regs = []
        for lane in range(32):
            c0, c1 = (_codes(fmt, r, j, e) for r in lanes[lane])
            regs.append([kq_pair(c0, 0x0100, bias), kq_pair(c1, 0x0100, bias), kq_pair(c0, 0x0302, bias),
                         kq_pair(c1, 0x0302, bias)])
        a.append(place((16, 16), None, a16_coords, regs))
    return a


def _x_words(xb, m, u, j, nt):
    """Per 8-token tile and lane (g, t), the four words of activations it loads for sub-block j of unit u."""
    return [[words_of(_xrow(xb, m, jj, lane >> 2), u * 256 + 32 * j + 8 * (lane & 3), 4) for lane in range(32)]
            for jj in range(nt)]


def _product(a, xv_tile):
    """The product mma of one sub-block and token tile: the two code fragments times the activations' B fragments."""
    c = np.zeros((16, 8))
    for e in range(2):
        b = place((16, 8), None, b16_coords,
                  [[bf16_halves(xv_tile[lane][2 * e]), bf16_halves(xv_tile[lane][2 * e + 1])] for lane in range(32)])
        c += a[e] @ b
    return c


def _unit_q45(fmt, buf, xb, tile, u, rb, qb, nt, m):
    np_ = (nt + 1) // 2
    lanes = _lane_rows(fmt, buf, tile, u, rb, qb)

    cs = [np.zeros((16, 8)) for _ in range(nt)]
    sums = [np.zeros((16, 8)) for _ in range(np_)]
    for j in range(8):
        xv = _x_words(xb, m, u, j, nt)
        a = _code_frags(fmt, lanes, j, 0)
        scale = np.array([[np.float32(lanes[lane][h]["d"][0]) * np.float32(byte_as_f32(lanes[lane][h]["sc"][j // 4], j % 4))
                           for h in range(2)] for lane in range(32)])     # __fmul_rn(d, sc): exact
        for jj in range(nt):
            c = _product(a, xv[jj])
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i, (r, col) in enumerate(c_coords(g, t)):
                    cs[jj][r, col] += scale[lane][i >> 1] * c[r, col]
        for p in range(np_):
            for e in range(2):
                regs = []
                for lane in range(32):
                    lo = xv[2 * p][lane]
                    hi = xv[2 * p + 1][lane] if 2 * p + 1 < nt else [0, 0, 0, 0]
                    regs.append([bf16_halves(w) for w in (lo[2 * e], hi[2 * e], lo[2 * e + 1], hi[2 * e + 1])])
                sel = [[(1.0, 1.0) if (lane >> 2) == j else (0.0, 0.0)] * 2 for lane in range(32)]
                sums[p] += place((16, 16), None, a16_coords, regs) @ place((16, 8), None, b16_coords, sel)
    acc = []
    amin = place((16, 8), None, a8_coords, [[lanes[lane][0]["amin"], lanes[lane][1]["amin"]] for lane in range(32)])
    for jj in range(nt):
        frag = [c_coords(lane >> 2, lane & 3) for lane in range(32)]
        s_lane = [(sums[jj >> 1][frag[lane][2 * (jj & 1)]], sums[jj >> 1][frag[lane][2 * (jj & 1) + 1]])
                  for lane in range(32)]
        parts = [split3(*s) for s in s_lane]
        mn = sum(amin @ place((8, 8), None, b8_coords, [[parts[lane][i]] for lane in range(32)]) for i in range(3))
        out = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i, (r, col) in enumerate(c_coords(g, t)):
                dmin = lanes[lane][i >> 1]["d"][1]
                out[r, col] = cs[jj][r, col] - dmin * mn[r, col]
        acc.append(out)
    return acc


def _unit_q45_lean(fmt, buf, xb, tile, u, rb, qb, nt, m):
    """kq_lean.j2: codes + 128 into the product mma; d·sc = fma(d, 128 + sc, −128·d); Σ x by one mma per sub-block
    and 8-token tile with lane (g, t)'s uint4 of activations as the A fragment and the one-hot column J as B, S_J =
    C[g][J] + C[g + 8][J]; then the mins' and the 128s' m16n8k8 mma over the three bf16 parts of S."""
    lanes = _lane_rows(fmt, buf, tile, u, rb, qb)

    def scale(lane, h, j):        # fma(d, fp32 128 + sc (byte j % 4 under 0x43), −128·d): d·sc exactly
        row = lanes[lane][h]
        f = f32(byte_perm(row["sc"][j // 4], 0x43, 0x4055 | ((j % 4) << 8)))
        return float(np.float32(row["d"][0] * f - 128.0 * row["d"][0]))

    cs = [np.zeros((16, 8)) for _ in range(nt)]
    sums = [np.zeros((16, 8)) for _ in range(nt)]
    for j in range(8):
        xv = _x_words(xb, m, u, j, nt)
        a = _code_frags(fmt, lanes, j, -128)
        sel = place((16, 8), None, b16_coords, [[(1.0, 1.0) if (lane >> 2) == j else (0.0, 0.0)] * 2
                                                 for lane in range(32)])
        for jj in range(nt):
            c = _product(a, xv[jj])
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i, (r, col) in enumerate(c_coords(g, t)):
                    cs[jj][r, col] += scale(lane, i >> 1, j) * c[r, col]
            xa = place((16, 16), None, a16_coords, [[bf16_halves(w) for w in xv[jj][lane]] for lane in range(32)])
            sums[jj] += xa @ sel
    acc = []
    amin = place((16, 8), None, a8_coords, [[lanes[lane][0]["amin"], lanes[lane][1]["amin"]] for lane in range(32)])
    ascl = place((16, 8), None, a8_coords, [[lanes[lane][0]["ascl"], lanes[lane][1]["ascl"]] for lane in range(32)])
    for jj in range(nt):
        frag = [c_coords(lane >> 2, lane & 3) for lane in range(32)]
        s_lane = [tuple(float(np.float32(sums[jj][frag[lane][i]]) + np.float32(sums[jj][frag[lane][i + 2]]))
                        for i in (0, 1)) for lane in range(32)]
        parts = [split3(*s) for s in s_lane]
        b8 = [place((8, 8), None, b8_coords, [[parts[lane][i]] for lane in range(32)]) for i in range(3)]
        mn, ms = sum(amin @ b for b in b8), sum(ascl @ b for b in b8)
        out = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i, (r, col) in enumerate(c_coords(g, t)):
                d, dmin = lanes[lane][i >> 1]["d"]
                out[r, col] = cs[jj][r, col] - dmin * mn[r, col] - 128.0 * d * ms[r, col]
        acc.append(out)
    return acc


def _unit_q6(fmt, buf, xb, tile, u, rb, qb, nt, m):
    units = rb // qb
    w = [[None, None] for _ in range(32)]
    sh = [0] * 32
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        off = block_offset(tile * 16 + g, u, units, qb)
        sh[lane] = (off & 2) * 8
        for h in range(2):
            blk = off + h * 8 * qb
            base = blk - (off & 2)
            words = [_u(buf, base + 16 * s + 4 * t) for s in range(13)]
            w13 = _u(buf, base + 208) if sh[lane] else 0
            d = float(np.frombuffer(buf[blk + 208:blk + 210], dtype=np.float16)[0])
            w[lane][h] = {"w": words, "w13": w13, "d": d}
    if any(sh):                                          # kq_realign, all lanes, segments in order
        for h in range(2):
            for s in range(13):
                send = [(w[l][h]["w"][s + 1] if s < 12 else w[l][h]["w13"]) if (l & 3) == 0 else w[l][h]["w"][s]
                        for l in range(32)]
                new = [funnelshift_r(w[l][h]["w"][s], send[(l & ~3) | ((l + 1) & 3)], sh[l]) for l in range(32)]
                for l in range(32):
                    w[l][h]["w"][s] = new[l]
    sc = [[[w[(l & ~3) | i][h]["w"][12] ^ 0x80808080 for i in range(4)] for h in range(2)] for l in range(32)]
    cs = [np.zeros((16, 8)) for _ in range(nt)]
    for J in range(16):
        n_, s, hh = J >> 3, (J >> 1) & 3, J & 1
        ql, qh = 4 * n_ + 2 * (s & 1) + hh, 8 + 2 * n_ + hh
        regs = []
        for lane in range(32):
            code = [and_or(w[lane][h]["w"][ql] >> (4 * (s >> 1)), 0x0F0F0F0F,
                           shift_r(w[lane][h]["w"][qh], 2 * s - 4) & 0x30303030) for h in range(2)]
            regs.append([kq_pair(code[0], 0x0100, 32), kq_pair(code[1], 0x0100, 32), kq_pair(code[0], 0x0302, 32),
                         kq_pair(code[1], 0x0302, 32)])
        a = place((16, 16), None, a16_coords, regs)
        for jj in range(nt):
            xw = [words_of(_xrow(xb, m, jj, lane >> 2), u * 256 + 16 * J + 4 * (lane & 3), 2) for lane in range(32)]
            c = a @ place((16, 8), None, b16_coords, [[bf16_halves(xw[l][0]), bf16_halves(xw[l][1])] for l in range(32)])
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i, (r, col) in enumerate(c_coords(g, t)):
                    scale = np.float32(w[lane][i >> 1]["d"]) * np.float32(biased_s8_as_f32(sc[lane][i >> 1][J >> 2], J & 3))
                    cs[jj][r, col] += float(scale) * c[r, col]
    acc = []
    for jj in range(nt):
        out = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i, (r, col) in enumerate(c_coords(g, t)):
                out[r, col] = cs[jj][r, col]
        acc.append(out)
    return acc
