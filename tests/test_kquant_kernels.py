"""CPU tier for the GGUF k-quant kernels (issue 34 step 3): the decode GEMV on Q4_K/Q5_K/Q6_K blocks as
stored (templates/gemv_kq.cu.j2), the k-quant embedding gather, the tiled GDN head order fused into the
output norm — their torch references against compiler.kquant's dequantisation, a bit-level model of the
GEMV (tests/kq_emulator.py) against the same, keys and dispatch, and the plans of a Q4_K_M file.
Compiling them: tests/test_kernels_compile.py -k kquant; running them: tests/gpu/test_kquant_gpu.py."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from compiler.kernels import embed, gated_rmsnorm, gemv, gemv_rules
from compiler.kernels.weight_layout import pack_kquant_for_device
from compiler.kquant import KFORMATS, dequantize, random_kquant
from compiler.lower_rules import matmul_key
from compiler.targets import lookup
from kq_emulator import emulate

H200, RTX = lookup("h200"), lookup("rtx3090")
FMTS = list(KFORMATS)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_gemv_reference_is_dequantisation_then_matmul(fmt, epilogue):
    """gemv.reference on a KQTensor = x · dequantize(W)ᵀ in fp32, then the epilogue."""
    g = torch.Generator().manual_seed(1)
    n, k, m = 96, 512, 5
    w = random_kquant(fmt, n, k, g)
    x = torch.randn(m, k, generator=g).bfloat16()
    res = torch.randn(m, n, generator=g).bfloat16()
    key = gemv.make_key(fmt, n, k, m, RTX, epilogue, "f32")
    y = x.float() @ dequantize(w).T
    want = {"none": y, "residual": y + res.float(),
            "silu_mul": torch.nn.functional.silu(y[:, :n // 2]) * y[:, n // 2:]}[epilogue]
    assert torch.equal(gemv.reference(key, x, w, res), want)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k,m", [(40, 512, 1), (40, 768, 5), (24, 256, 16), (16, 512, 32), (16, 256, 9)])
def test_kernel_model_equals_dequantisation(fmt, n, k, m):
    """The bit-level model of gemv_kq.cu.j2 (every load, shift, PRMT and fragment as the template does
    them; Q6_K rows 2 bytes off a word boundary where K/256 is odd) equals x · dequantize(W)ᵀ on random
    blocks, M from one row to four column tiles (the activation-sum mma in pairs of them)."""
    g = torch.Generator().manual_seed(n * k + m)
    w = random_kquant(fmt, n, k, g, scale=1.0)
    x = torch.randn(m, k, generator=g).bfloat16()
    got = emulate(fmt, pack_kquant_for_device(w)["lo"], x, n)
    want = (x.double() @ dequantize(w).double().T).numpy()
    # fp32 dequantisation rounding only: a layout slip is O(1)
    assert np.abs(got - want).max() <= 1e-7 * np.abs(want).max()


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
@pytest.mark.parametrize("n,k,m", [(40, 512, 1), (40, 768, 5), (24, 256, 16), (16, 512, 32), (16, 256, 9)])
def test_lean_kernel_model_equals_dequantisation(fmt, n, k, m):
    """The same for key `kq_lean` (common/kq_lean.j2): the activations as loaded are the A fragment of the Σ x mma
    (rows g and g + 8 each a half of the sub-block, added in fp32), the scale byte is read under 0x43 as fp32
    128 + sc, the codes go in as 128 + q and the 128s leave with the scales' mma."""
    g = torch.Generator().manual_seed(n * k + m)
    w = random_kquant(fmt, n, k, g, scale=1.0)
    x = torch.randn(m, k, generator=g).bfloat16()
    got = emulate(fmt, pack_kquant_for_device(w)["lo"], x, n, lean=True)
    want = (x.double() @ dequantize(w).double().T).numpy()
    # S_J rounded to fp32 once more (the halves' add) before the 128s leave; a layout slip is O(1)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_kquant_gemv_keys():
    """A k-quant key: its own template, one super-block per unit (split-K in batches of WARPS units), one
    row tile per block and none of the streaming fields; the same (warps, splits, stream_k) at every M — the down
    projection on one stream-K wave (four blocks an SM) in place of its 3 splits."""
    keys = [gemv.make_key("q4_k", 5120, 17408, m, H200, "residual") for m in (1, 4, 8, 16, 32)]
    assert all(k.template == "gemv_kq.cu.j2" for k in keys)
    assert gemv.make_key("q4g64", 5120, 17408, 1, H200).template is None
    assert {(k.warps, k.splits, k.stream_k) for k in keys} == {(4, 1, 4 * H200.sms)}
    assert all(k.tiles == 1 and not (k.prefetch or k.interleave or k.stage_x) for k in keys)
    assert gemv.load_batches("q6_k", 17408, 4) == 17
    assert gemv.make_key("q6_k", 248320, 5120, 32, H200).tiles == 1
    with pytest.raises(ValueError, match="super-block"):
        gemv.make_key("q4_k", 1024, 320, 1, H200)
    for bad in ({"stage_x": True}, {"prefetch": 1}, {"interleave": True}, {"tiles": 2}):
        with pytest.raises(ValueError, match="one row tile per block"):
            replace(keys[0], **bad)


