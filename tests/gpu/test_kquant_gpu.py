"""GPU tier for the GGUF k-quant kernels (issue 34 step 3): the decode GEMV (templates/gemv_kq.cu.j2) and the
prefill GEMM (gemm_kq.cu.j2) on Q4_K/Q5_K/Q6_K blocks as stored against compiler.kquant's dequantisation
+ fp32 matmul (fresh random blocks, poisoned outputs, fp32 outputs held to fp32-accumulation error), with
the decode folds (split RMSNorm, GDN conv) and split-K; batch invariance (a row's bits independent of M);
the Q4_K embedding gather (bit-exact) and the GDN norm writing tiled heads; the 27B's k-quant buckets
binding and running under the 24 GiB budget. The tiny Q4_K_M GGUF end to end: tests/gpu/test_gguf_gpu.py.
Run: pytest -m gpu tests/gpu/test_kquant_gpu.py tests/gpu/test_gguf_gpu.py -q -s"""
import gc
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compiler.kernels import embed, gated_rmsnorm, gemm, gemv, gemv_rules
from compiler.kernels.weight_layout import pack_kquant_for_device
from compiler.kquant import KFORMATS, random_kquant
from compiler.spec import load_spec
from harness import TARGET
from lab.cases import gemv_workspace, make_case

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
FMTS = list(KFORMATS)
REL_L2 = 1e-5            # fp32 accumulation over K ≤ 17408 (the "f32" elementwise tolerance is checked too)


def _gemv_keys():
    keys = []
    for fmt in FMTS:
        for m in (1, 4, 16, 32):
            keys += [gemv.make_key(fmt, 34816, 5120, m, TARGET, "silu_mul"),            # gate/up, many waves
                     gemv.make_key(fmt, 5120, 17408, m, TARGET, "residual", "f32"),     # down, split-K
                     gemv.make_key(fmt, 1024, 5120, m, TARGET, out_dtype="f32"),        # k/v, split-K
                     gemv.make_key(fmt, 40, 256, m, TARGET, out_dtype="f32"),           # one unit, odd rows
                     gemv.make_key(fmt, 200, 768, m, TARGET, "residual", "f32")]        # U odd: Q6_K rows off by 2
        keys += [replace(gemv.make_key(fmt, 5120, 6144, m, TARGET, "residual"), norm_out=True) for m in (1, 8, 32)]
        keys += [replace(gemv.make_key(fmt, 6144, 5120, m, TARGET), scale_in=True, eps=1e-6) for m in (1, 8, 32)]
        keys += [replace(gemv.make_key(fmt, 10240, 5120, m, TARGET), conv=4) for m in (1, 4, 8)]
    keys.append(gemv.make_key("q6_k", 248320, 5120, 4, TARGET, out_dtype="f32"))       # the LM head
    # code_bias alone (codes + 128 into the mma, the 128s out with the mins; `kq_lean=0`): other bits, the same
    # reference tolerances (rel-L2 ≤ REL_L2 on f32 outputs), loaded and staged, one unit to split-K, M = 1 … 32
    # (uncapped, min_blocks 2: the stream-K down projection's 128-register cap is the lean math's)
    keys += [replace(gemv.make_key(fmt, n, k, m, TARGET, epi, "f32"), code_bias=True, kq_lean=False, stage_w=sw,
                     min_blocks=2)
             for fmt in ("q4_k", "q5_k") for n, k, epi in ((5120, 17408, "residual"), (40, 256, "none"),
                                                           (200, 768, "residual"), (1024, 5120, "none"))
             for m in (1, 4, 32) for sw in (0, 2)]
    # the shipped kq_lean (common/kq_lean.j2: Σ x by one mma per sub-block, halves added in fp32): other bits than
    # code_bias alone, the same tolerances; the code_bias shapes above at M = 1, 2, 8, 9, 32 (M = 1 leaves out the
    # second token column's FFMAs), gate/up in bf16 and the decode folds at M = 1 and 8
    keys += [gemv.make_key(fmt, n, k, m, TARGET, epi, "f32")
             for fmt in ("q4_k", "q5_k") for n, k, epi in ((5120, 17408, "residual"), (40, 256, "none"),
                                                           (200, 768, "residual"), (1024, 5120, "none"))
             for m in (1, 2, 8, 9, 32)]
    for fmt in ("q4_k", "q5_k"):
        for m in (1, 8):
            keys += [gemv.make_key(fmt, 34816, 5120, m, TARGET, "silu_mul"),
                     replace(gemv.make_key(fmt, 5120, 6144, m, TARGET, "residual"), norm_out=True),
                     replace(gemv.make_key(fmt, 6144, 5120, m, TARGET), scale_in=True, eps=1e-6),
                     replace(gemv.make_key(fmt, 10240, 5120, m, TARGET), conv=4)]
    return list(dict.fromkeys(keys))


