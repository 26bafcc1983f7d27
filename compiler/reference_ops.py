"""reference_ops: the torch reference of every primitive — the numerical oracle and the math the
small-model training differentiates through. Plain torch, CPU or GPU, fp32 or bf16 activations.

Effectful ops write state tensors in place through slot ids / block tables; passing `None` state
means a fresh sequence with nothing written (the training path). Rows with slot or position < 0 are
padding and are skipped.

These references are the oracle, and also the CPU backend: they move state through views and plain
copies (no gather of a whole state slot to read it, no scatter to write it back), keep per-call
constants (RoPE angles) and never change the arithmetic — the same torch operations on the same
shapes (tests/test_reference_speed.py holds them to the straightforward forms, to rounding: torch's threaded
matmul does not keep its bits across buffers). The helpers `valid_rows`, `read_slots`, `l2norm` and
`gdn_sequential` are public because the ReplaySSM references (`reference_replayssm`) share them.
"""
from __future__ import annotations

import weakref

from ._torch import F, torch


def bind_torch() -> None:
    """Use the real torch modules from here on (the interpreter calls this before it runs anything): the
    deferred stand-ins re-import on every attribute read, microseconds each, hundreds per decode step."""
    global torch, F
    import torch as real
    torch, F = real, real.nn.functional

_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i32": "int32", "i8": "int8"}


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of an IR dtype name (f32, bf16, f16, i32, i8)."""
    return getattr(torch, _DTYPE_NAMES[name])
GDN_CHUNK = 64
KV_GROUP = 64

_DERIVED: dict = {}


def _derived(w, tag, make):
    """make(w) for a weight, computed once per weight tensor and kept while it lives: a backend binds the same
    weight tensors on every call. Recomputed after an in-place write; never kept for a tensor that takes part in
    autograd (training)."""
    if w.requires_grad:
        return make(w)
    key = (id(w), tag)
    hit = _DERIVED.get(key)
    if hit is None or hit[0]() is not w or hit[1] != w._version:
        hit = (weakref.ref(w, lambda _, key=key: _DERIVED.pop(key, None)), w._version, make(w))
        _DERIVED[key] = hit
    return hit[2]


def embed(ids, table, *, dtype):
    return table[ids.long()].to(torch_dtype(dtype))


def linear(x, w):
    """x @ wᵀ (F.linear makes the same matmul call as `x @ w.t()`, without the Python-level transpose)."""
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


def rmsnorm(x, w, *, eps, offset):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _derived(w, ("norm", offset), lambda w: offset + w.float())).to(x.dtype)


def gated_rmsnorm(x, z, w, *, eps):
    """GDN output norm: plain RMS scale, weight multiplies directly, then × SiLU(z)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.to(x.dtype) * y * F.silu(z.float())).to(x.dtype)


def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def silu(x):
    return F.silu(x)


def sigmoid(x):
    return torch.sigmoid(x)


def reshape(x, *, shape):
    return x.reshape(shape)


def slice_(x, *, axis, start, stop):
    return x.narrow(axis, start, stop - start)


def concat(*xs, axis):
    return torch.cat(xs, dim=axis)


def transpose(x, *, perm):
    return x.permute(perm).contiguous()


def positions(pos, *, tokens):
    t = torch.arange(tokens, device=pos.device, dtype=torch.int32)
    return (pos.reshape(-1, 1).int() + t).reshape(-1)


_ROPE_ANGLES: dict = {}
_ROPE_KEPT = 64


def _rope_angles(pos, rotary_dim: int, theta: float, dtype, device):
    """(cos, sin) [N, 1, rotary_dim] of positions `pos` [N]; every RoPE of a step reads the same positions,
    so they are computed once per position list and kept (the last _ROPE_KEPT lists)."""
    key = (tuple(pos.tolist()), rotary_dim, theta, dtype, device)
    angles = _ROPE_ANGLES.get(key)
    if angles is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))
        freqs = pos.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        angles = emb.cos().to(dtype), emb.sin().to(dtype)
        if len(_ROPE_ANGLES) >= _ROPE_KEPT:
            _ROPE_ANGLES.clear()
        _ROPE_ANGLES[key] = angles
    return angles