def test_kquant_stream_config():
    """The shipped k-quant fields (kernel lab and the GGUF step, sessions 18–19): Q5_K and Q6_K at M ≤ 8 ask for 3
    blocks per SM, except Q6_K's grids of 16+ blocks per SM; Q4_K and M > 8 keep 2. Every k-quant stages its
    weights (`stage_w` 2) at M ≤ 8; Q4_K and Q5_K take `code_bias` at every M (a row's bits never depend on M).
    An unsplit grid of 4–5 blocks an SM at M ≤ 8 asks for 5 (one wave; session 25) where five blocks' shared memory fits
    the SM: 10,240 rows on the H200's 132 SMs, not on the 3090 (100 KB an SM)."""
    cap = lambda fmt, n, m, t=H200: gemv.make_key(fmt, n, 5120, m, t).min_blocks     # noqa: E731
    assert [cap("q5_k", 10240, m) for m in (1, 4, 8, 16, 32)] == [5, 5, 5, 2, 2]
    assert [cap(f, 10240, 1) for f in ("q4_k", "q5_k", "q6_k")] == [5, 5, 5]
    on_3090 = [cap(f, n, 1, lookup("sm_86")) for f in ("q4_k", "q5_k", "q6_k") for n in (10240, 6144)]
    assert on_3090 == [2, 2, 3, 3, 3, 3]
    assert cap("q5_k", 12288, 1) == 3 and cap("q5_k", 1024, 1) == 3         # 5.8 blocks an SM; split (1,024 rows)
    assert cap("q5_k", 248320, 1) == 3 and cap("q6_k", 6144, 1) == 3
    assert cap("q6_k", 34816, 1) == 2 and cap("q6_k", 248320, 1) == 2 and cap("q4_k", 6144, 1) == 2
    for fmt in ("q4_k", "q5_k", "q6_k"):
        keys = [gemv.make_key(fmt, 6144, 5120, m, H200) for m in (1, 8, 9, 32)]
        assert [k.stage_w for k in keys] == [2, 2, 0, 0]
        assert [k.code_bias for k in keys] == [fmt != "q6_k"] * 4


def test_kquant_weight_staging_limits():
    """`stage_w` (weights staged in shared memory, stages per warp): every k-quant (a Q6_K row takes 14 chunks of
    16 bytes: its 2-byte aligned block and the bytes before it), 2..6 stages within its shared-memory limit;
    names itself."""
    key = gemv.make_key("q4_k", 34816, 5120, 16, H200, "silu_mul")
    assert key.stage_w == 0 and gemv.stage_w_bytes(key) == 0
    staged = gemv_rules.apply_overrides(key, "stage_w=4")
    assert staged.name.endswith("_sw4_cb_kl_sm90")
    assert gemv.stage_w_bytes(staged) == 4 * 4 * 16 * 144 <= gemv.STAGE_W_LIMIT
    assert gemv.stage_w_bytes(replace(key, fmt="q6_k", stage_w=2, code_bias=False, kq_lean=False)) == 2 * 4 * 16 * 224
    for fmt, sw in (("q6_k", 3), ("q4_k", 1), ("q4_k", 7), ("q5_k", 4)):       # 4 · 4 · 16 · 176 B: too many
        with pytest.raises(ValueError, match="stage_w"):
            replace(gemv.make_key(fmt, 34816, 5120, 1, H200, "silu_mul"), stage_w=sw)
    for fmt in ("bf16", "q4g64"):       # a process-wide rule leaves the other families' keys as they are
        plain = gemv.make_key(fmt, 6144, 5120, 1, H200)
        assert gemv_rules.apply_overrides(plain, "stage_w=2") == plain
        with pytest.raises(ValueError, match="needs a k-quant"):
            replace(plain, stage_w=2)