def _gemm_keys():
    keys = []
    for fmt in FMTS:
        keys += [gemm.make_key(fmt, *shape, TARGET, epi, out) for *shape, epi, out in (
            (1040, 256, 48, "silu_mul", "bf16"), (200, 768, 100, "residual", "f32"), (5120, 17408, 1040, "residual", "f32"),
            (72, 512, 1040, "none", "f32"), (34816, 5120, 256, "silu_mul", "bf16"))]
        keys += [replace(gemm.make_key(fmt, 200, 768, 80, TARGET, "residual", "f32"), wr=wr, wc=wc, nt=nt, stages=2)
                 for wr, wc, nt in gemm.KQ_TILINGS if gemm.stage_bytes(fmt, wr, wc, nt) * 2 <= TARGET.smem_per_block]
    return list(dict.fromkeys(keys))


OTHERS = [embed.Key(f, 5120, 8, TARGET.arch) for f in FMTS] + \
    [gated_rmsnorm.Key(48, 128, m, 1e-6, TARGET.arch, 16) for m in (1, 32)] + [gated_rmsnorm.Key(6, 128, 5, 1e-6, TARGET.arch, 2)]
CASES = _gemv_keys() + _gemm_keys() + OTHERS


@pytest.fixture(scope="session")
def h():
    import harness
    harness.build(CASES)
    return harness


def _rel_l2(a, e):
    return ((a.double() - e.double()).norm() / e.double().norm()).item()


@pytest.mark.parametrize("key", CASES, ids=[k.name for k in CASES])
def test_kquant_kernel_matches_reference(h, key):
    case = make_case(key, "cuda", seed=len(key.name))
    h.run(case)
    h.compare(case, key.name)
    y = case.outputs["y"]
    if y.dtype == torch.float32 and not getattr(key, "conv", 0):
        err = _rel_l2(y, case.reference()["y"].to(y.device))
        print(f"{key.name}: rel-L2 {err:.2e}")
        assert err <= REL_L2, f"{key.name}: rel-L2 {err:.3g} beyond fp32 accumulation error"


def _same_bits(h, base, variant):
    outs = []
    for key in (base, variant):
        case = make_case(key, "cuda", seed=7)
        h.run(case)
        outs.append(case.outputs["y"])
    assert h.same_bits(outs[0], outs[1]), f"{variant.name}: other bits than {base.name}"


STAGED = [(fmt, n, k, epi, out, m, sw, False) for fmt in FMTS
          for n, k, epi, out in ((1024, 5120, "none", "f32"), (200, 768, "residual", "f32"))
          for m in (1, 32) for sw in ((2,) if fmt == "q6_k" else (2, 3))] + \
    [(f, 34816, 5120, "silu_mul", "bf16", 4, 2 if f == "q6_k" else 3, False) for f in FMTS] + \
    [pytest.param(f, n, k, epi, out, m, 2, True, id=f"{f}-{n}-{k}-{epi}-{out}-{m}-2-lean") for f in ("q4_k", "q5_k")
     for n, k, epi, out in ((200, 768, "residual", "f32"), (34816, 5120, "silu_mul", "bf16")) for m in (1, 8)]


@pytest.mark.parametrize("fmt,n,k,epi,out,m,sw,lean", STAGED)
def test_weights_staged_in_shared_memory_give_the_same_bits(h, fmt, n, k, epi, out, m, sw, lean):
    """`stage_w` moves the weights global → shared → registers instead of global → registers; the lanes read the
    same bytes, so the same inputs give the loaded key's bits (split-K, odd unit counts, M = 1 … 32; `lean`: both
    with kq_lean, as shipped; else Q4_K/Q5_K with code_bias alone)."""
    key = replace(gemv.make_key(fmt, n, k, m, TARGET, epi, out), stage_w=0, kq_lean=lean,   # loaded (as at M > 8),
                  min_blocks=2)                                                              # uncapped
    staged = replace(key, stage_w=sw)
    h.build([key, staged])
    _same_bits(h, key, staged)


Q6_LEAN = [(n, k, epi, out, m, sw) for n, k, epi, out in ((5120, 17408, "residual", "f32"),
                                                        (200, 768, "residual", "f32"), (40, 256, "none", "f32"),
                                                        (1024, 5120, "none", "f32"))
           for m in (1, 2, 8, 9, 32) for sw in (0, 2)] + [(34816, 5120, "silu_mul", "bf16", m, 2) for m in (1, 8)]


