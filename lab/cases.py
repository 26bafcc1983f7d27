"""cases: fresh random inputs, argument lists, references and byte/FLOP counts for one kernel key.

Used by the GPU tests (correctness, poisoned outputs) and lab/kernel_lab.py (timing). Pure torch on
any device: no CUDA calls. A Case is a list of launches (key, args) — attention with splits adds its
combine — plus the tensors each launch writes and a lazy reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from compiler.reference_fused import norm_tile_sums
from compiler.kernels import argmax, concat, embed, gated_rmsnorm, gemv, rmsnorm, xperm
from compiler.kernels.weight_layout import device_bytes, pack_for_device, pack_kquant_for_device, random_qmatrix
from compiler.kquant import KFORMATS, random_kquant


def random_matrix(fmt: str, n: int, k: int, g: torch.Generator):
    """Random weights of any matmul format (a k-quant's blocks, or codes and scales) and their device planes
    with the fused gate/up row order when `gate_up`: (logical matrix, packer)."""
    if fmt in KFORMATS:
        return random_kquant(fmt, n, k, g), pack_kquant_for_device
    return random_qmatrix(fmt, n, k, g), pack_for_device


@dataclass(frozen=True)
class Tol:
    """|actual − expected| ≤ atol·max(1, rms(expected)) + rtol·|expected| elementwise."""
    atol: float
    rtol: float


TOLERANCES = {
    "bf16": Tol(8e-3, 1.6e-2),      # one bf16 ulp is 2^-8 relative; accumulation order adds a little
    "f32": Tol(1e-4, 2e-3),         # fp32 accumulation in a different order (K up to 17408), rsqrtf/expf
    "state": Tol(1e-4, 1e-3),       # GDN fp32 state after up to a prefill chunk of updates
    "exact": Tol(0.0, 0.0),         # integer outputs and copies
    "kv": Tol(0.0, 0.0),            # int8 KV codes: compared dequantised, see compare()
    "kv_scale": Tol(0.0, 2e-3),     # fp16 scale of a group whose amax moved by an ulp
}


@dataclass
class Case:
    launches: list                           # [(key, args)] in order
    outputs: dict[str, torch.Tensor]         # pure outputs: poisoned (NaN / −1) before each run
    inplace: dict[str, torch.Tensor]         # tensors updated in place (compared whole)
    reference: Callable[[], dict]            # name → expected tensor (same shape as the output)
    tol: dict[str, str]                      # name → TOLERANCES key
    bytes: int = 0                           # bytes the launches must move (kernel lab)
    flops: int = 0
    row_mask: dict[str, torch.Tensor] = field(default_factory=dict)   # name → bool rows to compare

    def poison(self) -> None:
        for t in self.outputs.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)


def randn(shape, g, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(shape, generator=g, device=g.device) * scale).to(dtype)


def _gemv(key: gemv.Key, g) -> Case:
    dev = g.device
    w, pack = random_matrix(key.fmt, key.n, key.k, g)
    bias = randn((key.n,), g) if key.epilogue in gemv.BIAS_EPILOGUES else None     # the vision tower's GEMMs
    packed = pack(w, gate_up=key.epilogue == "silu_mul") if bias is None else pack(w, pad_k=True)
    x = randn((key.m, key.k), g)
    res = randn((key.m, key.n), g) if key.epilogue in ("residual", "bias_residual") else None
    n_out = key.n // 2 if key.epilogue == "silu_mul" else key.n
    y = torch.empty(key.m, n_out, device=dev, dtype=torch.float32 if key.out_dtype == "f32" else torch.bfloat16)
    nz = lambda t: t if t.numel() else None                               # noqa: E731
    args = [y, x, packed["lo"], nz(packed["hi"]), nz(packed["scales"]), res] + ([bias] if bias is not None else [])
    inplace, expect, launches = {}, {}, []
    if key.family == "gemm_wg":                     # its activations as xperm leaves them, as lowered
        pkey = xperm.Key(key.m, key.k, key.arch)
        xp = torch.empty(key.k // 64, key.m, 64, device=dev, dtype=torch.bfloat16)
        launches.append((pkey, [xp, x]))
        args[1] = xp
    outputs, tols, extra = {"y": y}, {"y": key.out_dtype, "tickets": "exact"}, {}
    ssq_in = norm_w = conv_in = None
    row_mask = {}
    if key.family == "gemv":                        # split-K workspace; the tickets must come back zero
        ws, tickets = gemv_workspace(key, dev)
        args += [ws, tickets]
        if tickets is not None:
            inplace["tickets"], expect["tickets"] = tickets, torch.zeros_like(tickets)
        if key.norm_out:                            # the stream's normalised copy and tile sums of squares
            norm_w = randn((key.n,), g, scale=0.1)
            outputs["xn"] = torch.empty(key.m, key.n, device=dev, dtype=torch.bfloat16)
            outputs["ssq_out"] = torch.empty(key.m, key.n // 16, device=dev, dtype=torch.float32)
            args += [outputs["xn"], outputs["ssq_out"], norm_w]
            tols |= {"xn": "bf16", "ssq_out": "bf16"}   # from h as rounded to bf16 (an ulp apart at most)
        if key.scale_in:                            # x stands for xn; ssq_in for the producer's tile sums
            ssq_in = norm_tile_sums(randn((key.m, key.k), g))
            args.append(ssq_in)
            extra["ssq"] = ssq_in.numel() * 4
        if key.conv:                                # one-token GDN conv in the epilogue: taps, history, slots
            conv_w = randn((key.n, key.conv), g, scale=0.5)
            hist = randn((key.m + 2, key.conv - 1, key.n), g)
            slots = torch.randperm(key.m + 2, generator=g, device=dev)[:key.m].to(torch.int32)
            if key.m >= 2:
                slots[-1] = -1                      # a padded row: its output and history stay untouched
            conv_in = (conv_w, hist.clone(), slots)
            args += [conv_w, hist, slots]
            inplace["hist"], tols["hist"] = hist, "bf16"
            row_mask["y"] = slots >= 0
            extra["conv"] = conv_w.numel() * 2 + 2 * key.m * (key.conv - 1) * key.n * 2
    moved = device_bytes(key.fmt, key.n, key.k) + x.numel() * 2 + y.numel() * y.element_size() + \
        (res.numel() * 2 if res is not None else 0) + sum(t.numel() * t.element_size() for n, t in outputs.items()
                                                          if n != "y") + sum(extra.values())

    def ref():
        yr = gemv.reference(key, x, w, res, ssq_in, bias=bias)
        if conv_in is not None:
            yr, new_hist = gemv.conv_reference(key, yr, *conv_in)
            expect["hist"] = new_hist
        return {"y": yr, **expect, **(gemv.norm_outputs(key, yr, norm_w) if norm_w is not None else {})}
    return Case(launches + [(key, args)], outputs, inplace, ref, tols, moved, 2 * key.m * key.n * key.k, row_mask)


def _xperm(key: xperm.Key, g) -> Case:
    x = randn((key.m, key.k), g)
    xp = torch.empty(key.k // 64, key.m, 64, device=g.device, dtype=torch.bfloat16)
    return Case([(key, [xp, x])], {"xp": xp}, {}, lambda: {"xp": xperm.reference(key, x)}, {"xp": "exact"},
                4 * key.m * key.k, 0)


def gemv_workspace(key: gemv.Key, device) -> tuple:
    """(ws, tickets) for a gemv launch: an f32 buffer and zeroed int32 counters, or (None, None)."""
    sizes = gemv.workspace(key)
    if not sizes:
        return None, None
    return (torch.empty(sizes["ws"] // 4, device=device, dtype=torch.float32),
            torch.zeros(sizes["tickets"] // 4, device=device, dtype=torch.int32))


def _rmsnorm(key: rmsnorm.Key, g) -> Case:
    x, w = randn((key.m, key.h), g), randn((key.h,), g, scale=0.1)
    delta = randn((key.m, key.h), g) if key.add else None
    x0 = x.clone()
    y = torch.empty(key.m, key.h, device=g.device, dtype=torch.float32 if key.out_dtype == "f32" else torch.bfloat16)

    def ref():
        yr, xr = rmsnorm.reference(key, x0, w, delta)
        return {"y": yr, "x": xr}
    moved = key.m * key.h * (2 + y.element_size() + (6 if key.add else 0)) + key.h * 2
    return Case([(key, [y, x, delta, w])], {"y": y}, {"x": x} if key.add else {}, ref,
                {"y": key.out_dtype, "x": "exact"}, moved, 4 * key.m * key.h)


def _gated(key: gated_rmsnorm.Key, g) -> Case:
    o = randn((key.m, key.hv, key.dv), g, torch.float32)
    z, w = randn((key.m, key.hv * key.dv), g), randn((key.dv,), g)
    y = torch.empty(key.m, key.hv * key.dv, device=g.device, dtype=torch.bfloat16)
    return Case([(key, [y, o, z, w])], {"y": y}, {}, lambda: {"y": gated_rmsnorm.reference(key, o, z, w)},
                {"y": "bf16"}, o.numel() * 8, 8 * o.numel())


def _embed(key: embed.Key, g, vocab: int = 4096) -> Case:
    table, _ = random_matrix(key.fmt, vocab, key.h, g)
    ids = torch.randint(0, vocab, (key.m,), generator=g, device=g.device, dtype=torch.int32)
    y = torch.empty(key.m, key.h, device=g.device, dtype=torch.bfloat16)
    if key.fmt in KFORMATS:
        codes, scales, per_row = table.blocks, None, table.blocks.shape[1] + key.h * 2
    else:
        codes, scales = (table, None) if key.fmt == "bf16" else (table.codes, table.scales)
        per_row = key.h * (2 if key.fmt == "bf16" else 1) + (0 if key.fmt == "bf16" else key.h // 16) + key.h * 2
    return Case([(key, [y, ids, codes, scales])], {"y": y}, {}, lambda: {"y": embed.reference(key, ids, table)},
                {"y": "exact"}, key.m * per_row, 0)


def _argmax(key: argmax.Key, g) -> Case:
    logits = randn((key.m, key.v), g, torch.float32)
    top = logits.max().item() + 1.0
    for r in range(key.m):                        # plant a tie: the lower index must win
        a, b = sorted(torch.randint(0, key.v, (2,), generator=g, device=g.device).tolist())
        logits[r, a] = logits[r, b if a != b else min(b + 1, key.v - 1)] = top + r
    out = torch.empty(key.m, device=g.device, dtype=torch.int32)
    partial = torch.empty(key.m, argmax.slices(key), 2, device=g.device)
    counters = torch.zeros(key.m, device=g.device, dtype=torch.int32)
    return Case([(key, [out, logits, partial, counters])], {"out": out}, {"counters": counters},
                lambda: {"out": argmax.reference(key, logits), "counters": torch.zeros_like(counters)},
                {"out": "exact", "counters": "exact"}, logits.numel() * 4, logits.numel())


def _concat(key: concat.Key, g) -> Case:
    a, b = randn((key.m, key.k1), g), randn((key.m, key.k2), g)
    y = torch.empty(key.m, key.k1 + key.k2, device=g.device, dtype=torch.bfloat16)
    return Case([(key, [y, a, b])], {"y": y}, {}, lambda: {"y": concat.reference(key, a, b)}, {"y": "exact"},
                4 * y.numel(), 0)


BUILDERS = {"gemv": _gemv, "gemm": _gemv, "gemm_wg": _gemv, "xperm": _xperm, "rmsnorm": _rmsnorm, "gated_rmsnorm": _gated,
            "embed": _embed, "argmax": _argmax, "concat": _concat}


def make_case(key, device="cuda", seed: int = 0, **options) -> Case:
    """Random inputs for `key` on `device`; options go to the family builder (e.g. ctx for attention)."""
    from lab import cases_seq, cases_vision
    g = torch.Generator(device=device).manual_seed(seed)
    builder = BUILDERS.get(key.family) or cases_seq.BUILDERS.get(key.family) or cases_vision.BUILDERS[key.family]
    return builder(key, g, **options)


def case_keys(spec, target, cohorts=(1, 2, 4, 8), draft: int = 3) -> list:
    """The keys the tests and the kernel lab exercise for a spec: every key of the runtime profile's step
    plans and of its prefill chunk's plan, with the shipped options and with the decode folds off (the
    A/B variant: plain norms, the conv kernel, unscaled GEMVs), one row's MTP step, plus the variants the
    speculative round will launch — GDN conv and step in record / fold / commit_record modes at the
    verify shapes, the on-device argmax, the norm that adds in place. A test list, never a build list:
    `ninfer-gen build` compiles the plans' keys only."""
    from compiler.buckets import plan_bucket, profile_of
    from compiler.kernels import gdn_conv, gdn_step
    from compiler.options import CompileOptions

    keys = []
    for options in (CompileOptions(), CompileOptions(norm_fold=False, conv_fold=False)):
        profile = profile_of(spec, cohorts=cohorts, draft=draft, options=options)
        shapes = [s for s in profile.shapes() if s[0] == "step"] + [("prefill", 1, profile.prefill_chunk)]
        keys += [k for shape in shapes for k in plan_bucket(spec, target, *shape, profile).keys()]
    if spec.model.mtp.num_layers:
        keys += plan_bucket(spec, target, "mtp", 1, 1, profile_of(spec, cohorts=cohorts, draft=draft)).keys()
    a, g, arch = spec.model, spec.model.linear_attention, target.arch
    for _, b, t in (s for s in shapes if s[0] == "step" and s[2] > 1):
        for mode in ("record", "fold", "commit_record"):
            keys += [gdn_conv.Key(g.conv_dim, b, t, g.conv_kernel, mode, arch),
                     gdn_step.make_key(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, b, t,
                                       mode, target)]
    for m in sorted({b * t for e, b, t in shapes if e == "step"}):
        keys += [argmax.Key(a.vocab_size, m, arch), rmsnorm.Key(a.hidden_size, m, True, "bf16", a.rms_norm_eps, arch)]
    return list(dict.fromkeys(keys))
