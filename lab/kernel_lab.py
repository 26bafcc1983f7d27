"""kernel_lab: per-family timings at the 27B shapes on the GPU, with bytes and FLOPs counted and the
fraction of a device-to-device copy measured in the same run (CUDA events, median of 50 after warm-up,
inputs rotated over copies bigger than L2), and per launch in a back-to-back chain (`time_chain`: how
kernels run in a decode step, overlapping under programmatic launch on sm_90+). Writes JSON to --out
and prints a short table last.

  python -m lab.kernel_lab --out lab.json [--only gemv,gdn_step] [--iters 50]   (from the repo root)
  python -m lab.kernel_lab --only buckets,verify --arch-path rtx3090   (the 3090's kernels, as PTX the driver JITs)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from compiler.kernels import Launch, ceil_div
from compiler.kernels import (argmax, attn_decode, attn_prefill, gdn_chunk, gdn_conv, gdn_step, gemm, gemm_wg, gemv,
                              qk_rope_kv, rmsnorm, xperm)
from compiler.buckets import plan_bucket
from compiler.spec import load_spec
from compiler.kernels.weight_layout import device_bytes
from compiler.targets import arch_path_target, lookup
from lab.cases import gemv_workspace, make_case, random_matrix
from ninfer_gen.cli.bench import copy_bandwidth
from ninfer_gen.executor.cuda_module import KernelCache
from ninfer_gen.cli.env import build_root

KERNELS = KernelCache(build_root(), jobs=os.cpu_count())
DEVICE = "cuda"
LAB_TEMPLATES = Path(__file__).resolve().parent / "templates"    # archived versions; codegen renders key.template_dir


def time_launches(runs, iters: int, warmup: int = 10) -> list[float]:
    """Microseconds per iteration; iteration i replays runs[i % len(runs)] (a list of launchers)."""
    for i in range(warmup):
        for launcher in runs[i % len(runs)]:
            launcher.launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(100_000_000)       # keeps the GPU busy while the host queues every launch: no launch gaps
    for i, (start, end) in enumerate(events):
        start.record()
        for launcher in runs[i % len(runs)]:
            launcher.launch()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in events]


def time_chain(runs, iters: int) -> float:
    """Microseconds per iteration when `iters` iterations run back to back between one pair of events:
    how a kernel runs inside a decode step, where (on sm_90+, targets.supports_pdl) each launch may
    overlap its predecessor's tail; `time_launches` puts an event between launches, which stops that."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000_000)
    start.record()
    for i in range(iters):
        for launcher in runs[i % len(runs)]:
            launcher.launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


@dataclass(frozen=True)
class GemvV1Key(gemv.Key):
    """The archived v1 gemv (lab/templates/gemv_v1.cu.j2: per-unit bounds checks, addresses recomputed per
    load), built beside the current template for same-run comparisons; the stream fields are unused."""
    template, template_dir = "gemv_v1.cu.j2", LAB_TEMPLATES

    def _name_parts(self):
        return super()._name_parts() + ["v1"]


V1 = "v1"          # a gemv_runs config: the archived v1 kernel of the shape
PLAIN = {"prefetch": 0, "interleave": False}        # the stream fields v1 had


def v1_of(key: gemv.Key) -> GemvV1Key:
    return GemvV1Key(**{**key.fields(), **PLAIN})