@pytest.mark.parametrize("n,k,epi,out,m,sw", Q6_LEAN)
def test_q6_lean_gives_the_same_bits(h, n, k, epi, out, m, sw):
    """`q6_lean` (Q6_K's unit math in fewer instructions, shipped) reads the same words and computes the same values
    (d·sc by an exact FFMA instead of an exact FMUL): the bits of the key without it — staged (rows of 16 chunks; one
    copy offset a unit where 2·RB ≡ 0 mod 16, K = 5120 / 17408, else one a row: K = 256, 768) and loaded, M = 1 … 32
    (M = 1 leaves out the second token column's FFMAs)."""
    base = gemv.make_key("q6_k", n, k, m, TARGET, epi, out)
    key = replace(base, stage_w=sw, q6_lean=False, min_blocks=min(base.min_blocks, 3))   # (the stream-K cap: lean's)
    lean = replace(key, q6_lean=True)
    h.build([key, lean])
    _same_bits(h, key, lean)


BIASED = "code_bias=1,kq_lean=0,stage_w=2,min_blocks=2"     # code_bias alone, staged, uncapped (the shipped keys, "",
                                                            # take kq_lean too)


@pytest.mark.parametrize("fmt,n,k,epi,rule", [
    (fmt, n, k, epi, "") for fmt in FMTS for n, k, epi in (
        (34816, 5120, "silu_mul"), (5120, 17408, "residual"), (1024, 5120, "none"), (200, 768, "none"),
        (5120, 6144, "norm_out"), (6144, 5120, "scale_in"))] + [
    (fmt, n, k, epi, BIASED) for fmt in ("q4_k", "q5_k") for n, k, epi in ((34816, 5120, "silu_mul"),
                                                                           (5120, 17408, "residual"), (200, 768, "none"))] + [
    (fmt, n, k, epi, f"splits=1,stream_k={g}") for fmt in FMTS for n, k, epi, g in (
        (5120, 17408, "residual", 528), (5120, 6144, "norm_out", 528), (6144, 5120, "scale_in", 396),
        (200, 768, "none", 7), (1024, 5120, "none", 31))] + [
    ("q4_k", 34816, 5120, "silu_mul", "warps=1"), ("q4_k", 34816, 5120, "silu_mul", "warps=2")])
