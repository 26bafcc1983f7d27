"""cases_seq: Case builders for the stateful families (GDN conv, GDN step/record/fold, RoPE + KV
append, paged attention). Rows with a sentinel (slot −1, length 0) are included when B ≥ 2 and
excluded from comparisons of pure outputs; in-place state is compared whole."""
from __future__ import annotations

import torch

from compiler.kernels import attn_combine, attn_decode, attn_prefill, gdn_chunk, gdn_conv, gdn_step, qk_rope_kv
from lab.cases import Case, randn


def _slots(b, g):
    """Distinct slots in a pool of b + 2; the last row is a padded row (−1) when b ≥ 2."""
    slots = torch.randperm(b + 2, generator=g, device=g.device)[:b].to(torch.int32)
    if b >= 2:
        slots[-1] = -1
    return slots


def _commit(b, t, g):
    m = torch.randint(0, t + 1, (b,), generator=g, device=g.device, dtype=torch.int32)
    if b >= 2:
        m[0] = 0                                  # m = 0 must read and write nothing
    return m


def _gdn_conv(key: gdn_conv.Key, g) -> Case:
    b, t, c, hw = key.b, key.t, key.c, key.width - 1
    slots, dev = _slots(b, g), g.device
    hist = randn((b + 2, hw, c), g)
    hist0 = hist.clone()
    folds = key.mode in ("fold", "commit_record")
    prev, commit = (randn((b, t, c), g), _commit(b, t, g)) if folds else (None, None)
    if key.mode == "fold":
        args = [None, None, None, hist, slots, prev, commit, None]
        return Case([(key, args)], {}, {"hist": hist},
                    lambda: {"hist": gdn_conv.reference(key, hist0, slots, rec=prev, commit=commit)[1]},
                    {"hist": "exact"}, b * c * 2 * (2 * hw + t), 0)
    x, w = randn((b, t, c), g), randn((c, key.width), g, scale=0.5)
    y = torch.empty(b, t, c, device=dev, dtype=torch.bfloat16)
    rec = torch.empty(b, t, c, device=dev, dtype=torch.bfloat16) if key.mode != "update" else None
    outputs = {"y": y} | ({"rec": rec} if rec is not None else {})

    def ref():
        yr, hr = gdn_conv.reference(key, hist0, slots, x, w, commit=commit, prev_rec=prev)
        return {"y": yr, "hist": hr, "rec": x}
    return Case([(key, [y, x, w, hist, slots, rec, commit, prev])], outputs, {"hist": hist}, ref,
                {"y": "bf16", "rec": "exact", "hist": "exact"}, b * c * 2 * (2 * t + 2 * hw), 2 * b * t * c * key.width,
                {"y": slots >= 0, "rec": slots >= 0})


def gdn_inputs(key: gdn_step.Key, g) -> dict:
    """Step inputs at the scale MODEL.md recommends (A in [0.5, 4], dt_bias ≈ −2)."""
    b, t, dev = key.b, key.t, g.device
    qkv_dim = 2 * key.hk * key.dk + key.hv * key.dv
    return {"qkv": randn((b, t, qkv_dim), g), "a": randn((b, t, key.hv), g, torch.float32),
            "b": randn((b, t, key.hv), g, torch.float32),
            "a_log": torch.log(torch.rand(key.hv, generator=g, device=dev) * 3.5 + 0.5),
            "dt_bias": randn((key.hv,), g, torch.float32, 0.1) - 2.0,
            "state": randn((b + 2, key.hv, key.dk, key.dv), g, torch.float32, 0.1), "slots": _slots(b, g)}


def _records(key, g):
    b, t, dev = key.b, key.t, g.device
    return {"k": randn((b, t, key.hk, key.dk), g), "v": randn((b, t, key.hv, key.dv), g),
            "g": torch.stack([-torch.rand(b, t, key.hv, generator=g, device=dev),
                              torch.rand(b, t, key.hv, generator=g, device=dev)], -1)}