def gemv_runs(fmt, n, k, ms, epilogue, out, target, l2, configs=None, check_v1=False) -> list:
    """Thunks, one per M (or per (M, config) in `configs`: the sweep; a config is a dict of key
    fields to replace, e.g. {"warps": 8, "splits": 3}, or V1; configs that make no valid key are
    left out), sharing one packed weight set (rotated copies when smaller than 2×L2). Each thunk
    carries its `key` (built in parallel before timing). `check_v1`: each run also reports whether its
    output has the v1 kernel's bits on the same inputs."""
    shared = {}

    def weights():
        if not shared:
            g = torch.Generator(device=DEVICE).manual_seed(0)
            copies = max(1, min(64, -(-2 * l2 // device_bytes(fmt, n, k))))
            shared["w"] = [(lambda w, pack: pack(w, gate_up=epilogue == "silu_mul"))(*random_matrix(fmt, n, k, g))
                           for _ in range(copies)]
        return shared["w"]

    def make(m, cfg=None):
        key = gemv.make_key(fmt, n, k, m, target, epilogue, out)
        if cfg == V1:
            return v1_of(key)
        if callable(cfg):
            return cfg(key)
        return replace(key, **cfg) if cfg else key

    def one(key):
        m = key.m
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        res = torch.randn(m, n, device=DEVICE).bfloat16() if epilogue == "residual" else None
        n_out = n // 2 if epilogue == "silu_mul" else n
        dtype = torch.float32 if out == "f32" else torch.bfloat16
        nz = lambda t: t if t.numel() else None                           # noqa: E731

        def bound(kk):
            y = torch.full((m, n_out), float("nan"), device=DEVICE, dtype=dtype)
            ws, tickets = gemv_workspace(kk, DEVICE)       # one workspace serves every rotated copy
            return y, [[KERNELS.bind(kk, [y, x, w["lo"], nz(w["hi"]), nz(w["scales"]), res, ws, tickets])]
                       for w in weights()]
        y, runs = bound(key)
        moved = device_bytes(fmt, n, k) + x.numel() * 2 + y.numel() * y.element_size() + \
            (res.numel() * 2 if res is not None else 0)
        if not check_v1:
            return key, runs, moved, 2 * m * n * k
        y1, runs1 = bound(v1_of(key))
        runs[0][0].launch()
        runs1[0][0].launch()
        torch.cuda.synchronize()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        return key, runs, moved, 2 * m * n * k, {"bits_equal_v1": bool(torch.equal(y.view(bits), y1.view(bits)))}

    keys = []
    for m in ms:
        for cfg in configs or [None]:
            try:
                keys.append(make(m, cfg))
            except ValueError:
                pass
    thunks = []
    for key in dict.fromkeys(keys):
        thunk = lambda key=key: one(key)                                  # noqa: E731
        thunk.key = key
        thunks.append(thunk)
    return thunks


def case_runs(key, l2, **options):
    """A thunk: rotated copies of a random Case until the copies exceed 2×L2 (at most 32)."""
    def build():
        first = make_case(key, DEVICE, 0, **options)
        copies = max(1, min(32, -(-2 * l2 // max(first.bytes, 1))))
        cases = [first] + [make_case(key, DEVICE, i, **options) for i in range(1, copies)]
        return key, [[KERNELS.bind(k, a) for k, a in c.launches] for c in cases], first.bytes, first.flops
    build.key = key
    return build


# The other decode projections of the 27B spec (N = 5120 / 6144 / 12288 and the MTP's W8 down).
SMALL_GEMV = [("q5g64", 6144, 5120, "none"), ("q5g64", 5120, 6144, "residual"), ("q4g64", 12288, 5120, "none"),
              ("w8g32", 5120, 17408, "residual"), ("q4g64", 1024, 5120, "none")]


# How units stream in the current gemv (lab/kernel_lab_notes.md, v9): every variant gives v1's bits.
GEMV_VARIANTS = [V1, PLAIN, {**PLAIN, "prefetch": 1}, {**PLAIN, "prefetch": 2}, {**PLAIN, "prefetch": 4},
                 {**PLAIN, "interleave": True}, {**PLAIN, "interleave": True, "prefetch": 2}]


@dataclass(frozen=True)
class GemmV1Key(gemm.Key):
    """The archived v1 prefill GEMM (lab/templates/gemm_v1.cu.j2: 4 warps × 16 rows × 64 tokens, weights
    straight from global), built beside v2 for same-run comparisons. Its tiling fields are unused."""
    template, template_dir = "gemm_v1.cu.j2", LAB_TEMPLATES

    def _name_parts(self):
        return super()._name_parts()[:-1] + ["v1"]


def v1_key(key: gemm.Key) -> GemmV1Key:
    return GemmV1Key(key.fmt, key.n, key.k, key.m, key.epilogue, key.out_dtype, 2, 1, 4, 2, key.arch)


def gemm_v1_runs(key: gemm.Key, l2):
    """Like case_runs, for the v1 kernel of `key`'s shape (its own launch config)."""
    v1 = v1_key(key)
    cfg = Launch((ceil_div(key.m, 64), ceil_div(ceil_div(key.n, 16), 4), 1), (128, 1, 1), 0)

    def build():
        first = make_case(key, DEVICE, 0)
        copies = max(1, min(32, -(-2 * l2 // max(first.bytes, 1))))
        cases = [first] + [make_case(key, DEVICE, i) for i in range(1, copies)]
        kernel = KERNELS.get(v1)
        return v1, [[kernel.bind(gemm.params(v1), a, cfg) for _, a in c.launches] for c in cases], \
            first.bytes, first.flops
    build.key = v1
    return build


GEMM_SHAPES = (("q4g64", 34816, 5120, "silu_mul"), ("q5g64", 5120, 17408, "residual"), ("q4g64", 10240, 5120, "none"))


# (fmt, n, k, epilogue, out) of the 27B decode GEMVs that matter most
DECODE_GEMV = (("q4g64", 34816, 5120, "silu_mul", "bf16"), ("q4g64", 10240, 5120, "none", "bf16"),
               ("q4g64", 12288, 5120, "none", "bf16"), ("q5g64", 6144, 5120, "none", "bf16"),
               ("q5g64", 5120, 6144, "residual", "bf16"), ("q5g64", 5120, 17408, "residual", "bf16"),
               ("q4g64", 248320, 5120, "none", "f32"), ("w8g32", 248320, 5120, "none", "f32"))


# The GGUF k-quant decode GEMVs (issue 34; templates/gemv_kq.cu.j2) at the 27B shapes, each beside the
# group-64 format of the same bits; M = 1 … 32, and register caps (min_blocks) as variants.
KQUANT_GEMV = tuple((kq, g64, n, k, epi, out) for kq, g64 in (("q4_k", "q4g64"), ("q5_k", "q5g64"), ("q6_k", "q6g64"))
                    for n, k, epi, out in ((34816, 5120, "silu_mul", "bf16"), (10240, 5120, "none", "bf16"),
                                           (6144, 5120, "none", "bf16"), (5120, 6144, "residual", "bf16"),
                                           (5120, 17408, "residual", "bf16"), (1024, 5120, "none", "bf16"),
                                           (248320, 5120, "none", "f32")))


# Session 18: the k-quant M = 1 kernels held 168 (Q4_K) to 231 (Q6_K) registers on sm_90 against 80-96 for their
# group-64 twins; register caps (3, 4 blocks) and 8-warp blocks were measured (Q5_K/Q6_K ship 3 blocks at M <= 8;
# 8 warps lost everywhere). Then loads kept in L1 (an experiment, 57 → 58 % at Q4_K gate/up; removed in session 19:
# staging won) and weights staged in shared memory by 16-byte cp.async (`stage_w`).
# Session 19 shipped `code_bias` (Q4_K/Q5_K) and `stage_w` 2 at M ≤ 8 ({} below); session 18's keys are the second
# variant. Staged, the Q6_K down projection (5120 × 17408, 6 K splits: ~3 units per warp per block) reached only
# 57 % of copy against 76–88 % at the big one-split shapes: the per-block fixed cost (stage fill, split-K reduction)
# over few units. Next: fewer splits (a shape's choice, never per M: the summation order), a third stage, 4 blocks.
KQUANT_VARIANTS = [{}, {"code_bias": False, "kq_lean": False, "stage_w": 0}, {"stage_w": 0}, {"stage_w": 3},
                   {"min_blocks": 4}, {"splits": 2}, {"splits": 3}, {"splits": 4}, {"kq_lean": False}]
# `kqlean` (issue 34): the Q4_K/Q5_K unit math in fewer instructions (key `kq_lean`, common/kq_lean.j2: Σ x by one mma
# per sub-block, d·sc by one FFMA, no FFMA for token columns past M) beside code_bias alone, M = 1 … 8. SASS of the
# staged gate/up loop per unit (sm_90): Q4_K 474 → 319 at M = 1, 515 → 342 at M = 8; Q5_K 547 → 387, 587 → 409.
# Session 23 (H100): Q4_K gate/up 49.5 → 45.0 µs at M = 1, the GGUF step −7.4 %: shipped (the first variant).
# Session 25: more blocks an SM (5: one wave at 10,240 rows, shipped; else lost or tied), and a third stage: with
# kq_lean a unit's math is a third shorter, so one unit of prefetch covers a third less of the DRAM latency (the Q4_K
# staged loop waits for unit i with `DEPBAR.LE SB0, 0`, i.e. for everything in flight; stage_w 3 lost before kq_lean).
KQ_LEAN_VARIANTS = [{}, {"kq_lean": False}, {"min_blocks": 5}, {"stage_w": 3}]
# `q6lean` (issue 34, session 25): Q6_K's unit math in fewer instructions, the same bits (key `q6_lean`,
# common/kq_units.j2: staged rows of 16 chunks copied at one offset a unit, aligned words read without a shift, the
# PRMT constants in registers, d·sc by one FFMA, no FFMA past M). SASS per staged unit (sm_90, M = 1): down 779 → 566,
# gate/up 799 → 565; registers 168 → 108–111 (so 4 blocks an SM fit under the 3-block cap). Variants: shipped
# (q6_lean), without it, and the register caps of 4, 5 and 2 blocks.
Q6_LEAN_VARIANTS = [{}, {"q6_lean": False}, {"min_blocks": 4}, {"min_blocks": 5}, {"min_blocks": 2}]
# `kqsplits` (issue 34, session 26): the K splits of the GGUF step's k-quant projections that leave the GPU less than a
# wave of unsplit blocks or walk a long K (split_count's rule was measured on the group-64 kernels; a k-quant block
# fills its staging ring once, so few units a warp cost more): Q4_K / Q6_K down (5,120 × 17,408: 6 before, 3 since
# this group's result), the Q4_K output (5,120 × 6,144) and GDN input (6,144 × 5,120) projections (1), at M = 1.
# Invalid counts drop out.
KQ_SPLITS = (("q4_k", 5120, 17408, "residual"), ("q6_k", 5120, 17408, "residual"), ("q4_k", 5120, 6144, "residual"),
             ("q4_k", 6144, 5120, "none"))
# Next (after the split rule shipped): 8-warp blocks, unmeasured since session 18's kernels (they lost then at 168
# registers; Q4_K now compiles to 96 at 8 warps, 40 KB of stages a block: 5 blocks, 40 warps an SM on sm_90 — the
# output projection's 320 blocks are 2.4 an SM at 4 warps). Q6_K at 8 warps exceeds the staging limit and drops out.
KQ_SPLIT_VARIANTS = [{"splits": s} for s in (1, 2, 3, 4, 5, 6, 9)] + [{"warps": 8, "splits": s} for s in (1, 2, 3)]
# `streamk` (issue 34, session 27): grids of whole waves over the units flattened tile-major (key `stream_k` = G blocks:
# 3, 4, 5 an SM and two waves of 4) beside the session-26 splits, at the GGUF step's under-two-wave projections (M = 1):
# the Q6_K / Q4_K down projections (960 blocks at 3 splits: 1.8 waves of 4 an SM), the output and GDN-input
# projections (320 / 384 blocks: under a wave), the 10,240-row Q5_K. `b4`: under a 128-register cap (4 blocks an SM).
# Result (s27_streamk_lab_…, chained µs): Q6_K down 34.9 → 32.7 at one wave of four, Q4_K down 23.7 → 23.2 (shipped:
# gemv_config.stream_k_blocks); every unsplit shape lost.
STREAMK_SHAPES = (("q6_k", 5120, 17408, "residual"), ("q4_k", 5120, 17408, "residual"), ("q4_k", 5120, 6144, "residual"),
                  ("q4_k", 6144, 5120, "none"), ("q5_k", 10240, 5120, "none"))


def streamk_variants(sms: int) -> list:
    def sk(blocks_per_sm, cap):
        return lambda key: replace(key, splits=1, stream_k=blocks_per_sm * sms,
                                   min_blocks=max(key.min_blocks, 4) if cap else key.min_blocks)
    split3 = {"stream_k": 0, "splits": 3}       # the down projections' grid before stream-K (session 26)
    return [{}, split3] + [sk(b, cap) for b, cap in ((3, False), (4, False), (4, True), (5, True), (8, True))]


# `kqx` (issue 34, session 27, measured and removed): each unit's activations copied to shared memory in the weights'
# ring (a k-quant `stage_x`): the Q6_K down projection 34.8 → 36.0 µs chained, Q4_K gate/up 37.5 → 36.8, M = 4 worse,
# and the GGUF step 7.248 → 8.005 ms (lab/results/s27_kqx_lab_*, s27_x_gguf_*; lab/NOTES.md session 27).


def kquant_plan(target, l2, ms):
    """`kquant`: the k-quant GEMVs beside their group-64 twins; `kqlean`: the Q4_K/Q5_K ones, shipped and with
    `kq_lean`; `q6lean`: the Q6_K ones with and without `q6_lean` and under other register caps; `kqsplits`: the
    step's down / output / GDN-input projections at other K splits (session 26; `tileloop`, grids looping over row
    tiles, was measured and removed that session: lab/NOTES.md); `kquant_gemm`: a
    Q4_K_M-style 27B prefill chunk's GEMMs (gemm_kq.cu.j2) beside the same shapes in the
    27B's own formats."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_fixtures import q4_k_m_recipe

    for kq, g64, n, k, epi, out in KQUANT_GEMV:
        m_list = ms if n < 200000 else (1, 4)
        yield "kquant", gemv_runs(g64, n, k, m_list, epi, out, target, l2)
        yield "kquant", gemv_runs(kq, n, k, m_list, epi, out, target, l2, KQUANT_VARIANTS)
    for kq, g64, n, k, epi, out in KQUANT_GEMV:
        if kq != "q6_k":
            yield "kqlean", gemv_runs(kq, n, k, ms if n < 200000 else (1, 4), epi, out, target, l2, KQ_LEAN_VARIANTS)
        else:
            yield "q6lean", gemv_runs(kq, n, k, ms if n < 200000 else (1, 4), epi, out, target, l2, Q6_LEAN_VARIANTS)
    for kq, n, k, epi in KQ_SPLITS:
        yield "kqsplits", gemv_runs(kq, n, k, (1,), epi, "bf16", target, l2, KQ_SPLIT_VARIANTS)
    for kq, n, k, epi in STREAMK_SHAPES:
        yield "streamk", gemv_runs(kq, n, k, (1,), epi, "bf16", target, l2, streamk_variants(target.sms))
    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")
    chunk = spec.runtime.prefill_chunk
    keys = [k for s in (q4_k_m_recipe(spec), spec) for k in plan_bucket(s, target, "prefill", 1, chunk).keys()
            if k.family in ("gemm", "gemm_wg")]
    yield "kquant_gemm", [case_runs(k, l2) for k in dict.fromkeys(keys)]


def planned_runs(plan, l2, label: str, families=None, variant=None) -> list:
    """Thunks for the kernels of one plan (those of `families`, or all), each row carrying its launches in the plan
    (`in_plan`) and the plan's `label`: main prints Σ in_plan × µs per label beside the bytes those launches move.
    `variant(key)`: the key to time in a plan key's place (its launches counted as the plan's key's)."""
    from collections import Counter

    counts = Counter(c.key for c in plan.calls)
    items = []
    for key in plan.keys():
        if families and key.family not in families:
            continue
        timed = variant(key) if variant else key
        inner = case_runs(timed, l2)

        def build(inner=inner, n=counts[key]):
            return (*inner(), {"in_plan": n, "plan": label})
        build.key, build.in_plan, build.plan = timed, counts[key], label
        items.append(build)
    return items


def vision_plan(target, l2):
    """`vision`: every kernel of the 27B encoder's largest bucket (one image of 4,096 patches, what lab.vision_bench
    times), each row with its launches in that plan: Σ launches × µs is the encoder's kernel time, to set beside the
    bench's encoder time (session 18: 89.9 ms compiled against 42.1 ms for the torch tower)."""
    from compiler.buckets_vision import plan_vision, vision_buckets

    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")
    yield "vision", planned_runs(plan_vision(spec, target, vision_buckets(spec)[-1], 1), l2, "27B encoder, one image")


def step_buckets_plan(target, l2):
    """`buckets` (issue 32's C8 line): the decode GEMVs of the 27B's plain step at B = 1 and 8 and of its verify at
    B = 8, K = 3 (32 rows), each with its launches in that bucket: the 32-row GEMVs' time, fraction of copy and
    TFLOP/s against the 8-row step's — what a C8 round pays over a C8 step (session 17: 1.84 steps per round)."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")
    for batch, tokens in ((1, 1), (8, 1), (8, 4)):
        label = f"27B step B = {batch}, T = {tokens} ({batch * tokens} rows)"
        yield "buckets", planned_runs(plan_bucket(spec, target, "step", batch, tokens), l2, label, ("gemv",))


def gguf_step_plan(target, l2, variants=()):
    """`gguf_step` (issue 34, after session 27): the decode GEMVs of the plain step (B = 1) of the 27B GGUF that
    tools.synth_gguf writes (llama.cpp's Q4_K_M mix: half the down projections Q6_K, half Q4_K),
    each the step's own key (its folds: scale_in, norm_out, conv) timed chained in isolation with its launches in the
    step — beside the step's leave-one-out and `lab/step_timeline.py --weights` advances, what each group loses to
    its neighbours in the step (session 27: the Q4_K gate/up ~3.7 µs a call more in the step than chained).
    `variants`: NINFER_GEMV rule sets (`--gemv-variant`), each timing the plan's keys again with the rules applied."""
    import dataclasses
    import sys

    import gguf

    from compiler.kernels import gemv_rules
    from ninfer_gen.weights.gguf_file import file_recipe
    from tools.synth_gguf import plan as synth_plan
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_fixtures import q4_k_m_recipe

    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")
    types = {e.name: gguf.GGMLQuantizationType[e.kind].value for e in synth_plan(spec)}   # the bench's file's mix
    spec = dataclasses.replace(q4_k_m_recipe(spec), quantization=file_recipe(spec, types))
    plan = plan_bucket(spec, target, "step", 1, 1)
    yield "gguf_step", planned_runs(plan, l2, "27B Q4_K_M GGUF step, B = 1", ("gemv",))
    for rules in variants:
        yield "gguf_step", planned_runs(plan, l2, f"27B Q4_K_M GGUF step, B = 1, {rules}", ("gemv",),
                                        variant=lambda key, rules=rules: gemv_rules.apply_overrides(key, rules))


# Session 20 (issue 32's C8 line): the 32-row verify GEMVs ran at 32.4 % of copy (H100, `buckets`) against 61.1 % for
# the 8-row step. Each warp loads its unit's activations for all 32 rows (8 × 16 B per lane, 8× the unit's Q4 weight
# bytes) once per row tile; `tiles` row tiles per block reuse them from registers, `depth` units per load batch keeps
# the registers in bounds. Neither changes the bits. Session 20's sweep chose two tiles and depth 2 for 4-warp blocks
# but the LM heads (16.76 → 15.03 ms). Session 21 (H100, 14.99 → 14.41 ms): `x_early` loads a batch's activations
# right after its weights (at 32 rows each unit's 4 KiB of activations misses L1 and was waited for inside the batch's
# mma), and depth 1 under a 4-block cap on sm_90 (registers go per thread in steps of 8: 128 or fewer fit 4 blocks,
# 16 warps per SM instead of 12). The variants are relative to the shipped keys: sessions 20's and 19's keys and
# neighbours. 8-warp blocks with more than one row tile or x_early get min_blocks 1 (at 2, 128 registers: they spill).
def _s19(key):
    return {"tiles": 2 if ceil_div(key.n, 16) >= 16 * lookup(key.arch).sms else 1, "depth": 0, "x_early": False,
            "min_blocks": 2}


def _s20(key):
    return {"x_early": False} | ({"depth": 2, "min_blocks": 2} if key.depth == 1 else {})


VERIFY_VARIANTS = (("shipped", None), ("session 20", _s20), ("session 19", _s19), ("no x_early", {"x_early": False}),
                   ("no cap", {"min_blocks": 2}), ("x_early, depth 2", {"x_early": True, "depth": 2, "min_blocks": 2}),
                   ("tiles 4, depth 2", {"tiles": 4, "depth": 2, "min_blocks": 2}))


def verify_plan(target, l2, shapes=((8, 4), (4, 4))):
    """`verify`: the verify GEMVs of C8 and C4 (27B, B = 8 / 4, T = 4: 32 / 16 rows) under each VERIFY_VARIANTS, one
    plan label per variant (Σ launches × median per variant; a variant a shape cannot take — reduction over 48 KiB —
    keeps the shipped key there)."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")

    def varied(variant):
        def key_of(key):
            fields = variant(key) if callable(variant) else dict(variant or {})
            if key.warps == 8:
                fields.pop("min_blocks", None)
                if fields.get("tiles", key.tiles) > 1 or fields.get("x_early"):
                    fields["min_blocks"] = 1
            try:
                return replace(key, **fields) if fields and key.fmt not in ("q4_k", "q5_k", "q6_k") else key
            except ValueError:
                return key
        return key_of

    for batch, tokens in shapes:
        plan = plan_bucket(spec, target, "step", batch, tokens)
        for name, variant in VERIFY_VARIANTS:
            yield "verify", planned_runs(plan, l2, f"verify B = {batch}, T = {tokens}, {name}", ("gemv",),
                                         varied(variant))


def tune_configs(fmt, n, k, epi, out, target) -> list[dict]:
    """The shipped config and its neighbours: warps 4/8 × row tiles 1/2 × every valid K split up to 8."""
    base = gemv.make_key(fmt, n, k, 1, target, epi, out)
    configs = [{}]
    for warps in (4, 8):
        for tiles in (1, 2):
            for splits in range(1, min(8, gemv.load_batches(fmt, k, warps)) + 1):
                if (warps, tiles, splits) != (base.warps, base.tiles, base.splits):
                    configs.append({"warps": warps, "tiles": tiles, "splits": splits})
    return configs


def plan(target, ms=(1, 4, 8, 16, 32), step_variants=()):
    """(label, [thunk → (key, runs, bytes, flops[, extra])]) at the 27B shapes; `ms`: the M list of the
    gemv and kquant groups; `step_variants`: gguf_step_plan's rule sets."""
    l2 = target.l2_bytes
    # every way units stream through the decode GEMV, at the 27B decode shapes (v9 notes)
    for fmt, n, k, epi, out in DECODE_GEMV[:6] + (("w8g32", 248320, 5120, "none", "f32"),):
        yield "gemv9", gemv_runs(fmt, n, k, (1, 4, 32) if n < 200000 else (1, 4), epi, out, target, l2,
                                 GEMV_VARIANTS, check_v1=True)
    yield "gemv", gemv_runs("q4g64", 34816, 5120, ms, "silu_mul", "bf16", target, l2)
    yield "gemv", gemv_runs("q4g64", 248320, 5120, ms, "none", "f32", target, l2)
    yield from kquant_plan(target, l2, ms)
    yield from vision_plan(target, l2)
    yield from step_buckets_plan(target, l2)
    yield from gguf_step_plan(target, l2, step_variants)
    yield from verify_plan(target, l2)
    yield "gemv", gemv_runs("w8g32", 248320, 5120, (1, 4, 32), "none", "f32", target, l2)
    yield "gemv", gemv_runs("q5g64", 5120, 17408, (1, 8, 32), "residual", "bf16", target, l2)
    yield "gemv", gemv_runs("q4g64", 10240, 5120, (1, 8, 32), "none", "bf16", target, l2)
    for fmt, n, k, epi in SMALL_GEMV:
        yield "gemv", gemv_runs(fmt, n, k, (1, 8, 32), epi, "bf16", target, l2)
    steps = [gdn_step.make_key(16, 48, 128, 128, b, t, mode, target)
             for b, t, mode in ((1, 1, "step"), (8, 1, "step"), (1, 4, "record"), (8, 4, "record"), (8, 4, "fold"),
                                (1, 4, "commit_record"), (8, 4, "commit_record"))]
    yield "gdn_step", [case_runs(k, l2) for k in steps]
    # chunked prefill vs the sequential step over one 1024-token chunk (27B shape, batch 1)
    chunked = [gdn_step.make_key(16, 48, 128, 128, 1, 1024, "step", target)] + \
        list(dict.fromkeys(gdn_chunk.make_key(16, 48, 128, 128, 1024, target, chunk=c) for c in (32, 64)))
    yield "gdn_chunk", [case_runs(k, l2) for k in chunked]
    convs = [gdn_conv.Key(10240, 1, 1, 4, "update", target.arch), gdn_conv.Key(10240, 8, 4, 4, "record", target.arch)]
    yield "gdn_conv", [case_runs(k, l2) for k in convs]
    attn = [(attn_decode.make_key(24, 4, 256, b, t, dt, 512, target), ctx)
            for b, t, dt, ctx in ((1, 1, "int8", 4096), (1, 1, "int8", 32768), (1, 4, "int8", 4096),
                                  (8, 1, "int8", 4096), (1, 1, "bf16", 4096), (1, 1, "bf16", 32768))]
    yield "attn_decode", [case_runs(k, l2, ctx=ctx) for k, ctx in attn]
    gemms = [gemm.make_key(fmt, n, k, 1024, target, epi) for fmt, n, k, epi in GEMM_SHAPES]
    prefill = [(k, {}) for k in gemms] + [(attn_prefill.make_key(24, 4, 256, 1024, "int8", 512, target), {"ctx": 8192})]
    v1 = [gemm_v1_runs(k, l2) for k in gemms]
    yield "prefill", [case_runs(k, l2, **opt) for k, opt in prefill] + v1
    # prefill GEMM tilings (wr, wc, nt, stages) around the config's choice, per shape
    tilings = {34816: [(4, 1, 8, 3), (8, 1, 8, 4), (4, 1, 6, 4), (4, 1, 4, 4), (4, 2, 8, 4)],
               5120: [(4, 1, 6, 4), (4, 1, 4, 4), (8, 1, 8, 4)],
               10240: [(4, 1, 6, 4), (4, 1, 4, 4), (8, 1, 8, 4)]}
    sweep = [replace(k, wr=wr, wc=wc, nt=nt, stages=st) for k in gemms for wr, wc, nt, st in tilings[k.n]
             if (wr, wc, nt, st) != (k.wr, k.wc, k.nt, k.stages)
             and st * gemm.stage_bytes(k.fmt, wr, wc, nt) <= target.smem_per_block]
    yield "gemm_sweep", [case_runs(k, l2) for k in sweep]
    # every prefill GEMM of a 27B chunk (per distinct shape), v2 then v1: the chunk-level saving
    spec = load_spec(Path(__file__).resolve().parent.parent / "model_specs/qwen3.8-27b.yaml")
    chunk = [gemm.make_key(k.fmt, k.n, k.k, k.m, target, k.epilogue, k.out_dtype)
             for k in plan_bucket(spec, target, "prefill", 1, spec.runtime.prefill_chunk).keys()
             if k.family in ("gemm", "gemm_wg")]
    yield "gemm_27b", [case_runs(k, l2) for k in chunk] + [gemm_v1_runs(k, l2) for k in chunk]
    if gemm_wg.arch_supported(target.arch):
        # the warpgroup GEMM: the config's pick for every prefill shape of a 27B chunk, then its tilings
        # and ring depths on the three big shapes (the mma.sync gemm of the same shapes is in "gemm_27b")
        wg = [gemm_wg.make_key(k.fmt, k.n, k.k, k.m, target, k.epilogue, k.out_dtype) for k in chunk
              if gemm_wg.eligible(k.fmt, k.n, k.k, k.m, target)]
        perms = list(dict.fromkeys(xperm.make_key(k.m, k.k, target) for k in wg))
        yield "wg_27b", [case_runs(k, l2) for k in perms + wg]
        picks = [gemm_wg.make_key(fmt, n, k, 1024, target, epi) for fmt, n, k, epi in GEMM_SHAPES]
        sweep = [replace(k, wgs=w, rt=r, bn=b, stages=st) for k in picks for w, r, b in gemm_wg.TILINGS
                 for st in (3, 4) if (w, r, b, st) != (k.wgs, k.rt, k.bn, k.stages)
                 and gemm_wg.shared_bytes(k.fmt, w, r, b, st) <= target.smem_per_block]
        yield "wg_sweep", [case_runs(k, l2) for k in sweep]
    # v1 (splits = 1) in the same run for every decode GEMM shape, and the neighbours of the split
    # choice; splits and warps fix the reduction order: chosen per shape, never per M
    v1 = {"splits": 1}
    yield "sweep", gemv_runs("q4g64", 34816, 5120, ms, "silu_mul", "bf16", target, l2, [v1, {"splits": 5}])
    yield "sweep", gemv_runs("q4g64", 248320, 5120, ms, "none", "f32", target, l2, [v1])
    yield "sweep", gemv_runs("w8g32", 248320, 5120, (1, 4, 32), "none", "f32", target, l2, [v1])
    yield "sweep", gemv_runs("q5g64", 5120, 17408, (1, 8, 32), "residual", "bf16", target, l2,
                             [v1, {"splits": 3}, {"splits": 9}, {"splits": 17}])
    yield "sweep", gemv_runs("q4g64", 10240, 5120, (1, 8, 32), "none", "bf16", target, l2, [v1, {"splits": 5}])
    for fmt, n, k, epi in SMALL_GEMV:
        yield "sweep", gemv_runs(fmt, n, k, (1, 8, 32), epi, "bf16", target, l2, [v1])
    yield "sweep", gemv_runs("w8g32", 5120, 17408, (1, 8, 32), "residual", "bf16", target, l2,
                             [{"splits": 5}, {"splits": 9}])
    # warps per block on the decode shapes
    warps = [{}, {"warps": 8}]
    for fmt, n, k, epi, out in DECODE_GEMV:
        fit = [c | {"splits": min(gemv.make_key(fmt, n, k, 1, target, epi, out).splits,
                                   gemv.load_batches(fmt, k, c.get("warps", 4)))}
               if gemv.make_key(fmt, n, k, 1, target, epi, out).splits > 1 else c for c in warps]
        yield "warps", gemv_runs(fmt, n, k, (1, 8), epi, out, target, l2, fit)
    # config neighbours (warps, row tiles per block, K splits) of every decode GEMV shape, timed chained
    for fmt, n, k, epi, out in DECODE_GEMV[:6]:
        yield "tune", gemv_runs(fmt, n, k, (1,), epi, out, target, l2, tune_configs(fmt, n, k, epi, out, target))
    misc = [rmsnorm.Key(5120, 1, True, "bf16", 1e-6, target.arch), rmsnorm.Key(5120, 32, True, "bf16", 1e-6, target.arch),
            qk_rope_kv.Key(24, 4, 256, 64, 8, 4, "int8", 64, 512, 1e-6, target.arch), argmax.Key(248320, 8, target.arch)]
    yield "misc", [case_runs(k, l2) for k in misc]


def measure(label, thunks, iters: int, copy_gbs: float) -> list[dict]:
    """Rows for one plan group; a kernel that fails to build or run is recorded, not fatal."""
    rows = []
    for thunk in thunks:
        name = label
        try:
            key, runs, moved, flops, *extra = thunk()
            name = key.name
            us = time_launches(runs, iters)
            chain = time_chain(runs, iters)
        except Exception as err:
            rows.append({"label": label, "name": name, "error": f"{type(err).__name__}: {err}"})
            print(f"  {name}: FAILED {type(err).__name__}: {err}", flush=True)
            continue
        med = statistics.median(us)
        rows.append({"label": label, "name": key.name, "family": key.family, "key": key.fields(),
                     "bytes": moved, "flops": flops, "us_median": med, "us_min": min(us),
                     "gbps": moved / med / 1e3, "frac_copy": moved / med / 1e3 / copy_gbs,
                     "tflops": flops / med / 1e6, "launches": len(runs[0]),
                     "us_chain": chain, "frac_copy_chain": moved / chain / 1e3 / copy_gbs, **(extra[0] if extra else {})})
        print(f"  {key.name}: {med:.1f} us, chained {chain:.1f} us" + (f" {extra[0]}" if extra else ""), flush=True)
        del runs
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="kernel_lab.json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="", help="comma-separated labels: gemv9,gemv,kquant,kqlean,q6lean,kqsplits,streamk,gguf_step,kquant_gemm,vision,buckets,verify,gdn_step,gdn_chunk,gdn_conv,attn_decode,prefill,gemm_sweep,gemm_27b,wg_27b,wg_sweep,sweep,warps,tune,misc")
    ap.add_argument("--ms", default="1,4,8,16,32", help="M values of the gemv and kquant groups")
    ap.add_argument("--arch-path", default=None, help="time another card's kernels (rtx3090: the 3090's keys and "
                    "tiles, built as PTX the driver JIT-compiles, no PDL) or another arch's sized for this GPU's SMs "
                    "(sm_86), as `run --arch-path` runs them")
    ap.add_argument("--gemv-variant", action="append", default=[], help="a NINFER_GEMV rule set (repeatable): the "
                    "gguf_step group's keys timed again with it, e.g. q4_k/34816x5120:stream_k=528,min_blocks=4")
    args = ap.parse_args(argv)
    major, minor = torch.cuda.get_device_capability()
    target = arch_path_target(f"sm_{major}{minor}", args.arch_path,
                              torch.cuda.get_device_properties(0).multi_processor_count)
    if args.arch_path:
        global KERNELS
        KERNELS = KernelCache(build_root(), jobs=os.cpu_count(), jit_ptx=True)
    copy_gbs = copy_bandwidth(args.iters)
    rows, t0 = [], time.time()
    ms = tuple(int(m) for m in args.ms.split(","))
    groups = [(label, items) for label, items in plan(target, ms, args.gemv_variant)
              if not args.only or label in args.only.split(",")]
    try:                                            # all cores, once; a failure shows again per kernel below
        KERNELS.build([t.key for _, items in groups for t in items if hasattr(t, "key")])
    except Exception as err:
        print(f"prebuild failed: {type(err).__name__}: {err}", flush=True)
    for label, items in groups:
        rows += measure(label, items, args.iters, copy_gbs)
        out = {"device": torch.cuda.get_device_name(), "target": target.name, "arch": target.arch, "copy_gbps": copy_gbs,
               "iters": args.iters, "seconds": time.time() - t0, "results": rows}
        Path(args.out).write_text(json.dumps(out, indent=1))           # after every group: partial runs count
    print(f"\ndevice {out['device']}, {target.arch} kernels{' as PTX' if args.arch_path else ''}  copy {copy_gbs:.0f} GB/s  "
          f"(median of {args.iters}; JSON: {args.out})")
    print(f"{'kernel':<62} {'us':>9} {'GB/s':>8} {'copy%':>6} {'TFLOP/s':>8} {'chain us':>9} {'copy%':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['name'][:62]:<62} FAILED: {r['error'][:120]}")
            continue
        print(f"{r['name'][:62]:<62} {r['us_median']:>9.1f} {r['gbps']:>8.0f} {100 * r['frac_copy']:>6.1f} "
              f"{r['tflops']:>8.2f} {r['us_chain']:>9.1f} {100 * r['frac_copy_chain']:>6.1f}")
    for label in dict.fromkeys(r["plan"] for r in rows if "plan" in r and "error" not in r):
        planned = [r for r in rows if r.get("plan") == label and "error" not in r]
        by_family: dict = {}
        for r in planned:
            by_family[r["family"]] = by_family.get(r["family"], 0.0) + r["in_plan"] * r["us_median"] / 1e3
        ms_total = sum(by_family.values())
        moved = sum(r["in_plan"] * r["bytes"] for r in planned)
        flops = sum(r["in_plan"] * r["flops"] for r in planned)
        print(f"{label} (Σ launches × median): {ms_total:.3f} ms, {moved / ms_total / 1e6 / copy_gbs:.1%} of copy, "
              f"{flops / ms_total / 1e9:.1f} TFLOP/s — " +
              ", ".join(f"{f} {ms:.3f}" for f, ms in sorted(by_family.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