def test_kquant_stream_k_grids():
    """`stream_k` (config: a split k-quant grid becomes one wave of blocks over the units flattened tile-major): the
    down projections on both cards (sm_86: Q6_K two blocks an SM by shared memory), never the unsplit or
    under-32-units-a-block shapes nor the group-64 formats; a launch of G blocks, a workspace of one 16-row partial
    per (block, tile) slot; 128 registers at M ≤ 8 where four blocks an SM were counted; K splits by rule replace
    the grid; bad grids refused."""
    rtx = lookup("rtx3090")
    got = {(f, t.arch): gemv.make_key(f, 5120, 17408, 1, t, "residual").stream_k for f in ("q4_k", "q6_k") for t in (H200, rtx)}
    assert got == {("q4_k", "sm_90"): 528, ("q6_k", "sm_90"): 528, ("q4_k", "sm_86"): 328, ("q6_k", "sm_86"): 164}
    for f, n, k in (("q4_k", 5120, 6144), ("q4_k", 1024, 5120), ("q4g64", 5120, 17408), ("q4_k", 34816, 5120)):
        assert gemv.make_key(f, n, k, 1, H200, "residual").stream_k == 0
    key = gemv.make_key("q6_k", 5120, 17408, 1, H200, "residual")
    assert key.splits == 1 and key.min_blocks == 4 and key.name.endswith("_sk528_sm90")
    assert gemv.make_key("q6_k", 5120, 17408, 16, H200, "residual").min_blocks == 2     # loaded: no cap
    assert gemv.launch(key).grid == (528, 1, 1)
    assert gemv.workspace(key) == {"ws": 4 * (528 + 320) * 16, "tickets": 4 * 320}
    assert gemv_rules.apply_overrides(key, "splits=3").splits == 3
    assert gemv_rules.apply_overrides(key, "splits=3").stream_k == 0
    for bad in ({"splits": 3}, {"stream_k": 320 * 68 + 1}, {"fmt": "q4g64", "stage_w": 0, "q6_lean": False}):
        with pytest.raises(ValueError, match="stream_k"):
            replace(key, **bad)


def test_kquant_code_bias_only_for_formats_with_mins():
    """`code_bias` (codes + 128 into the mma, the 128s out with the mins' sums): Q4_K and Q5_K only; names itself."""
    key = gemv.make_key("q5_k", 10240, 5120, 1, H200)
    assert key.code_bias and key.name.endswith("_sw2_cb_kl_sm90")
    assert not replace(key, code_bias=False, kq_lean=False).name.endswith("_cb_sm90")
    for fmt in ("q6_k", "q4g64", "bf16"):
        with pytest.raises(ValueError, match="code_bias needs a k-quant with mins"):
            replace(gemv.make_key(fmt, 1024, 5120, 1, H200), code_bias=True)


def test_kquant_lean_needs_code_bias():
    """`kq_lean` (the Q4_K/Q5_K unit math in fewer instructions, common/kq_lean.j2) is on in the shipped Q4_K and
    Q5_K keys at every M (a row's bits never depend on M), needs code_bias (so no Q6_K or group-64 key takes it: a
    process-wide rule passes them on), and names itself; `kq_lean=0` gives code_bias alone."""
    for fmt in ("q4_k", "q5_k"):
        for m in (1, 8, 9, 32):
            assert gemv.make_key(fmt, 34816, 5120, m, H200, "silu_mul").kq_lean
    key = gemv.make_key("q4_k", 34816, 5120, 1, H200, "silu_mul")
    alone = gemv_rules.apply_overrides(key, "kq_lean=0")
    assert key.name.endswith("_sw2_cb_kl_sm90") and alone == replace(key, kq_lean=False) and alone.code_bias
    with pytest.raises(ValueError, match="kq_lean needs code_bias"):
        replace(key, code_bias=False, kq_lean=True)
    for fmt in ("q6_k", "q4g64"):
        plain = gemv.make_key(fmt, 6144, 5120, 1, H200)
        assert gemv_rules.apply_overrides(plain, "kq_lean=1") == plain


