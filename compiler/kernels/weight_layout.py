"""weight_layout: the device layout of quantised and bf16 matrices for the mma.sync skinny GEMM.

A matrix [N, K] is cut into tiles of 16 rows and units of G columns (G = the format's group: 64, or
32 for W8G32; bf16 uses 64). Per (tile, unit) each lane (g = lane>>2, t = lane&3) of a warp holds
exactly the A fragments of G/16 `mma.m16n8k16` steps, so one 16-byte load per lane per unit feeds
the tensor cores with no shuffles. Inside a unit, the mma's k slot c of step s maps to column
(G/4)·t' + 4s + 2·(c≥8) + (c&1) with t' = (c&7)>>1: every lane's activations are then G/4 contiguous
values (one or two 16-byte loads). Codes are stored biased (u = code + 2^(bits-1)) so the kernel turns
them into exact bf16 integers with the `0x4300 | u` (= 128 + u) trick.

Planes (all little-endian bytes; `lo` is [tiles, units, V, 32 lanes, 16 B], V = 4 for bf16 else 1):
  q4g64  lo: word s = nibbles of step s; element e at bit 4·(e>>1) + 16·(e&1)
  q5g64  whole 5-bit codes, so a register is one shift + one LOP3 (no separate hi bit to place):
         lo word s holds elements 2P, 2P+1 (P = 0, 1, 2) at bits 5P and 16 + 5P; hi (one u32 per lane
         per unit) holds elements 6, 7 of steps 0-2 at 5s and 16 + 5s. Elements 6, 7 of step 3 are
         spread over the spare bits 15 / 31 of the five words: bit i of the code in word i (i = 4: hi)
  q6g64  lo as q4 (u & 15); hi: two u32 per lane per unit, (u>>4)&3 in word s>>1 at
         8·(s&1) + 2·(e>>1) + 16·(e&1)
  w8g32  lo: words 2s, 2s+1 hold elements 0-3, 4-7 of step s; element e%4 in byte (0, 2, 1, 3)[e%4]
  bf16   lo: uint4 s of the lane holds the four bf16x2 A registers of step s
  q4_k / q5_k / q6_k (GGUF k-quants, compiler.kquant): lo = the file's super-blocks, each byte for byte, in 16-row
         tile order: tile T's unit u (its 16 rows' blocks of columns 256u …) one contiguous run at (T·U + u)·16·QB
         (`pack_kquant_for_device`; no fragment order, no separate scales). A GEMV unit's weights are one
         128-byte-aligned run (Q4_K 2,304 B) instead of 16 pieces at the row stride: every sector read by one warp.
Scales: [tiles, units, 8, 2] fp16 = (row g, row g+8) per lane group. `gate_up=True` interleaves a
fused [gate; up] weight so each tile holds 8 gate rows then the same 8 up rows (SiLU·mul epilogue).
"""
from __future__ import annotations

from .._torch import torch

from ..quant import QTensor
from ..quant import dequantize as _dequantize_q

FORMATS = {  # fmt: (bits, group)
    "q4g64": (4, 64), "q5g64": (5, 64), "q6g64": (6, 64), "w8g32": (8, 32), "bf16": (16, 64)}
QMAX = {"q4g64": 7, "q5g64": 15, "q6g64": 31, "w8g32": 127}
TILE = 16


def group_of(fmt: str) -> int:
    return FORMATS[fmt][1]


