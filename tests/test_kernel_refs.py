"""CPU tests of the kernel side: device weight layout (round trip and a bit-level model of the gemv
kernel), and every family's torch reference against a straightforward loop at tiny shapes."""
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compiler import reference_vision
from compiler.kernels import (argmax, attn_decode, embed, embed_images, gated_rmsnorm, gdn_conv, gdn_step, gemm,
                              gemm_wg, gemv, qk_rope_kv, rmsnorm)
from compiler.kernels.gemv_rules import apply_overrides
from compiler.kernels.weight_layout import FORMATS, dequantize, pack_for_device, random_qmatrix, unpack_from_device
from compiler.options import CompileOptions
from compiler.targets import lookup
from gemv_emulator import emulate

T3090 = lookup("rtx3090")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k,gate_up", [(6, 64, False), (48, 192, False), (32, 128, True), (80, 256, False)])
def test_layout_round_trip(fmt, n, k, gate_up):
    w = random_qmatrix(fmt, n, k, gen())
    back = unpack_from_device(pack_for_device(w, gate_up=gate_up), fmt, n, k, gate_up=gate_up)
    if fmt == "bf16":
        assert torch.equal(back.view(torch.int16), w.view(torch.int16))
    else:
        assert torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_chunked_packing_equals_whole(fmt):
    w = random_qmatrix(fmt, 72, 128, gen(3))
    whole, chunked = pack_for_device(w, chunk_rows=4096), pack_for_device(w, chunk_rows=16)
    assert all(torch.equal(whole[n], chunked[n]) for n in ("lo", "hi", "scales"))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_gemv_emulated_kernel_matches_reference(fmt, m, epilogue):
    n, k = (32, 128) if epilogue == "silu_mul" else (40, 128)
    g = gen(m)
    w = random_qmatrix(fmt, n, k, g)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    res = torch.randn(m, n, generator=g).to(torch.bfloat16) if epilogue == "residual" else None
    key = gemv.make_key(fmt, n, k, m, T3090, epilogue, "f32")
    y = emulate(fmt, pack_for_device(w, gate_up=epilogue == "silu_mul"), x, n, epilogue, res)
    ref = gemv.reference(key, x, w, res).double().numpy()
    assert abs(y - ref).max() <= 1e-4 * max(1.0, abs(ref).max())