def rope(x, pos, *, rotary_dim, theta):
    """NeoX rotate-half RoPE on the first `rotary_dim` dims of each head; the rest pass through."""
    cos, sin = _rope_angles(pos, rotary_dim, theta, x.dtype, x.device)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def valid_rows(ids) -> list[int]:
    """The rows whose slot or position is ≥ 0 (the others are padding)."""
    return [r for r, i in enumerate(ids.tolist()) if i >= 0]


def read_slots(state, slots):
    """state[slot of each row] for reading, padding rows reading slot 0: a view when the slots are
    consecutive (one row, or a cohort in slot order), else a gathered copy."""
    idx = [max(s, 0) for s in slots.tolist()]
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return state[idx[0]:idx[0] + len(idx)]
    return state[torch.tensor(idx, device=state.device)]


def _write_slots(state, slots, value) -> None:
    """state[slot of row r] ← value[r] for the valid rows."""
    for r, s in enumerate(slots.tolist()):
        if s >= 0:
            state[s].copy_(value[r])


def gdn_conv_output(c, w, hist):
    """(SiLU of the depthwise causal conv over [hist ++ c], the concatenated columns [B, C, K−1+T])."""
    B, T, C = c.shape
    K = w.shape[-1]
    full = torch.cat((hist, c.transpose(1, 2)), dim=-1)
    taps = _derived(w, ("taps", c.dtype), lambda w: w.to(c.dtype).reshape(C, K)[None, :, :, None].unbind(2))
    windows = full.unfold(2, T, 1).unbind(2)          # full[:, :, j:j + T] for j = 0..K-1
    acc = sum(taps[j] * windows[j] for j in range(K))  # tap order fixed: j = 0..K-1
    return F.silu(acc).transpose(1, 2).to(c.dtype), full


def gdn_conv(c, w, history, slots):
    """Depthwise causal conv over [history ++ c] then SiLU; history keeps the last K-1 pre-conv columns."""
    B, T, C = c.shape
    K = w.shape[-1]
    hist = c.new_zeros(B, C, K - 1) if history is None else read_slots(history, slots).to(c.dtype)
    out, full = gdn_conv_output(c, w, hist)
    if history is not None:
        _write_slots(history, slots, full[:, :, -(K - 1):].to(history.dtype))
    return out


def gdn_gates(a, b, a_log, dt_bias):
    beta = torch.sigmoid(b.float())
    g = _derived(a_log, "-exp", lambda a_log: -torch.exp(a_log.float())) * F.softplus(a.float() + dt_bias.float())
    return g, beta


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_recurrence(q, k, v, g, beta, state, slots):
    """Gated delta rule per value head h with q/k head h // (Hv/Hk); fp32; writes the final state."""
    B, T, hk, dk = q.shape
    hv = v.shape[2]
    grp = hv // hk
    qf = (l2norm(q.float()) / dk ** 0.5).repeat_interleave(grp, dim=2).transpose(1, 2)
    kf = l2norm(k.float()).repeat_interleave(grp, dim=2).transpose(1, 2)
    vf, gf, bf = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    if state is None:
        s0 = vf.new_zeros(B, hv, dk, v.shape[3])
    else:
        s0 = read_slots(state, slots)
    step = gdn_sequential if T <= 8 else _gdn_chunked
    out, s1 = step(qf, kf, vf, gf, bf, s0)
    if state is not None:
        _write_slots(state, slots, s1)
    return out.transpose(1, 2).to(v.dtype)


def gdn_sequential(q, k, v, g, beta, s):
    """The gated delta rule token by token: (outputs [B, H, T, dv], final state). `q` None: the state only
    (a fold), no outputs."""
    outs = []
    for t in range(k.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t, :, None]
        delta = (v[:, :, t] - (s * kt).sum(-2)) * beta[:, :, t, None]
        s = s + kt * delta[..., None, :]
        if q is not None:
            outs.append((s * q[:, :, t, :, None]).sum(-2))
    return (torch.stack(outs, dim=2) if q is not None else None), s