def test_kquant_gemv_batch_invariance(h, fmt, n, k, epi, rule):
    """A row's bits (y; with norm_out also xn and the tile sums of squares) do not depend on M: M = 1, 4, 16
    and 32 share weights and leading rows; split-K tickets come back zero. `rule`: an experiment rule on every
    key (gemv_rules.apply_overrides)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    packed = pack_kquant_for_device(random_kquant(fmt, n, k, g), gate_up=epi == "silu_mul")
    x = torch.randn(32, k, generator=g, device="cuda").bfloat16()
    res = torch.randn(32, n, generator=g, device="cuda").bfloat16()
    norm_w = (0.1 * torch.randn(n, generator=g, device="cuda")).bfloat16()
    ssq = torch.randn(32, k, generator=g, device="cuda").pow(2).reshape(32, k // 16, 16).sum(-1)
    keys = {}
    for m in (1, 4, 16, 32):
        if epi in ("silu_mul", "none"):
            keys[m] = gemv.make_key(fmt, n, k, m, TARGET, epi, "bf16" if epi == "silu_mul" else "f32")
        elif epi == "scale_in":
            keys[m] = replace(gemv.make_key(fmt, n, k, m, TARGET), scale_in=True, eps=1e-6)
        else:
            keys[m] = replace(gemv.make_key(fmt, n, k, m, TARGET, "residual"), norm_out=epi == "norm_out")
        keys[m] = gemv_rules.apply_overrides(keys[m], rule) if rule else keys[m]
    wanted = gemv_rules.parse_overrides(rule)[0][1] if rule else {}
    assert all(getattr(key, f) == v for key in keys.values() for f, v in wanted.items()), f"{rule} made no key"
    h.build(list(keys.values()))
    outs = {}
    for m, key in keys.items():
        y = torch.full((m, n // 2 if epi == "silu_mul" else n), float("nan"), device="cuda",
                       dtype=torch.float32 if key.out_dtype == "f32" else torch.bfloat16)
        ws, tickets = gemv_workspace(key, "cuda")
        args = [y, x[:m].contiguous(), packed["lo"], None, None,
                res[:m].contiguous() if key.epilogue == "residual" else None, ws, tickets]
        got = {"y": y}
        if key.norm_out:
            got["xn"] = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            got["ssq"] = torch.full((m, n // 16), float("nan"), device="cuda")
            args += [got["xn"], got["ssq"], norm_w]
        if key.scale_in:
            args.append(ssq[:m].contiguous())
        h.launch_key(key, gemv, args)
        outs[m] = (got, tickets)
    torch.cuda.synchronize()
    assert all(t is None or not t.any() for _, t in outs.values()), f"{fmt} {n}x{k}: tickets not re-armed"
    for name in outs[32][0]:
        assert not torch.isnan(outs[32][0][name].float()).any(), f"{fmt} {n}x{k}: {name} not written"
        for m in (1, 4, 16):
            assert h.same_bits(outs[m][0][name], outs[32][0][name][:m]), f"{fmt} {n}x{k} {epi}: {name}, M={m} vs 32"


SK = [replace(gemv.make_key(fmt, n, k, m, TARGET, epi, out), splits=1, stream_k=g)
      for fmt in FMTS for n, k, epi, out, g in ((5120, 17408, "residual", "f32", 528), (200, 768, "residual", "f32", 7),
                                                (200, 768, "none", "f32", 39), (40, 512, "none", "f32", 3),
                                                (34816, 5120, "silu_mul", "bf16", 1056))
      for m in (1, 3, 9)]


@pytest.mark.parametrize("key", SK, ids=[k.name for k in SK])
def test_stream_k_matches_reference(h, key):
    """`stream_k` (a grid of G blocks over the units flattened tile-major; a tile's partials summed in block order by
    the last contributor): within fp32 accumulation error of the reference — one block a unit (G = W), tiles of one
    to four contributors, blocks over many tiles (G = 3), M staged (1, 3) and loaded (9); the tickets come back zero
    (compare)."""
    _built_matches_reference(h, key)


def _built_matches_reference(h, key):
    h.build([key])
    case = make_case(key, "cuda", seed=len(key.name))
    h.run(case)
    h.compare(case, key.name)
    y = case.outputs["y"]
    if y.dtype == torch.float32:
        assert _rel_l2(y, case.reference()["y"].to(y.device)) <= REL_L2


FEWER_WARPS = [replace(gemv.make_key("q4_k", n, k, m, TARGET, epi, out), warps=w)
               for n, k, epi, out in ((34816, 5120, "silu_mul", "bf16"), (200, 768, "residual", "f32"))
               for w in (1, 2) for m in (1, 3, 9)]


@pytest.mark.parametrize("key", FEWER_WARPS, ids=[k.name for k in FEWER_WARPS])
def test_fewer_warps_a_tile_match_reference(h, key):
    """One or two warps a row tile (`warps`, a field rules may set: a warp walks more of a tile's units, fewer warps
    share its sum; as the gate/up's shipped choice refuted in session 30): within fp32 accumulation error of the
    reference, M staged (1, 3) and loaded (9)."""
    _built_matches_reference(h, key)


def test_kquant_27b_buckets_bind_with_device_random_weights():
    """A Q4_K_M-style 27B (random k-quant blocks drawn on the device) plans, compiles, binds and runs its prefill
    and decode buckets under the 24 GiB budget."""
    from gguf_fixtures import q4_k_m_recipe
    from ninfer_gen.cli.env import build_root
    from ninfer_gen.executor.device_weights import random_on_device
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.executor.memory_plan import GiB

    spec = q4_k_m_recipe(load_spec(ROOT / "model_specs/qwen3.8-27b.yaml"))
    torch.cuda.reset_peak_memory_stats()
    weights = random_on_device(spec, seed=0)
    be = GpuBackend(spec, weights, max_context=4096, vram_budget=24 * GiB, build_root=build_root())
    seq = be.new_sequence()
    try:
        ids = torch.randint(0, spec.model.vocab_size, (1054,), generator=torch.Generator().manual_seed(6)).tolist()
        logits, _ = be.prefill(seq, ids)
        assert torch.isfinite(logits).all()
        step, _ = be.run("step", [seq], [[int(logits.argmax())]])
        assert torch.isfinite(step).all()
    finally:
        be.release(seq)
    peak = torch.cuda.max_memory_allocated()
    print(f"27B Q4_K_M: weights {weights.nbytes / GiB:.2f} GiB, peak allocated {peak / GiB:.2f} GiB")
    assert peak < 24 * GiB
    del be, weights, seq, logits, step
    gc.collect()                # the backend's graphs and lanes hold reference cycles
    torch.cuda.empty_cache()