def test_q6_lean_is_q6_k_only_and_shipped_at_every_m():
    """`q6_lean` (Q6_K's unit math in fewer instructions, the same bits: tests/gpu/test_kquant_gpu.py) is on in the
    shipped Q6_K keys at every M, names itself, stages block rows of 17 chunks (272 bytes: conflict-free reads), and
    no other format takes it (a process-wide rule passes them on)."""
    for m in (1, 8, 9, 32):
        key = gemv.make_key("q6_k", 5120, 17408, m, H200, "residual")
        assert key.q6_lean and "_ql" in key.name
    staged = gemv.make_key("q6_k", 34816, 5120, 1, H200, "silu_mul")
    assert staged.stage_w == 2 and gemv.stage_w_bytes(staged) == 2 * 4 * 16 * 272 <= gemv.STAGE_W_LIMIT
    assert gemv_rules.apply_overrides(staged, "q6_lean=0") == replace(staged, q6_lean=False)
    for fmt in ("q4_k", "q5_k", "q4g64"):
        plain = gemv.make_key(fmt, 6144, 5120, 1, H200)
        assert not plain.q6_lean and gemv_rules.apply_overrides(plain, "q6_lean=1") == plain
        with pytest.raises(ValueError, match="q6_lean is Q6_K's"):
            replace(plain, q6_lean=True)


def test_step_rules_see_the_folded_keys():
    """An experiment rule (CompileOptions.gemv) applies to a projection's key after the passes' folds, where the key's
    own checks judge it: a stream-K grid on the Q5_K GDN input reaches the verify's key but passes the step's, whose
    conv fold (the one-token GDN conv in its epilogue) takes no stream-K grid — once applied before the fold, the
    rule failed the plan."""
    from compiler.buckets import plan_bucket, profile_of
    from compiler.options import CompileOptions
    from gguf_fixtures import kquant_spec, q4_k_m_recipe

    spec = q4_k_m_recipe(kquant_spec())

    def q5_k(entry, tokens, rule):
        plan = plan_bucket(spec, H200, entry, 1, tokens, profile_of(spec, options=CompileOptions(gemv=rule)))
        return [k for k in plan.keys() if k.family == "gemv" and k.fmt == "q5_k"]
    rule = "q5_k:splits=1,stream_k=3"
    step, verify = q5_k("step", 1, rule), q5_k("verify", 4, rule)
    assert step == q5_k("step", 1, "") and step and all(k.conv and not k.stream_k for k in step)
    assert verify and all(k.stream_k == 3 and not k.conv for k in verify)


def test_device_layout_is_the_blocks_in_tile_order():
    """pack_kquant_for_device: the blocks, each byte for byte, rows padded to 48 (and gate/up interleaved), in 16-row
    tile order — row r's super-block u of tile T at ((T·U + u)·16 + r)·QB, what common/kquant.cuh's kq_block_offset
    and kq_emulator.block_offset address; kquant_tile_order(inverse=True) and unpack_kquant_from_device undo it."""
    from compiler.kernels.weight_layout import _gate_up_perm, kquant_tile_order, unpack_kquant_from_device
    from kq_emulator import block_offset

    g = torch.Generator().manual_seed(3)
    for fmt, n, gate_up in (("q4_k", 40, False), ("q6_k", 40, False), ("q5_k", 48, True)):
        w = random_kquant(fmt, n, 768, g)
        qb = w.blocks.shape[1] // 3
        rows = w.blocks[_gate_up_perm(n)] if gate_up else w.blocks
        lo = pack_kquant_for_device(w, gate_up=gate_up)["lo"]
        assert lo.numel() == 48 * 3 * qb
        for r in range(48):
            for u in range(3):
                got = lo[block_offset(r, u, 3, qb):][:qb]
                assert torch.equal(got, rows[r, u * qb:(u + 1) * qb] if r < n else torch.zeros_like(got)), (fmt, r, u)
        back = kquant_tile_order(lo, fmt, 48, 768, inverse=True).view(48, -1)
        assert torch.equal(back[:n], rows) and not back[n:].any()
        assert torch.equal(unpack_kquant_from_device({"lo": lo}, fmt, n, 768, gate_up=gate_up).blocks, w.blocks)