def test_gemv_reference_is_a_loop():
    key = gemv.make_key("q4g64", 16, 64, 2, T3090)
    w = random_qmatrix("q4g64", 16, 64, gen())
    x = torch.randn(2, 64, generator=gen(1)).to(torch.bfloat16)
    y = gemv.reference(key, x, w).float()
    for r in range(2):
        for n in range(16):
            want = sum(float(x[r, c]) * float(w.codes[n, c]) * float(w.scales[n, c // 64]) for c in range(64))
            assert abs(float(y[r, n]) - want) <= 1e-2 * max(1, abs(want))


@pytest.mark.parametrize("family,target", [(gemm, T3090), (gemm_wg, lookup("sm_90"))])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_gemm_reference_is_the_gemv_projection(family, target, epilogue):
    """The prefill GEMMs' references (their own keys) give gemv's projection and epilogue."""
    n, k, m = 32, 128, 5
    w = random_qmatrix("q5g64", n, k, gen(2))
    x = torch.randn(m, k, generator=gen(3)).to(torch.bfloat16)
    res = torch.randn(m, n, generator=gen(4)).to(torch.bfloat16) if epilogue == "residual" else None
    y = family.reference(family.make_key("q5g64", n, k, m, target, epilogue, "f32"), x, w, res)
    want = gemv.reference(gemv.make_key("q5g64", n, k, m, target, epilogue, "f32"), x, w, res)
    assert torch.equal(y, want)


def test_gemv_stream_fields_follow_the_shape_and_m():
    """The stream fields (never the bits) follow measured rules: at M ≤ 8 no L2 prefetch, units
    interleaved in 4-warp blocks (split or not) and kept apart in 8-warp ones; at M > 8 units kept apart
    with one batch of prefetch (sm_90 only); the many-wave LM head streams plain. One row: gate/up (an
    unsplit interleaved grid of > 2 waves) asks for six blocks per SM, the unsplit 8-warp residual
    projection stages its activations."""
    h200 = lookup("h200")
    gate_up = gemv.make_key("q4g64", 34816, 5120, 1, h200, "silu_mul")
    assert (gate_up.warps, gate_up.interleave, gate_up.prefetch) == (4, True, 0)
    assert gate_up.name == "gemv_q4g64_n34816_k5120_m1_silu_w4t1_il_b6_sm90"
    assert gemv.make_key("q4g64", 34816, 5120, 4, h200, "silu_mul").min_blocks == 2           # measured at M = 1
    assert gemv.make_key("q4g64", 10240, 5120, 1, h200).min_blocks == 2                        # ≈ one wave
    verify8 = gemv.make_key("q4g64", 34816, 5120, 32, h200, "silu_mul")
    assert (verify8.interleave, verify8.prefetch) == (False, 1)
    down = gemv.make_key("q5g64", 5120, 17408, 1, h200, "residual")
    assert down.splits > 1 and (down.warps, down.interleave, down.prefetch) == (4, True, 0)
    out_proj = gemv.make_key("q5g64", 5120, 6144, 1, h200, "residual")
    assert (out_proj.warps, out_proj.interleave, out_proj.prefetch, out_proj.stage_x) == (8, False, 0, True)
    assert not gemv.make_key("q5g64", 6144, 5120, 1, h200).stage_x                              # not residual
    # a row wider than the staging buffer streams from L1 (the 9B shape's 12,288-wide down projection)
    wide = gemv.make_key("q5g64", 4096, 12288, 1, h200, "residual")
    assert wide.warps == 8 and wide.splits == 1 and not wide.stage_x
    head = gemv.make_key("w8g32", 248320, 5120, 1, h200, out_dtype="f32")
    assert (head.interleave, head.prefetch) == (False, 0)
    on_3090 = gemv.make_key("q4g64", 34816, 5120, 1, T3090, "silu_mul")
    assert (on_3090.interleave, on_3090.prefetch) == (True, 0)
    # the reduction order (warps, splits) never follows M
    for fmt, n, k in (("q4g64", 34816, 5120), ("q5g64", 5120, 17408), ("w8g32", 248320, 5120)):
        keys = [gemv.make_key(fmt, n, k, m, h200) for m in (1, 4, 8, 16, 32)]
        assert len({(key.warps, key.splits) for key in keys}) == 1


def _ruled(*args, rules: str):
    """The shipped GEMV key of `args` (gemv.make_key) under experiment rules, as the lowering applies them."""
    return apply_overrides(gemv.make_key(*args), rules)


def test_gemv_experiment_override_and_bad_stream_fields():
    """CompileOptions.gemv rules replace key fields where the result is a valid key; a malformed rule
    is refused when the options are made, naming itself."""
    h200 = lookup("h200")
    plain = _ruled("q4g64", 34816, 5120, 1, h200, "silu_mul", rules="prefetch=0,interleave=0")
    assert plain.name == "gemv_q4g64_n34816_k5120_m1_silu_w4t1_b6_sm90"
    assert _ruled("q4g64", 34816, 5120, 1, h200, "silu_mul", rules="prefetch=9").prefetch == 0  # invalid: kept
    with pytest.raises(ValueError, match="'prefetch=two' needs a value"):
        CompileOptions(gemv="prefetch=two")
    with pytest.raises(ValueError, match="'ring' is not one of"):
        CompileOptions(gemv="ring=8")
    base = gemv.make_key("q4g64", 34816, 5120, 1, h200)
    with pytest.raises(ValueError, match="prefetch = 9 outside 0..8"):
        replace(base, prefetch=9)
    with pytest.raises(ValueError, match="min_blocks = 0 outside"):
        replace(base, min_blocks=0)


def test_gemv_override_rules_by_shape():
    """';'-separated rules, a rule limited to one NxK shape; the first rule that applies wins."""
    h200 = lookup("h200")
    rules = "5120x6144:min_blocks=3,warps=4;prefetch=1"
    out = _ruled("q5g64", 5120, 6144, 1, h200, "residual", rules=rules)
    # (the fields a rule does not name keep the shipped choice: stage_x, from the 8-warp default)
    assert (out.min_blocks, out.warps, out.prefetch) == (3, 4, 0) and out.name.endswith("_w4t1_b3_xs_sm90")
    assert _ruled("q4g64", 34816, 5120, 1, h200, "silu_mul", rules=rules).prefetch == 1  # the catch-all
    with pytest.raises(ValueError, match="is not a shape NxK"):
        CompileOptions(gemv="5120by6144:prefetch=1")
    both = "10240x5120/m8:min_blocks=3"         # a shape and rows together: each must hold
    got = {m: _ruled("q5_k", 10240, 5120, m, h200, rules=both).min_blocks for m in (1, 8, 16)}
    assert got == {1: 3, 8: 3, 16: 2} and _ruled("q5_k", 6144, 5120, 1, h200, rules=both).min_blocks == 3
    assert _ruled("q4_k", 6144, 5120, 1, h200, rules=both).min_blocks == 2
    with pytest.raises(ValueError, match="is not a shape NxK"):
        CompileOptions(gemv="10240x5120/n8:prefetch=1")


def test_gemv_override_rules_by_rows_and_fallthrough():
    """`mR:` limits a rule to keys of at most R rows; a rule that makes no valid key for a key passes it to the
    next rule (a k-quant-only field leaves other formats to the catch-all)."""
    h200 = lookup("h200")
    rules = "m8:code_bias=0,kq_lean=0,stage_w=3,min_blocks=4;m8:min_blocks=4;prefetch=1"
    q4 = [_ruled("q4_k", 34816, 5120, m, h200, "silu_mul", rules=rules) for m in (1, 8, 16)]
    assert [(k.code_bias, k.stage_w, k.min_blocks) for k in q4] == [(False, 3, 4), (False, 3, 4), (True, 0, 2)]
    assert _ruled("q4_k", 34816, 5120, 1, h200, "silu_mul", rules="code_bias=0").code_bias  # kq_lean needs it
    q6 = _ruled("q6_k", 5120, 17408, 4, h200, "residual", rules=rules)
    assert (q6.stage_w, q6.min_blocks) == (2, 4)          # 3 stages of Q6_K rows: over STAGE_W_LIMIT, the next rule
    q4g64 = _ruled("q4g64", 34816, 5120, 1, h200, "silu_mul", rules=rules)
    assert (q4g64.min_blocks, q4g64.stage_w) == (4, 0)        # k-quant fields: not this format's; the next rule
    with pytest.raises(ValueError, match="rows mR / mA-B"):
        CompileOptions(gemv="mx:prefetch=1")
    with pytest.raises(ValueError, match="rows mR / mA-B"):
        CompileOptions(gemv="m32-9:tiles=2")


def test_gemv_override_rules_by_format():
    """A weight format may join a rule's selectors (`q6_k/5120x17408:splits=3`): keys of other formats of that shape
    pass on to the next rule; an unknown name is refused with the selectors it may be."""
    h200 = lookup("h200")
    rules = "q6_k/5120x17408:splits=3;5120x17408:splits=2"
    got = {f: _ruled(f, 5120, 17408, 1, h200, "residual", rules=rules).splits for f in ("q6_k", "q4_k")}
    assert got == {"q6_k": 3, "q4_k": 2}
    assert _ruled("q6_k", 5120, 6144, 1, h200, "residual", rules="q6_k/5120x17408:splits=3").splits == 1
    with pytest.raises(ValueError, match="or a weight format"):
        CompileOptions(gemv="q7_k/5120x17408:splits=3")


def test_gemv_rows_range_rules_set_row_tiles_and_load_depth():
    """`mA-B:` limits a rule to keys of A to B rows; `tiles` (row tiles per block) and `depth` (units per load
    batch) never change the bits, so a rule may set them per M; shapes whose warp reduction would not fit the
    static shared memory are refused (and the rule falls through)."""
    h200 = lookup("h200")
    rules = "m9-32:tiles=4,depth=1;m9-32:tiles=2,depth=2"
    keys = {m: _ruled("q5g64", 5120, 6144, m, h200, "residual", rules=rules) for m in (8, 9, 16, 32)}
    assert (keys[8].tiles, keys[8].depth) == (1, 0)                       # outside the range: shipped
    assert (keys[16].tiles, keys[16].depth) == (4, 1) and keys[16].name.endswith("_d1_sm90")
    # 8 warps × 4 tiles × 4 column tiles × 512 B = 64 KiB of reduction: over 48 KiB, so the second rule
    assert keys[32].warps == 8 and (keys[32].tiles, keys[32].depth) == (2, 2)
    with pytest.raises(ValueError, match="65536 B for the warp reduction"):
        replace(keys[32], tiles=4)
    with pytest.raises(ValueError, match="49153 B of shared memory"):         # 48 KiB + the split-K flag
        replace(gemv.make_key("bf16", 96, 5120, 32, h200), tiles=3)
    with pytest.raises(ValueError, match="depth 9 / tiles 1 outside"):
        replace(keys[8], depth=9)
    with pytest.raises(ValueError, match="one unit at a time"):
        replace(gemv.make_key("q4_k", 34816, 5120, 1, h200, "silu_mul"), depth=2)
    early = {m: _ruled("q4g64", 10240, 5120, m, h200, rules="m9-32:x_early=1,depth=1") for m in (8, 32)}
    assert not early[8].x_early and early[32].x_early and early[32].name.endswith("_d1_xe_sm90")
    with pytest.raises(ValueError, match="no x_early"):
        replace(gemv.make_key("q6_k", 5120, 17408, 32, h200, "residual"), x_early=True)


def test_options_reach_the_plan_not_the_environment(monkeypatch):
    """Planning reads no environment variable: the same options give the same plan whatever the shell
    says; the CLI edge (ninfer_gen.cli.env) turns NINFER_* into options."""
    from compiler.buckets import plan_bucket, profile_of
    from compiler.spec import load_spec
    from ninfer_gen.cli.env import compile_options

    spec = load_spec(Path(__file__).parent.parent / "model_specs/qwen3.8-tiny.yaml")
    h200 = lookup("h200")
    before = [c.key.name for c in plan_bucket(spec, h200, "step", 1, 1).calls]
    for name in ("NINFER_GEMV", "NINFER_NORM_FOLD", "NINFER_CONV_FOLD", "NINFER_PDL", "NINFER_CONCURRENCY"):
        monkeypatch.setenv(name, {"NINFER_GEMV": "prefetch=2", "NINFER_CONCURRENCY": "1"}.get(name, "0"))
    assert [c.key.name for c in plan_bucket(spec, h200, "step", 1, 1).calls] == before
    assert compile_options() == CompileOptions(norm_fold=False, conv_fold=False, pdl=False, concurrency=1,
                                               gemv="prefetch=2")
    monkeypatch.setenv("NINFER_CONCURRENCY", "3")
    plan = plan_bucket(spec, h200, "step", 1, 1, profile_of(spec, options=compile_options()))
    assert plan.options.digest != CompileOptions().digest and not any(c.programmatic for c in plan.calls)
    assert plan.family_counts()["rmsnorm"] > 2 and max(len(g) for g in plan.groups) <= 3
    assert all(c.key.prefetch == 2 for c in plan.calls if c.key.family == "gemv")


def test_rmsnorm_reference_is_a_loop():
    key = rmsnorm.Key(64, 2, True, "f32", 1e-6, "sm_86")
    x, d = (torch.randn(2, 64, generator=gen(i)).to(torch.bfloat16) for i in range(2))
    w = torch.randn(64, generator=gen(2)).to(torch.bfloat16)
    y, xn = rmsnorm.reference(key, x, w, d)
    for r in range(2):
        s = [float(torch.tensor(float(x[r, c]) + float(d[r, c])).to(torch.bfloat16)) for c in range(64)]
        assert [float(v) for v in xn[r]] == s
        inv = 1 / math.sqrt(sum(v * v for v in s) / 64 + 1e-6)
        for c in range(64):
            assert abs(float(y[r, c]) - s[c] * inv * (1 + float(w[c]))) < 1e-4


def test_gated_rmsnorm_reference_is_a_loop():
    key = gated_rmsnorm.Key(2, 32, 1, 1e-6, "sm_86")
    o, z, w = torch.randn(1, 2, 32, generator=gen(0)), torch.randn(1, 64, generator=gen(1)).bfloat16(), \
        torch.randn(32, generator=gen(2)).bfloat16()
    y = gated_rmsnorm.reference(key, o, z, w)
    for h in range(2):
        inv = 1 / math.sqrt(sum(float(v) ** 2 for v in o[0, h]) / 32 + 1e-6)
        for c in range(32):
            zz = float(z[0, h * 32 + c])
            want = float(o[0, h, c]) * inv * float(w[c]) * zz / (1 + math.exp(-zz))
            assert abs(float(y[0, h * 32 + c]) - want) <= 1e-2 * max(1, abs(want))


def test_embed_and_argmax_references():
    table = random_qmatrix("w8g32", 10, 64, gen())
    ids = torch.tensor([3, 0, 9], dtype=torch.int32)
    y = embed.reference(embed.Key("w8g32", 64, 3, "sm_86"), ids, table)
    assert torch.equal(y, (dequantize(table)[ids.long()]).bfloat16())
    logits = torch.tensor([[1.0, 5.0, 5.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    assert argmax.reference(argmax.Key(4, 2, "sm_86"), logits).tolist() == [1, 0]


def test_gdn_conv_reference_is_a_loop():
    c, b, t = 8, 2, 3
    g = gen()
    x = torch.randn(b, t, c, generator=g).bfloat16()
    w = torch.randn(c, 4, generator=g).bfloat16()
    hist = torch.randn(3, 3, c, generator=g).bfloat16()
    slots = torch.tensor([2, -1], dtype=torch.int32)
    y, h2 = gdn_conv.reference(gdn_conv.Key(c, b, t, 4, "update", "sm_86"), hist, slots, x, w)
    for tt in range(t):
        for ch in range(c):
            cols = [float(hist[2, j, ch]) for j in range(3)] + [float(x[0, i, ch]) for i in range(t)]
            acc = sum(float(w[ch, j]) * cols[tt + j] for j in range(4))
            assert abs(float(y[0, tt, ch]) - acc / (1 + math.exp(-acc))) <= 1e-2 * max(1, abs(acc))
    assert torch.equal(h2[2], x[0]) and torch.equal(h2[:2], hist[:2])
    rec = torch.randn(b, t, c, generator=g).bfloat16()
    _, h3 = gdn_conv.reference(gdn_conv.Key(c, b, t, 4, "fold", "sm_86"), hist, torch.tensor([1, 0]), rec=rec,
                               commit=torch.tensor([1, 0]))
    assert torch.equal(h3[1], torch.cat([hist[1, 1:], rec[0, :1]])) and torch.equal(h3[0], hist[0])


def _gdn_inputs(key, g):
    qkv = torch.randn(key.b, key.t, 2 * key.hk * key.dk + key.hv * key.dv, generator=g).bfloat16()
    a, b = torch.randn(key.b, key.t, key.hv, generator=g), torch.randn(key.b, key.t, key.hv, generator=g)
    a_log, dt = torch.rand(key.hv, generator=g), torch.randn(key.hv, generator=g) - 2
    state = torch.randn(3, key.hv, key.dk, key.dv, generator=g) * 0.1
    return qkv, a, b, a_log, dt, state


def test_gdn_step_reference_is_a_loop_and_fold_replays_it():
    key = gdn_step.Key(1, 2, 32, 32, 1, 3, "record", 1, "sm_86")
    qkv, a, b, a_log, dt, state = _gdn_inputs(key, gen())
    slots = torch.tensor([1], dtype=torch.int32)
    o, s_after, rec = gdn_step.reference(key, state, slots, qkv, a, b, a_log, dt)
    assert torch.equal(s_after, state)                                   # record never writes S0
    S = state[1].double().clone()
    for tt in range(3):
        q, k = qkv[0, tt, :32].double(), qkv[0, tt, 32:64].double()
        q, k = q / math.sqrt(float((q * q).sum()) + 1e-6) / math.sqrt(32), k / math.sqrt(float((k * k).sum()) + 1e-6)
        for h in range(2):                                               # both v heads use k head 0
            gg = -math.exp(float(a_log[h])) * math.log1p(math.exp(float(a[0, tt, h]) + float(dt[h])))
            beta = 1 / (1 + math.exp(-float(b[0, tt, h])))
            S[h] *= math.exp(gg)
            u = S[h].T @ k
            S[h] += torch.outer(k, beta * (qkv[0, tt, 64 + 32 * h:96 + 32 * h].double() - u))
            assert torch.allclose(o[0, tt, h].double(), S[h].T @ q, atol=1e-4)
    fold = gdn_step.Key(1, 2, 32, 32, 1, 3, "fold", 1, "sm_86")
    _, folded, _ = gdn_step.reference(fold, state, slots, rec=rec, commit=torch.tensor([3]))
    assert torch.allclose(folded[1].double(), S, atol=1e-4)
    _, same, _ = gdn_step.reference(fold, state, slots, rec=rec, commit=torch.tensor([0]))
    assert torch.equal(same, state)


def test_rope_and_kv_quantisation_are_loops():
    freqs = qk_rope_kv.inv_freq(1e7, 16)
    assert torch.allclose(freqs, torch.tensor([1e7 ** (-2 * m / 16) for m in range(8)]), rtol=1e-6)
    x = torch.randn(1, 1, 64, generator=gen())
    y = qk_rope_kv.rope(x, torch.tensor([5]), freqs, 16)[0, 0]
    for m in range(8):
        c, s = math.cos(5 * float(freqs[m])), math.sin(5 * float(freqs[m]))
        assert abs(float(y[m]) - (float(x[0, 0, m]) * c - float(x[0, 0, m + 8]) * s)) < 1e-5
        assert abs(float(y[m + 8]) - (float(x[0, 0, m + 8]) * c + float(x[0, 0, m]) * s)) < 1e-5
    assert torch.equal(y[16:], x[0, 0, 16:])
    codes, scales = qk_rope_kv.quantize_kv(torch.cat([x[0, 0], torch.zeros(64)]))
    sc = float(torch.tensor(float(x.abs().max()) / 127).half())
    assert float(scales[0]) == sc and float(scales[1]) == 0 and not codes[64:].any()
    assert all(int(codes[i]) == max(-127, min(127, round(float(x[0, 0, i]) / sc))) for i in range(64))


def _rope_kv_inputs(key, g):
    """Random q/k/v and norms, distinct positions in 4 pages of each sequence, and pages of key's KV dtype."""
    rows, n_pages = key.b * key.t, 4 * key.b
    q = torch.randn(rows, key.hq, 2 * key.d, generator=g).bfloat16()
    k, v = (torch.randn(rows, key.hkv, key.d, generator=g).bfloat16() for _ in range(2))
    q_norm, k_norm = ((0.1 * torch.randn(key.d, generator=g)).bfloat16() for _ in range(2))
    pos = torch.cat([torch.randperm(4 * key.page, generator=g)[:key.t] for _ in range(key.b)]).to(torch.int32)
    table = torch.randperm(n_pages, generator=g).view(key.b, 4).to(torch.int32)
    shape = (n_pages, key.hkv, key.page, key.d)
    if key.kv_dtype == "bf16":
        pages = {"k": torch.zeros(shape).bfloat16(), "v": torch.zeros(shape).bfloat16()}
    else:
        pages = {"k": torch.zeros(shape, dtype=torch.int8), "v": torch.zeros(shape, dtype=torch.int8),
                 "k_scales": torch.zeros(*shape[:3], key.d // 64).half(),
                 "v_scales": torch.zeros(*shape[:3], key.d // 64).half()}
    return q, k, v, q_norm, k_norm, qk_rope_kv.inv_freq(1e7, key.rd), pos, table, pages


@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_mrope_reference_with_equal_axes_is_the_1d_reference(kv_dtype, one_thread):
    """A row whose three M-RoPE positions are equal gets exactly the 1-D result: q_out and every page."""
    key = qk_rope_kv.Key(4, 2, 64, 16, 2, 3, kv_dtype, 64, 4, 1e-6, "sm_86")
    mkey = replace(key, mrope=(3, 3, 2))
    q, k, v, qn, kn, freqs, pos, table, pages = _rope_kv_inputs(key, gen(3))
    qo, po = qk_rope_kv.reference(key, q, k, v, qn, kn, freqs, pos, table, pages)
    mqo, mpo = qk_rope_kv.reference(mkey, q, k, v, qn, kn, freqs, pos, table, pages,
                                    rope_pos=pos.view(-1, 1).expand(-1, 3).contiguous())
    assert torch.equal(qo.view(torch.int16), mqo.view(torch.int16)) and po.keys() == mpo.keys()
    assert all(torch.equal(po[n].view(torch.uint8), mpo[n].view(torch.uint8)) for n in po)
    with pytest.raises(ValueError, match="rope_pos"):
        qk_rope_kv.reference(mkey, q, k, v, qn, kn, freqs, pos, table, pages)


@pytest.mark.parametrize("d,rd,section", [(64, 16, (3, 3, 2)), (256, 64, (11, 11, 10))])
def test_mrope_rotation_is_reference_vision_mrope(d, rd, section, one_thread):
    """The kernel reference's 3-axis rotation of normed fp32 values is reference_vision.mrope's, bit for bit."""
    g = gen(5)
    x = torch.randn(9, 3, d, generator=g)
    pos3 = torch.randint(0, 3000, (9, 3), generator=g, dtype=torch.int32)
    ours = qk_rope_kv.rope(x, pos3, qk_rope_kv.inv_freq(1e7, rd), rd, section)
    assert torch.equal(ours, reference_vision.mrope(x, pos3, rotary_dim=rd, theta=1e7, section=section))
    assert not torch.equal(ours, qk_rope_kv.rope(x, pos3[:, 0], qk_rope_kv.inv_freq(1e7, rd), rd))


def test_mrope_key_name_params_and_validation():
    key = qk_rope_kv.Key(24, 4, 256, 64, 1, 1, "int8", 64, 512, 1e-6, "sm_90")
    mkey = replace(key, mrope=[11, 11, 10])
    assert mkey.mrope == (11, 11, 10) and hash(mkey) and mkey.name == key.name[:-5] + "_mr11x11x10_sm90"
    assert [p.name for p in qk_rope_kv.params(mkey)] == [p.name for p in qk_rope_kv.params(key)] + ["rope_pos"]
    for bad in ((11, 11, 11), (16, 16), (-1, 17, 16)):
        with pytest.raises(ValueError, match="M-RoPE section"):
            replace(key, mrope=bad)


def test_embed_images_reference():
    """reference_vision.embed_images when every placeholder has its image token; past min(count, cap) the
    placeholders keep their rows."""
    g, h, token = gen(4), 64, 7
    y = torch.randn(10, h, generator=g).bfloat16()
    ids = torch.tensor([1, 7, 7, 2, 7, 3, 7, 7, 0, 7], dtype=torch.int32)
    images = torch.randn(8, h, generator=g).bfloat16()
    key = embed_images.Key(h, 10, 8, token, "sm_86")
    out = embed_images.reference(key, y, ids, images)
    assert torch.equal(out, reference_vision.embed_images(y, ids, images, token_id=token))
    assert torch.equal(out[[1, 2, 4, 6, 7, 9]], images[:6]) and torch.equal(out[[0, 3, 5, 8]], y[[0, 3, 5, 8]])
    two = embed_images.reference(key, y, ids, images, count=torch.tensor([2], dtype=torch.int32))
    assert torch.equal(two[[1, 2]], images[:2]) and torch.equal(two[3:], y[3:])
    small = embed_images.reference(replace(key, cap=4), y, ids, images[:4])
    assert torch.equal(small[:7], out[:7]) and torch.equal(small[7:], y[7:])
    assert torch.equal(embed_images.reference(key, y, ids, images, count=torch.zeros(1, dtype=torch.int32)), y)
    assert key.name == "embed_images_h64_m10_c8_t7_sm86"
    with pytest.raises(ValueError, match="embed_images"):
        embed_images.Key(60, 10, 8, token, "sm_86")


def test_attention_reference_is_a_loop():
    key = attn_decode.Key(4, 2, 64, 1, 2, "bf16", 64, 4, 1, True, "sm_86")
    g = gen()
    pages = {"k": torch.randn(4, 2, 64, 64, generator=g).bfloat16(), "v": torch.randn(4, 2, 64, 64, generator=g).bfloat16()}
    table, lens = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32), torch.tensor([70], dtype=torch.int32)
    q = torch.randn(1, 2, 4, 64, generator=g).bfloat16()
    gate = torch.randn(2, 4, 128, generator=g).bfloat16()
    out = attn_decode.reference(key, q, gate, pages, table, lens)
    for tt in range(2):
        for h in range(4):
            keys = range(70 - 2 + tt + 1)
            kv = lambda name, n: pages[name][int(table[0, n // 64]), h // 2, n % 64].double()  # noqa: E731
            sc = torch.tensor([float(q[0, tt, h].double() @ kv("k", n)) / 8 for n in keys])
            p = torch.softmax(sc, 0)
            o = sum(p[i] * kv("v", n) for i, n in enumerate(keys)) * torch.sigmoid(gate[tt, h, 64:].double())
            assert torch.allclose(out[0, tt, h].double(), o, atol=2e-2, rtol=2e-2)