def _gdn_step(key: gdn_step.Key, g) -> Case:
    b, t, dev = key.b, key.t, g.device
    inp = gdn_inputs(key, g)
    s0, slots = inp["state"].clone(), inp["slots"]
    rec = {"k": torch.empty(b, t, key.hk, key.dk, device=dev, dtype=torch.bfloat16),
           "v": torch.empty(b, t, key.hv, key.dv, device=dev, dtype=torch.bfloat16),
           "g": torch.empty(b, t, key.hv, 2, device=dev)}
    folds = key.mode in ("fold", "commit_record")
    prev, commit = (_records(key, g), _commit(b, t, g)) if folds else ({}, None)
    if key.mode == "fold":
        rec = prev
    o = torch.empty(b, t, key.hv, key.dv, device=dev)
    args = [None if key.mode == "fold" else o, inp["qkv"], inp["a"], inp["b"], inp["a_log"], inp["dt_bias"],
            inp["state"], slots, rec["k"], rec["v"], rec["g"], commit,
            *([prev[n] for n in "kvg"] if key.mode == "commit_record" else [None] * 3), None]
    outputs = {} if key.mode == "fold" else {"o": o}
    if key.mode in ("record", "commit_record"):
        outputs |= {"rec_" + n: v for n, v in rec.items()}

    def ref():
        kw = {"rec": rec, "commit": commit} if key.mode == "fold" else \
            {n: inp[n] for n in ("qkv", "a", "b", "a_log", "dt_bias")} | {"commit": commit, "prev": prev}
        o_r, s_r, rec_r = gdn_step.reference(key, s0, slots, **kw)
        out = {"state": s_r} | ({"o": o_r} if o_r is not None else {})
        return out | ({"rec_" + n: v for n, v in rec_r.items()} if rec_r else {})
    state_bytes = b * key.hv * key.dk * key.dv * 4
    moved = state_bytes * (1 if key.mode == "record" else 2) + b * t * (inp["qkv"].shape[-1] * 2 + key.hv * key.dv * 4)
    return Case([(key, args)], outputs, {"state": inp["state"]}, ref,
                {"o": "f32", "state": "state", "rec_k": "exact", "rec_v": "exact", "rec_g": "f32"}, moved,
                6 * b * t * key.hv * key.dk * key.dv, {n: slots >= 0 for n in outputs})


def _gdn_chunk(key: gdn_chunk.Key, g) -> Case:
    """One sequence of t tokens (batch 1) from a random slot of a pool of 3, against gdn_step's reference."""
    inp = gdn_inputs(gdn_chunk.step_key(key), g)
    qkv, a, b = (inp[n][0] for n in ("qkv", "a", "b"))
    slots = inp["slots"][:1].contiguous()
    s0 = inp["state"].clone()
    o = torch.empty(key.t, key.hv, key.dv, device=g.device)
    args = [o, qkv, a, b, inp["a_log"], inp["dt_bias"], inp["state"], slots]

    def ref():
        o_r, s_r = gdn_chunk.reference(key, s0, slots, qkv, a, b, inp["a_log"], inp["dt_bias"])
        return {"o": o_r, "state": s_r}
    state_bytes = key.hv * key.dk * key.dv * 4
    moved = 2 * state_bytes + key.t * (qkv.shape[-1] * 2 + key.hv * key.dv * 4 + key.hv * 8)
    return Case([(key, args)], {"o": o}, {"state": inp["state"]}, ref, {"o": "f32", "state": "state"}, moved,
                6 * key.t * key.hv * key.dk * key.dv)