def test_matmul_dispatch_of_kquants():
    """Up to 32 rows the k-quant GEMV, above the mma.sync GEMM on the blocks as stored (gemm_kq.cu.j2; never
    the Hopper warpgroup GEMM), whose warp tiles stay within 4 token tiles and whose ring fits the card."""
    from compiler.kernels import gemm
    assert matmul_key("q5_k", 10240, 5120, 32, H200).family == "gemv"
    for target in (H200, RTX, lookup("a100")):
        for fmt in FMTS:
            for m in (33, 256, 4096):
                key = matmul_key(fmt, 34816, 5120, m, target, "silu_mul")
                assert key.family == "gemm" and key.template == "gemm_kq.cu.j2" and key.nt <= 4
                assert gemm.launch(key).smem <= target.smem_per_block and key.stages >= 2
    with pytest.raises(ValueError, match="at most 4 token tiles"):
        replace(matmul_key("q4_k", 1024, 512, 1024, H200), nt=6)


@pytest.mark.parametrize("fmt", FMTS)
def test_embed_reference_of_kquant_tables(fmt):
    g = torch.Generator().manual_seed(3)
    table = random_kquant(fmt, 64, 512, g)
    ids = torch.tensor([5, 0, 63, 5], dtype=torch.int32)
    key = embed.Key(fmt, 512, 4, "sm_86")
    assert torch.equal(embed.reference(key, ids, table), dequantize(table)[ids.long()].to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 256"):
        embed.Key(fmt, 320, 1, "sm_86")


def test_gated_norm_reference_writes_tiled_heads():
    """key_heads > 0: head kh·G + j of the norm lands at head j·key_heads + kh (the prim's reference too)."""
    from compiler.reference_fused import gated_rmsnorm_tiled
    g = torch.Generator().manual_seed(4)
    m, hv, dv, nk = 3, 6, 32, 2
    o, z, w = torch.randn(m, hv, dv, generator=g), torch.randn(m, hv * dv, generator=g), torch.randn(dv, generator=g)
    plain = gated_rmsnorm.reference(gated_rmsnorm.Key(hv, dv, m, 1e-6, "sm_86"), o, z, w.bfloat16())
    tiled = gated_rmsnorm.reference(gated_rmsnorm.Key(hv, dv, m, 1e-6, "sm_86", nk), o, z, w.bfloat16())
    for h in range(hv):
        kh, j = divmod(h, hv // nk)
        assert torch.equal(tiled.view(m, hv, dv)[:, j * nk + kh], plain.view(m, hv, dv)[:, h])
    prim = gated_rmsnorm_tiled(o, z.view(m, hv, dv), w, eps=1e-6, key_heads=nk)
    assert prim.shape == (m, hv // nk, nk, dv)
    with pytest.raises(ValueError, match="do not tile"):
        gated_rmsnorm.Key(hv, dv, m, 1e-6, "sm_86", 4)


@pytest.mark.usefixtures("one_thread")
def test_tiled_heads_fuse_into_the_gdn_norm():
    """A tiled spec's transpose disappears into gated_rmsnorm_tiled in every graph the plans lower, and the
    fused graph computes what the traced one does (the reference interpreter on both, bit for bit)."""
    from compiler.interpret import run_graph
    from compiler.passes import fuse_tiled_heads, run_pipeline
    from compiler.reference_ops import torch_dtype
    from compiler.trace import StatePools, state_avals, trace
    from gguf_fixtures import kquant_spec, q4_k_m_recipe
    from ninfer_gen.weights.random_weights import random_weights

    spec = q4_k_m_recipe(kquant_spec())
    pools = StatePools(num_pages=8, num_slots=1, pages_per_seq=8, kv_dtype="int8")
    g = trace(spec, "prefill", 1, 12, pools)
    fused = fuse_tiled_heads(g)
    assert sum(e.prim == "transpose" for e in g.eqns) == 3 and not any(e.prim == "transpose" for e in fused.eqns)
    assert sum(e.prim == "gated_rmsnorm_tiled" for e in fused.eqns) == 3
    assert not any(e.prim == "transpose" for e in run_pipeline(trace(spec, "step", 2, 1, pools)).eqns)
    gen = torch.Generator().manual_seed(2)
    inputs = {"tokens": torch.randint(0, spec.model.vocab_size, (1, 12), generator=gen, dtype=torch.int32),
              "pos": torch.tensor([5], dtype=torch.int32), "slots": torch.tensor([0], dtype=torch.int32),
              "block_table": torch.arange(8, dtype=torch.int32).reshape(1, 8)}
    weights = random_weights(spec)
    states = [{n: torch.zeros(shape, dtype=torch_dtype(dt)) for n, (shape, dt) in state_avals(spec, pools).items()}
              for _ in range(2)]
    o1, o2 = (run_graph(graph, inputs, weights, st) for graph, st in zip((g, fused), states))
    assert all(torch.equal(o1[k], o2[k]) for k in o1)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("units", [1, 3, 20])
def test_gemm_q6_k_stage_slots_hold_each_block(units):
    """gemm_kq.cu.j2's Q6_K staging, transcribed: 14 pieces of ≤ 16 bytes from the 16-byte boundary below a
    210-byte block (the last piece cut at the block's end, so the plane's last block reads nothing past
    it); its words at `mis` + 16s + 4t, put right by slot_word, are the block's bytes, d at `mis` + 208."""
    from kq_emulator import funnelshift_r

    qb, rows = 210, 24
    plane = bytes(np.random.default_rng(units).integers(0, 256, rows * units * qb, dtype=np.uint8))
    for row in range(rows):
        for u in range(units):
            off = (row * units + u) * qb
            slot, mis = bytearray(224), off & 15
            for ch in range(14):
                src = (off & ~15) + 16 * ch
                n = min(16, off + qb - src)
                assert n >= 2 and src + n <= len(plane)
                slot[16 * ch:16 * ch + n] = plane[src:src + n]
            block = plane[off:off + qb]

            def word(o):
                lo = int.from_bytes(slot[o & ~3:(o & ~3) + 4], "little")
                hi = int.from_bytes(slot[(o & ~3) + 4:(o & ~3) + 8], "little")
                return funnelshift_r(lo, hi, (o & 3) * 8)
            for s in range(13):
                for t in range(4):
                    assert word(mis + 16 * s + 4 * t) == int.from_bytes(block[16 * s + 4 * t:16 * s + 4 * t + 4], "little")
            assert slot[mis + 208:mis + 210] == block[208:210]


@pytest.mark.parametrize("fmt,units", [("q4_k", 1), ("q4_k", 20), ("q5_k", 3), ("q5_k", 68)])
def test_staging_copies_every_block_byte_of_a_unit_once(fmt, units):
    """templates/gemv_kq.cu.j2 `stage_w` on Q4_K/Q5_K, its index math transcribed: lane l's chunk j of any unit goes
    to 16·(l + 32j) in the stage and comes from its per-kernel offset r·RB + 16c past the unit's first row's block
    (stage_lane), so the stage is the unit's 16 block rows back to back, every byte once, nothing else read."""
    qb = {"q4_k": 144, "q5_k": 176}[fmt]
    cpr, rb = qb // 16, units * qb
    nj = (16 * cpr + 31) // 32
    rng = np.random.default_rng(units)
    mem = rng.integers(0, 256, 32 * rb, dtype=np.uint8).tobytes()
    for row0 in (0, 16):
        for u in range(units):
            unit, st, written = row0 * rb + u * qb, bytearray(16 * qb), []
            for lane in range(32):
                for j in range(nj):
                    i = lane + 32 * j
                    r = i // cpr
                    src = r * rb + 16 * (i - r * cpr)
                    if 32 * j + 31 < 16 * cpr or i < 16 * cpr:
                        st[16 * i:16 * i + 16] = mem[unit + src:unit + src + 16]
                        written.append(16 * i)
            assert sorted(written) == list(range(0, 16 * qb, 16))
            assert bytes(st) == b"".join(mem[(row0 + r) * rb + u * qb:][:qb] for r in range(16))


def test_gemm_reads_scales_and_mins_as_the_reference_decodes_them():
    """gemm_kq.cu.j2's byte-wise scale_of (and the word-wise mins both templates use), transcribed, against
    compiler.kquant's 6-bit unpacking on every byte pattern's neighbourhood (random headers)."""
    from compiler.kquant import _scale_min_k4
    from kq_emulator import and_or

    heads = torch.randint(0, 256, (512, 12), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    sc, mn = _scale_min_k4(heads)
    for b in range(heads.shape[0]):
        q = [0, 0, 0, 0] + heads[b].tolist()                 # slot bytes 4..15 hold the 12 scale bytes
        for j in range(8):
            got = q[4 + j] & 63 if j < 4 else (q[8 + j] & 15) | ((q[j] >> 6) << 4)
            assert got == sc[b, j]
        z, w = (int.from_bytes(bytes(q[o:o + 4]), "little") for o in (8, 12))
        for t in range(4):
            word = z & 0x3F3F3F3F if t < 2 else and_or(w >> 4, 0x0F0F0F0F, (z >> 2) & 0x30303030)
            assert [(word >> (8 * ((2 * t + i) & 3))) & 0xFF for i in (0, 1)] == mn[b, 2 * t:2 * t + 2].tolist()


@pytest.mark.parametrize("units", [1, 3, 20])
def test_q6_k_staging_gives_each_lane_the_words_of_its_block(units):
    """templates/gemv_kq.cu.j2 `stage_w` on Q6_K, its index math transcribed: 14 chunks of 16 bytes from each block
    row's start rounded down to 16 (the last cut to the block's end, zero-filled) hold the whole block and read
    nothing past it; word t of segment s read back as two aligned words and a funnel shift is the block's bytes
    16s + 4t … + 3 (what load_unit + kq_realign give), and d is bytes 208-209 — at every row offset mod 16."""
    qb, rs, cpr = 210, 224, 14
    rb = units * qb
    rng = np.random.default_rng(units)
    mem = rng.integers(0, 256, 32 * units * qb, dtype=np.uint8).tobytes()
    for row0 in (0, 16):
        tile, tile_lo = row0 * rb, (row0 * rb) % 2**32          # the tile's first row, its offset mod 2^32
        for u in range(units):
            st = bytearray(16 * rs)
            for i in range(16 * cpr):                          # lane l copies chunks l, l + 32, … (224 = 7 · 32)
                r, c = divmod(i, cpr)
                rel = r * rb + u * qb                          # stage_unit's 32-bit offset from the tile
                o = (tile_lo + rel) % 2**32 & 15
                n, src = min(16, o + qb - 16 * c), tile + rel - o + 16 * c
                blk = ((row0 + r) * units + u) * qb
                assert o == blk & 15 and src == blk - o + 16 * c    # what the block's own offset gives
                assert n >= 2 and src + n <= len(mem)
                st[r * rs + 16 * c:r * rs + 16 * c + 16] = mem[src:src + n] + bytes(16 - n)
            for r in range(16):
                blk = ((row0 + r) * units + u) * qb
                o = blk & 15
                word = lambda k: int.from_bytes(st[r * rs + (o & ~3) + 4 * k:][:4], "little")    # noqa: E731
                for s in range(13):
                    for t in range(4):
                        got = ((word(4 * s + t + 1) << 32 | word(4 * s + t)) >> (8 * (o & 2))) & 0xFFFFFFFF
                        assert got == int.from_bytes(mem[blk + 16 * s + 4 * t:][:4], "little")
                assert st[r * rs + o + 208:r * rs + o + 210] == mem[blk + 208:blk + 210]