def padded_rows(n: int) -> int:
    return -(-n // TILE) * TILE


def padded_k(fmt: str, k: int) -> int:
    """K rounded up to whole units of the format's group (the columns a packed matrix holds)."""
    return -(-k // group_of(fmt)) * group_of(fmt)


def _index_maps(group: int, device=None):
    """Row-in-tile and column-in-unit of value (lane, step, element): two int64 [32, S, 8] tensors."""
    steps = group // 16
    lane = torch.arange(32, device=device).view(32, 1, 1)
    s = torch.arange(steps, device=device).view(1, steps, 1)
    e = torch.arange(8, device=device).view(1, 1, 8)
    g, t = lane >> 2, lane & 3
    row = (g + 8 * ((e >> 1) & 1)).expand(32, steps, 8)
    col = (group // 4) * t + 4 * s + 2 * (e >> 2) + (e & 1)
    return row, col.expand(32, steps, 8)


def _gate_up_perm(n: int, device=None) -> torch.Tensor:
    half = n // 2
    if n % 16 or half % 8:
        raise ValueError(f"gate_up needs 2·F rows with F a multiple of 8, got {n}")
    q = torch.arange(half // 8, device=device).view(-1, 1)
    r = torch.arange(8, device=device).view(1, -1)
    return torch.cat([8 * q + r, half + 8 * q + r], dim=1).reshape(-1)


def _gather_units(mat: torch.Tensor, group: int) -> torch.Tensor:
    """[N_pad, K] → [tiles, units, 32, S, 8] in fragment order."""
    n_pad, k = mat.shape
    row, col = _index_maps(group, mat.device)
    tiles = mat.view(n_pad // TILE, TILE, k // group, group).permute(0, 2, 1, 3)   # [T, U, 16, G]
    flat = tiles.reshape(n_pad // TILE, k // group, TILE * group)
    idx = (row * group + col).reshape(-1)
    return flat[:, :, idx].view(n_pad // TILE, k // group, 32, group // 16, 8)


def _scatter_units(frag: torch.Tensor, n_pad: int, k: int, group: int) -> torch.Tensor:
    row, col = _index_maps(group, frag.device)
    flat = torch.empty(n_pad // TILE, k // group, TILE * group, dtype=frag.dtype, device=frag.device)
    flat[:, :, (row * group + col).reshape(-1)] = frag.reshape(n_pad // TILE, k // group, -1)
    return flat.view(n_pad // TILE, k // group, TILE, group).permute(0, 2, 1, 3).reshape(n_pad, k)


def _empty(device, dtype):
    return torch.zeros(0, dtype=dtype, device=device)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor of u32 words → uint8 little-endian bytes (last dim × 4)."""
    shifts = torch.tensor([0, 8, 16, 24], device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).flatten(-2)


def _bytes_to_words(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int64).view(*b.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _consts(device):
    """Element index e, the lo-plane nibble shift of e, and the w8 byte shift of e."""
    e = torch.arange(8, device=device)
    w8 = 8 * torch.tensor([0, 2, 1, 3, 0, 2, 1, 3], device=device)
    return e, 4 * (e >> 1) + 16 * (e & 1), w8


def _pack_quant(u: torch.Tensor, fmt: str) -> dict:
    """u: biased codes [T, U, 32, S, 8] int64 → planes."""
    _E, _NIB_SHIFT, _W8_SHIFT = _consts(u.device)
    if fmt == "w8g32":
        words = (u << _W8_SHIFT).view(*u.shape[:-1], 2, 4).sum(-1)           # [T, U, 32, S, 2]
        return {"lo": _words_to_bytes(words.flatten(-2)).unsqueeze(2), "hi": _empty(u.device, torch.uint8)}
    if fmt == "q5g64":
        return _pack_q5(u)
    lo = ((u & 15) << _NIB_SHIFT).sum(-1)                                    # [T, U, 32, S]
    out = {"lo": _words_to_bytes(lo).unsqueeze(2)}
    s = torch.arange(u.shape[3], device=u.device).view(-1, 1)
    if fmt == "q6g64":
        pos = 8 * (s & 1) + 2 * (_E >> 1) + 16 * (_E & 1)
        bits = ((u >> 4) & 3) << pos                                          # [T, U, 32, 4, 8]
        hi = bits.view(*u.shape[:3], 2, 2, 8).sum((-1, -2))                   # word = s >> 1
        out["hi"] = _words_to_bytes(hi)
    else:
        out["hi"] = _empty(u.device, torch.uint8)
    return out


# q5g64 field positions: element e = 2P + h of step s (P < 3) in lo word s at 5P + 16h; element 6 + h of
# step s < 3 in the hi word at 5s + 16h; element 6 + h of step 3: bit i in word i (0-3: lo, 4: hi) at 15 + 16h.
_Q5_FIELD = [5 * p + 16 * h for p in range(3) for h in range(2)]            # elements 0-5 of a lo word


def _pack_q5(u: torch.Tensor) -> dict:
    """u: biased 5-bit codes [T, U, 32, 4, 8] → {"lo": 4 words per lane, "hi": 1 word per lane}."""
    shifts = torch.tensor(_Q5_FIELD, device=u.device)
    lo = (u[..., :6] << shifts).sum(-1)                                     # [T, U, 32, 4]
    hi = (u[..., :3, 6] << (5 * torch.arange(3, device=u.device))).sum(-1) \
        + (u[..., :3, 7] << (16 + 5 * torch.arange(3, device=u.device))).sum(-1)
    words = torch.cat([lo, hi.unsqueeze(-1)], -1)                          # [T, U, 32, 5]
    bit = torch.arange(5, device=u.device)
    words = words | (((u[..., 3:4, 6] >> bit) & 1) << 15) | (((u[..., 3:4, 7] >> bit) & 1) << 31)
    return {"lo": _words_to_bytes(words[..., :4]).unsqueeze(2), "hi": _words_to_bytes(words[..., 4:])}


def _unpack_q5(lo_words: torch.Tensor, hi_word: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_q5`: lo words [T, U, 32, 4], hi word [T, U, 32, 1] → codes [T, U, 32, 4, 8]."""
    words = torch.cat([lo_words, hi_word], -1)                             # [T, U, 32, 5]
    u = torch.empty(*lo_words.shape, 8, dtype=torch.int64, device=lo_words.device)
    u[..., :6] = (lo_words.unsqueeze(-1) >> torch.tensor(_Q5_FIELD, device=u.device)) & 31
    for s in range(3):
        u[..., s, 6] = (hi_word[..., 0] >> (5 * s)) & 31
        u[..., s, 7] = (hi_word[..., 0] >> (16 + 5 * s)) & 31
    bit = torch.arange(5, device=u.device)
    u[..., 3, 6] = (((words >> 15) & 1) << bit).sum(-1)
    u[..., 3, 7] = (((words >> 31) & 1) << bit).sum(-1)
    return u


def _unpack_quant(lo: torch.Tensor, hi: torch.Tensor, fmt: str, shape) -> torch.Tensor:
    _E, _NIB_SHIFT, _W8_SHIFT = _consts(lo.device)
    words = _bytes_to_words(lo.squeeze(2))                                    # [T, U, 32, 4]
    if fmt == "w8g32":
        w = words.view(*shape[:4], 2, 1)
        return ((w >> _W8_SHIFT.view(2, 4)) & 0xFF).view(shape)
    if fmt == "q5g64":
        return _unpack_q5(words, _bytes_to_words(hi).view(*shape[:3], 1))
    u = (words.unsqueeze(-1) >> _NIB_SHIFT) & 15                              # [T, U, 32, S, 8]
    s = torch.arange(shape[3], device=lo.device).view(-1, 1)
    if fmt == "q6g64":
        h = _bytes_to_words(hi).view(*shape[:3], 2, 1, 1).expand(*shape[:3], 2, 2, 1).reshape(*shape[:3], 4, 1)
        u = u | (((h >> (8 * (s & 1) + 2 * (_E >> 1) + 16 * (_E & 1))) & 3) << 4)
    return u


def _pack_rows(rows: torch.Tensor, fmt: str) -> dict:
    """Padded rows (bf16 bits or biased codes, a multiple of 16) → planes, in int64 temporaries."""
    group = group_of(fmt)
    frag = _gather_units(rows.to(torch.int64), group)
    if fmt == "bf16":
        words = frag[..., 0::2] | (frag[..., 1::2] << 16)                    # [T, U, 32, S, 4]
        return {"lo": _words_to_bytes(words).permute(0, 1, 3, 2, 4).contiguous().flatten()}   # [T, U, S, 32, 16]
    planes = _pack_quant(frag, fmt)
    return {"lo": planes["lo"].flatten(), "hi": planes["hi"].flatten()}


def pack_for_device(w, gate_up: bool = False, chunk_rows: int = 4096, pad_k: bool = False) -> dict[str, torch.Tensor]:
    """QTensor-like (fmt, codes, scales) or a bf16 [N, K] tensor → {"lo", "hi", "scales"}, on w's device.

    Unused planes are empty tensors. Rows are zero-padded to a multiple of 16 (`padded_rows`). Work goes
    in chunks of `chunk_rows` rows (planes are tile-major, so chunks concatenate), which bounds the int64
    temporaries to ~chunk_rows·K·40 bytes: the 248320-row LM head packs on a 24 GB card. `pad_k` (bf16):
    K is zero-padded to whole units (`padded_k`), as the prefill GEMM reads a K tail (the vision tower).
    """
    fmt = "bf16" if isinstance(w, torch.Tensor) else w.fmt
    mat = w if isinstance(w, torch.Tensor) else w.codes
    if pad_k and fmt == "bf16" and mat.shape[1] % group_of(fmt):
        mat = torch.nn.functional.pad(mat, (0, padded_k(fmt, mat.shape[1]) - mat.shape[1]))
    n, k = mat.shape
    group = group_of(fmt)
    if k % group or chunk_rows % TILE:
        raise ValueError(f"{fmt}: K = {k} is not a multiple of {group} (or chunk_rows not of {TILE})")
    perm = _gate_up_perm(n, mat.device) if gate_up else None
    n_pad = padded_rows(n)
    if fmt == "bf16":
        rows = mat.to(torch.bfloat16).contiguous().view(torch.int16)
        pad_value, scales = 0, None
    else:
        bias = 1 << (FORMATS[fmt][0] - 1)
        rows, pad_value, scales = mat.to(torch.int16) + bias, bias, w.scales.to(torch.float16)
    if perm is not None:
        rows, scales = rows[perm], (scales[perm] if scales is not None else None)
    rows = torch.nn.functional.pad(rows, (0, 0, 0, n_pad - n), value=pad_value)
    if fmt == "bf16":
        rows = rows.to(torch.int32) & 0xFFFF                                  # raw bits, unsigned
    parts = [_pack_rows(rows[r0:r0 + chunk_rows], fmt) for r0 in range(0, n_pad, chunk_rows)]
    out = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    out.setdefault("hi", _empty(mat.device, torch.uint8))
    if scales is None:
        return out | {"scales": _empty(mat.device, torch.float16)}
    scales = torch.nn.functional.pad(scales, (0, 0, 0, n_pad - n))
    sc = scales.view(n_pad // TILE, 2, 8, k // group).permute(0, 3, 2, 1).contiguous()  # [T, U, g, 2]
    return out | {"scales": sc.flatten()}


def unpack_from_device(packed: dict, fmt: str, n: int, k: int, gate_up: bool = False):
    """Exact inverse of `pack_for_device`: a QTensor, or the bf16 tensor for fmt "bf16"."""
    group, n_pad = group_of(fmt), padded_rows(n)
    tiles, units, steps = n_pad // TILE, k // group, group // 16
    inv = torch.argsort(_gate_up_perm(n, packed["lo"].device)) if gate_up else None
    lo = packed["lo"].view(tiles, units, -1, 32, 16)
    if fmt == "bf16":
        words = _bytes_to_words(lo.permute(0, 1, 3, 2, 4))                   # [T, U, 32, S, 4]
        frag = torch.stack([words & 0xFFFF, words >> 16], -1).flatten(-2)
        mat = _scatter_units(frag, n_pad, k, group)[:n]
        mat = mat[inv] if inv is not None else mat
        return mat.to(torch.int16).view(torch.bfloat16)
    bits, _ = FORMATS[fmt]
    hi = packed["hi"].view(tiles, units, 32, -1)
    u = _unpack_quant(lo, hi, fmt, (tiles, units, 32, steps, 8))
    codes = (_scatter_units(u, n_pad, k, group) - (1 << (bits - 1)))[:n].to(torch.int8)
    sc = packed["scales"].view(tiles, units, 8, 2).permute(0, 3, 2, 1).reshape(n_pad, units)[:n]
    if inv is not None:
        codes, sc = codes[inv], sc[inv]
    return QTensor(fmt, codes.contiguous(), sc.contiguous())


def pack_kquant_for_device(w, gate_up: bool = False) -> dict[str, torch.Tensor]:
    """A k-quant matrix (compiler.kquant.KQTensor) → {"lo": its super-blocks, each byte for byte as stored, rows
    zero-padded to a multiple of 16 (zero blocks decode to 0) and, with `gate_up`, interleaved like every
    format's, then in 16-row tile order (`kquant_tile_order`); "hi"/"scales" empty}."""
    rows = w.blocks
    if gate_up:
        rows = rows[_gate_up_perm(rows.shape[0], rows.device)]
    pad = padded_rows(rows.shape[0]) - rows.shape[0]
    if pad:                                          # a copy of the whole matrix: only when rows must be added
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
    empty = _empty(rows.device, torch.uint8)
    lo = kquant_tile_order(rows.contiguous().flatten(), w.fmt, rows.shape[0], w.k)
    return {"lo": lo, "hi": empty, "scales": _empty(rows.device, torch.float16)}


def kquant_tile_order(lo: torch.Tensor, fmt: str, n_pad: int, k: int, inverse: bool = False) -> torch.Tensor:
    """A k-quant matrix's device bytes (rows of super-blocks, n_pad a multiple of 16) → the same blocks, each byte
    for byte, in 16-row tile order: tile T's super-block u of row r at ((T·U + u)·16 + r)·QB, so the 16 blocks a
    GEMV unit reads are one contiguous run (`inverse`: back to rows)."""
    from ..kquant import QK_K, get_kformat

    qb, units = get_kformat(fmt).block_bytes, k // QK_K
    if inverse:
        return lo.view(n_pad // TILE, units, TILE, qb).transpose(1, 2).contiguous().flatten()
    return lo.view(n_pad // TILE, TILE, units, qb).transpose(1, 2).contiguous().flatten()


def unpack_kquant_from_device(packed: dict, fmt: str, n: int, k: int, gate_up: bool = False):
    """Exact inverse of `pack_kquant_for_device`: the KQTensor."""
    from ..kquant import KQTensor, QK_K, get_kformat

    row_bytes = k // QK_K * get_kformat(fmt).block_bytes
    rows = kquant_tile_order(packed["lo"], fmt, padded_rows(n), k, inverse=True).view(padded_rows(n), row_bytes)[:n]
    if gate_up:
        rows = rows[torch.argsort(_gate_up_perm(n, rows.device))]
    return KQTensor(fmt, rows.contiguous(), k)


def dequantize(w) -> torch.Tensor:
    """fp32 [N, K] = scale × code (or the bf16 values, or a k-quant's blocks decoded), the GEMM reference's weight."""
    from ..kquant import KQTensor, dequantize as dequantize_kquant

    if isinstance(w, KQTensor):
        return dequantize_kquant(w)
    return w.float() if isinstance(w, torch.Tensor) else _dequantize_q(w)


def random_qmatrix(fmt: str, n: int, k: int, gen: torch.Generator | None = None, device=None):
    """Random codes over the full code range and positive scales: test and bench inputs."""
    device = device if device is not None else (gen.device if gen is not None else "cpu")
    if fmt == "bf16":
        return (torch.randn(n, k, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    bits, group = FORMATS[fmt]
    lo = -QMAX[fmt] if fmt == "w8g32" else -(1 << (bits - 1))
    codes = torch.randint(lo, QMAX[fmt] + 1, (n, k), generator=gen, dtype=torch.int8, device=device)
    scales = (torch.rand(n, k // group, generator=gen, device=device) * 0.02 + 0.001).to(torch.float16)
    return QTensor(fmt, codes, scales)


def device_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes one GEMM call streams from the packed planes (what the kernel lab counts)."""
    from ..kquant import KFORMATS, QK_K

    if fmt in KFORMATS:
        return padded_rows(n) * (k // QK_K) * KFORMATS[fmt].block_bytes
    bits, group = FORMATS[fmt]
    n_pad = padded_rows(n)
    scale_bytes = 0 if fmt == "bf16" else n_pad * (k // group) * 2
    return n_pad * k * bits // 8 + scale_bytes