def _pages(n_pages, hkv, page, d, kv_dtype, g):
    shape = (n_pages, hkv, page, d)
    if kv_dtype == "bf16":
        return {"k": randn(shape, g), "v": randn(shape, g)}
    codes = lambda: torch.randint(-127, 128, shape, generator=g, device=g.device, dtype=torch.int8)  # noqa: E731
    scales = lambda: (torch.rand(*shape[:-1], d // 64, generator=g, device=g.device) * 0.02 + 1e-3).half()  # noqa: E731
    return {"k": codes(), "v": codes(), "k_scales": scales(), "v_scales": scales()}


def _table(b, max_pages, lens, page, g):
    """Block table over a shuffled pool holding exactly the pages the rows need (+1 spare)."""
    need = [-(-int(n) // page) for n in lens]
    pool = torch.randperm(sum(need) + 1, generator=g, device=g.device).to(torch.int32)
    table = torch.zeros(b, max_pages, dtype=torch.int32, device=g.device)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = pool[at:at + n]
        at += n
    return table, sum(need) + 1


def _max_len(key) -> int:
    """The longest sequence a case draws: 2,048 tokens keeps the cases quick, but never fewer than the
    key's own tokens (a prefill chunk), nor more than its pages hold."""
    return min(key.max_pages * key.page, max(2048, key.t))


def _lens(key, g, ctx):
    top = key.max_pages * key.page
    lens = torch.randint(key.t, _max_len(key) + 1, (key.b,), generator=g, device=g.device, dtype=torch.int32)
    if ctx is not None:
        lens.fill_(min(ctx, top))
    if key.b >= 2:
        lens[-1] = 0
    return lens


def _rope_kv(key: qk_rope_kv.Key, g, theta: float = 1e7, ctx: int | None = None) -> Case:
    b, t, rows, dev = key.b, key.t, key.b * key.t, g.device
    lens = torch.randint(t, _max_len(key) + 1, (b,), generator=g, device=dev)
    if ctx is not None:                       # every row's tokens end at ctx: positions ctx − t … ctx − 1
        lens.fill_(min(ctx, key.max_pages * key.page))
    table, n_pages = _table(b, key.max_pages, lens, key.page, g)
    pages = _pages(n_pages, key.hkv, key.page, key.d, key.kv_dtype, g)
    pages0 = {n: p.clone() for n, p in pages.items()}
    pos = (lens.view(-1, 1) - t + torch.arange(t, device=dev).view(1, -1)).reshape(-1).to(torch.int32)
    q, k, v = randn((rows, key.hq, 2 * key.d), g), randn((rows, key.hkv, key.d), g), randn((rows, key.hkv, key.d), g)
    qn, kn = randn((key.d,), g, scale=0.1), randn((key.d,), g, scale=0.1)
    freqs = qk_rope_kv.inv_freq(theta, key.rd).to(dev)
    q_out = torch.empty(rows, key.hq, key.d, device=dev, dtype=torch.bfloat16)
    args = [q_out, q, k, v, qn, kn, freqs, pos, table, pages["k"], pages["v"], pages.get("k_scales"),
            pages.get("v_scales")]

    def ref():
        qo, pr = qk_rope_kv.reference(key, q, k, v, qn, kn, freqs, pos, table, pages0)
        return {"q_out": qo} | {"pages_" + n: p for n, p in pr.items()}
    kv_bytes = rows * key.hkv * key.d * (2 if key.kv_dtype == "bf16" else 1 + 2 / 64) * 2
    return Case([(key, args)], {"q_out": q_out}, {"pages_" + n: p for n, p in pages.items()}, ref,
                {"q_out": "bf16", "pages_k": "kv", "pages_v": "kv", "pages_k_scales": "kv_scale",
                 "pages_v_scales": "kv_scale"}, int(q.numel() * 3 + k.numel() * 4 + kv_bytes), 0)


def _attn(key: attn_decode.Key, g, ctx: int | None = None) -> Case:
    b, t, dev = key.b, key.t, g.device
    lens = _lens(key, g, ctx)
    table, n_pages = _table(b, key.max_pages, lens, key.page, g)
    pages = _pages(n_pages, key.hkv, key.page, key.d, key.kv_dtype, g)
    q, gate = randn((b, t, key.hq, key.d), g), randn((b * t, key.hq, 2 * key.d), g)
    out = torch.empty(b, t, key.hq, key.d, device=dev, dtype=torch.bfloat16)
    part_o = torch.empty(b * t, key.hq, key.splits, key.d, device=dev) if key.splits > 1 else None
    part_ml = torch.empty(b * t, key.hq, key.splits, 2, device=dev) if key.splits > 1 else None
    args = [out, part_o, part_ml, q, gate, pages["k"], pages["v"], pages.get("k_scales"), pages.get("v_scales"),
            table, lens]
    launches = [(key, args)]
    if key.splits > 1:
        launches.append((attn_combine.for_decode(key), [out, part_o, part_ml, gate, lens]))
    per_token = key.hkv * key.d * 2 * (2 if key.kv_dtype == "bf16" else 1 + 2 / 64)
    moved = int(lens.sum().item() * per_token + q.numel() * 2 * 3)
    valid = (lens > 0).view(-1, 1).expand(b, t)
    return Case(launches, {"out": out}, {}, lambda: {"out": attn_decode.reference(key, q, gate, pages, table, lens)},
                {"out": "bf16"}, moved, int(4 * key.hq * key.d * lens.sum().item() * t), {"out": valid})


def _attn_prefill(key: attn_prefill.Key, g, ctx: int | None = None) -> Case:
    dev, top = g.device, key.max_pages * key.page
    n = ctx or int(torch.randint(key.t, min(top, key.t + 1024) + 1, (1,), generator=g, device=dev))
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    table, n_pages = _table(1, key.max_pages, lens, key.page, g)
    pages = _pages(n_pages, key.hkv, key.page, key.d, key.kv_dtype, g)
    q, gate = randn((key.t, key.hq, key.d), g), randn((key.t, key.hq, 2 * key.d), g)
    out = torch.empty(key.t, key.hq, key.d, device=dev, dtype=torch.bfloat16)
    args = [out, q, gate, pages["k"], pages["v"], pages.get("k_scales"), pages.get("v_scales"), table[0], lens]
    per_token = key.hkv * key.d * 2 * (2 if key.kv_dtype == "bf16" else 1 + 2 / 64)
    causal = key.t * (n - key.t) + key.t * (key.t + 1) // 2          # (query, key) pairs
    return Case([(key, args)], {"out": out}, {},
                lambda: {"out": attn_prefill.reference(key, q, gate, pages, table[0], lens)}, {"out": "bf16"},
                int(n * per_token + q.numel() * 2 * 3), 4 * key.hq * key.d * causal)


BUILDERS = {"gdn_conv": _gdn_conv, "gdn_step": _gdn_step, "gdn_chunk": _gdn_chunk, "qk_rope_kv": _rope_kv, "attn_decode": _attn,
            "attn_prefill": _attn_prefill}