def _gdn_chunked(q, k, v, g, beta, s, C=GDN_CHUNK):
    """The same recurrence in chunks of C (WY/UT form): intra-chunk by a unit-triangular solve,
    inter-chunk through the state. Differentiable."""
    B, H, T, _ = k.shape
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C).cumsum(-1), beta.reshape(B, H, n, C)
    kb, vb = k * beta[..., None], v * beta[..., None]
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    lower = -(kb @ k.transpose(-1, -2) * decay) * strict
    inv = torch.linalg.solve_triangular(eye - lower, eye.expand_as(lower), upper=False, unitriangular=True)
    u, w = inv @ vb, inv @ (kb * g.exp()[..., None])
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    outs = []
    for i in range(n):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ s
        intra = (qi @ ki.transpose(-1, -2) * decay[:, :, i]) * causal
        outs.append((qi * gi.exp()[..., None]) @ s + intra @ v_new)
        tail = gi[..., -1, None]
        s = s * tail.exp()[..., None] + (ki * (tail - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2)[:, :, :T], s


def causal_attention(q, k, v, *, scale):
    grp = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (x.repeat_interleave(grp, dim=2).transpose(1, 2) for x in (k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return out.transpose(1, 2)


def quantize_kv(x):
    """INT8-G64 (MODEL.md §9): fp16 scale = max|x|/127 per 64 values, round-half-even codes."""
    grouped = x.float().reshape(*x.shape[:-1], -1, KV_GROUP)
    scale = (grouped.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = torch.round(grouped * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(x.shape), scale


def dequantize_kv(codes, scale):
    grouped = codes.float().reshape(*codes.shape[:-1], -1, KV_GROUP) * scale.float()[..., None]
    return grouped.reshape(codes.shape)


def _page_runs(pages: list[int], start: int, stop: int, page_size: int):
    """(page, first offset, end offset, first token index) of positions [start, stop) through `pages`."""
    p = start
    while p < stop:
        end = min(stop, (p // page_size + 1) * page_size)
        yield pages[p // page_size], p % page_size, end - (p // page_size) * page_size, p - start
        p = end


def kv_append(k, v, block_table, pos, *cache, page_size):
    """Write this chunk's K/V (after norm and RoPE) into the pages of each row; cache layout is
    [pages, 2 (k|v), kv_heads, page_size, head_dim] (codes) plus [.., head_dim/64] fp16 scales."""
    T = k.shape[1]
    tables, starts = block_table.tolist(), pos.tolist()
    for which, x in enumerate((k, v)):
        parts = quantize_kv(x) if len(cache) == 2 else (x.to(cache[0].dtype),)
        for b in valid_rows(pos):
            for page, lo, hi, t in _page_runs(tables[b], starts[b], starts[b] + T, page_size):
                for store, part in zip(cache, parts):
                    store[page, which, :, lo:hi] = part[b, t:t + hi - lo].transpose(0, 1)


def _read_kv(cache, pages: list[int], length: int, page_size: int, which: int):
    """K (which = 0) or V of positions [0, length) through `pages`: [length, kv_heads, head_dim] fp32."""
    def gather(store):
        return torch.cat([store[page, which, :, lo:hi].transpose(0, 1)
                          for page, lo, hi, _ in _page_runs(pages, 0, length, page_size)])
    if len(cache) == 2:
        return dequantize_kv(gather(cache[0]), gather(cache[1]))
    return gather(cache[0]).float()


def paged_attention(q, block_table, pos, *cache, page_size, scale):
    """Causal attention of T new queries per row over the row's cached positions [0, pos+T)."""
    B, T, hq, _ = q.shape
    out = torch.zeros_like(q)
    tables, starts = block_table.tolist(), pos.tolist()
    for b in valid_rows(pos):
        length = starts[b] + T
        k, v = (_read_kv(cache, tables[b], length, page_size, w).to(q.dtype) for w in (0, 1))
        grp = hq // k.shape[1]
        k, v = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[b].float(), k.float()) * scale
        if T > 1:       # query t sees positions ≤ pos + t; one query sees them all
            idx = torch.arange(length, device=q.device)
            qpos = starts[b] + torch.arange(T, device=q.device)
            scores = scores.masked_fill(idx[None, None, :] > qpos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("htl,lhd->thd", probs, v.float()).to(q.dtype)
    return out
