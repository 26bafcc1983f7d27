"""GPU tier for the kernel families: every family against its torch reference on fresh random inputs
(tiny and 27B shapes, outputs poisoned), batch invariance, graph replay == eager, the compute_86 PTX
running on this GPU, and on Hopper the warpgroup GEMM (gemm_wg) at ragged shapes, every tiling and
with zero-scale groups. The stateful families' fold checks are in test_kernels_seq_gpu.py.
Run: pytest -m gpu tests/gpu -q   (test ids name the family and the shape)."""
import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from compiler.kernels import gdn_chunk, gdn_conv, gemm, gemm_wg, gemv, xperm
from compiler.kernels.weight_layout import pack_for_device, random_qmatrix
from compiler.spec import load_spec
from compiler.targets import lookup
from harness import TARGET
from lab.cases import case_keys, gemv_workspace, make_case

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TINY = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")
BIG = load_spec(ROOT / "model_specs/qwen3.8-27b.yaml")


def _keys(spec, big: bool):
    keys = [k for k in case_keys(spec, TARGET) if k.family != "attn_combine"]
    if big:   # every 27B shape, at M = 1, 8, 32 for the GEMMs
        keys = [k for k in keys if k.family != "gemv" or k.m in (1, 8, 32)]
    a = spec.model
    keys += [gemv.make_key("q6g64", a.hidden_size, a.intermediate_size, m, TARGET, "residual") for m in (1, 32)]
    return keys


# Prefill GEMM edge shapes: M a multiple of 16 but not of the token tile, N not of the row tile.
GEMM_ODD = [gemm.make_key(*shape, TARGET, epi, out) for *shape, epi, out in (
    ("q4g64", 1040, 256, 16, "silu_mul", "bf16"), ("q4g64", 1040, 256, 48, "silu_mul", "bf16"),
    ("q4g64", 1040, 256, 1040, "silu_mul", "bf16"), ("q5g64", 200, 320, 48, "residual", "bf16"),
    ("q5g64", 5120, 17408, 1040, "residual", "bf16"), ("q6g64", 72, 128, 1040, "none", "bf16"),
    ("w8g32", 1000, 96, 48, "none", "bf16"), ("w8g32", 4112, 512, 1040, "none", "f32"),
    ("bf16", 96, 192, 1040, "none", "f32"), ("q4g64", 12, 64, 16, "none", "f32"))]
# Every tiling the config may pick (rings of 2–4 stages), on one ragged residual shape.
GEMM_TILINGS = [replace(gemm.make_key("q6g64", 200, 320, 80, TARGET, "residual"), wr=wr, wc=wc, nt=nt, stages=st)
                for i, (wr, wc, nt) in enumerate(gemm.TILINGS) for st in (2 + i % 3, 4 - i % 3)]

# Hopper warpgroup GEMM (sm_90 only): ragged M and N, every format, every tiling with 3 and 4 stages.
GEMM_WG = [] if not gemm_wg.arch_supported(TARGET.arch) else list(dict.fromkeys(
    [gemm_wg.make_key(*shape, TARGET, epi, out) for *shape, epi, out in (
        ("q4g64", 1040, 256, 1040, "silu_mul", "bf16"), ("q4g64", 1040, 256, 80, "silu_mul", "bf16"),
        ("q5g64", 5120, 17408, 1040, "residual", "bf16"), ("q5g64", 200, 320, 100, "residual", "bf16"),
        ("q6g64", 72, 128, 1040, "none", "bf16"), ("bf16", 96, 192, 1040, "none", "f32"),
        ("q4g64", 12, 64, 64, "none", "f32"))]
    + [replace(gemm_wg.make_key("q6g64", 200, 320, 300, TARGET, "residual"), wgs=w, rt=r, bn=b, stages=st)
       for w, r, b in gemm_wg.TILINGS for st in (3, 4)]))

# Chunked GDN prefill: one chunk, many chunks, a ragged last chunk (t = 1040), both chunk sizes.
GDN_CHUNK = list(dict.fromkeys(
    [gdn_chunk.make_key(*shape, t, TARGET, chunk=c) for shape in ((2, 6, 32, 32), (16, 48, 128, 128))
     for t in (64, 1024, 1040) for c in (32, 64)]))

CASES = [(k, 0) for k in _keys(TINY, False)] + [(k, 1) for k in _keys(BIG, True)] + \
    [(k, 2) for k in GEMM_ODD + GEMM_TILINGS + GEMM_WG] + [(k, 3) for k in GDN_CHUNK]


@pytest.fixture(scope="session")
def h():
    import harness
    harness.build([k for k, _ in CASES])
    return harness


@pytest.mark.parametrize("key,seed", CASES, ids=[f"{k.family}-{k.name}" for k, _ in CASES])
def test_family_matches_reference(h, key, seed):
    case = make_case(key, "cuda", seed)
    h.run(case)
    h.compare(case, key.name)


@pytest.mark.parametrize("fmt,n,k", [("q4g64", 34816, 5120), ("q5g64", 5120, 17408), ("q6g64", 1024, 5120),
                                     ("w8g32", 248320, 5120), ("bf16", 96, 5120), ("q4g64", 512, 128)])
def test_gemv_batch_invariance(h, fmt, n, k):
    """A row's bits do not depend on M: M = 1, 4, 32 share weights and leading rows."""
    g = torch.Generator(device="cuda").manual_seed(7)
    w = random_qmatrix(fmt, n, k, g)
    packed = pack_for_device(w)
    x = torch.randn(32, k, generator=g, device="cuda").bfloat16()
    outs = {}
    for m in (1, 4, 32):
        key = gemv.make_key(fmt, n, k, m, TARGET, out_dtype="f32")
        y = torch.full((m, n), float("nan"), device="cuda")
        ws, tickets = gemv_workspace(key, "cuda")
        args = [y, x[:m].contiguous(), packed["lo"], packed["hi"] if packed["hi"].numel() else None,
                packed["scales"] if packed["scales"].numel() else None, None, ws, tickets]
        h.kernel_for(key).bind(gemv.params(key), args, gemv.launch(key)).launch()
        outs[m] = (y, tickets)
    torch.cuda.synchronize()
    assert all(t is None or not t.any() for _, t in outs.values()), f"{fmt} {n}x{k}: tickets not re-armed"
    outs = {m: y for m, (y, _) in outs.items()}
    assert h.same_bits(outs[1][0], outs[32][0]), f"{fmt} {n}x{k}: row 0 differs between M=1 and M=32"
    assert h.same_bits(outs[4], outs[32][:4]), f"{fmt} {n}x{k}: rows 0-3 differ between M=4 and M=32"


@pytest.mark.parametrize("fmt,n,k,epi,out", [("q5g64", 5120, 17408, "residual", "bf16"),
                                             ("q5g64", 5120, 6144, "residual", "bf16"),
                                             ("q5g64", 128, 256, "residual", "bf16"),
                                             ("q4g64", 34816, 5120, "silu_mul", "bf16"),
                                             ("q5g64", 6144, 5120, "none", "bf16"), ("bf16", 48, 5120, "none", "f32"),
                                             ("q4g64", 1024, 5120, "none", "bf16"), ("q4g64", 512, 128, "none", "bf16")])
def test_folded_norm_gemvs_are_batch_invariant(h, fmt, n, k, epi, out):
    """The split RMSNorm's GEMVs (a residual projection with `norm_out`, the readers with `scale_in`): a
    row's every output — y, and xn and the tile sums of squares — has the same bits at M = 1, 4 and 32
    (M = 32 reads its rows' sums straight from global memory, M ≤ 8 through shared memory), and the
    key with activation staging toggled (`stage_x`, where valid) gives the bits of the shipped one, as do the M = 32
    key's row-tile and load-depth variants (`tiles`, `depth`: the verify's experiment rules)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    packed = pack_for_device(random_qmatrix(fmt, n, k, g), gate_up=epi == "silu_mul")
    x = torch.randn(32, k, generator=g, device="cuda").bfloat16()
    res = torch.randn(32, n, generator=g, device="cuda").bfloat16() if epi == "residual" else None
    norm_w = (0.1 * torch.randn(n, generator=g, device="cuda")).bfloat16()
    ssq = torch.randn(32, k, generator=g, device="cuda").pow(2).reshape(32, k // 16, 16).sum(-1)
    fields = {"norm_out": True} if epi == "residual" else {"scale_in": True, "eps": 1e-6}
    keys = [replace(gemv.make_key(fmt, n, k, m, TARGET, epi, out), **fields) for m in (1, 4, 32)]
    staged = {key.m: t for key in keys if (t := _stage_x_toggled(key))}     # m → the key with stage_x toggled
    tiled = [t for fields in ({"tiles": 1, "depth": 0}, {"tiles": 2, "depth": 1}, {"tiles": 4, "depth": 1},
                              {"tiles": 3, "depth": 2}, {"x_early": True, "depth": 1}, {"x_early": True, "min_blocks": 1})
             if (t := _variant(keys[-1], **fields)) and t != keys[-1]]
    cache = _variant_cache()
    cache.build(keys + list(staged.values()) + tiled)
    outs, outs_staged, outs_tiled = {}, {}, []
    for key in keys + list(staged.values()) + tiled:
        m, toggled = key.m, key is staged.get(key.m)
        y = torch.full((m, n // 2 if epi == "silu_mul" else n), float("nan"), device="cuda",
                       dtype=torch.float32 if out == "f32" else torch.bfloat16)
        ws, tickets = gemv_workspace(key, "cuda")
        args = [y, x[:m].contiguous(), packed["lo"], packed["hi"] if packed["hi"].numel() else None,
                packed["scales"] if packed["scales"].numel() else None,
                None if res is None else res[:m].contiguous(), ws, tickets]
        got = {"y": y}
        if key.norm_out:
            got["xn"] = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            got["ssq"] = torch.full((m, n // 16), float("nan"), device="cuda")
            args += [got["xn"], got["ssq"], norm_w]
        else:
            args.append(ssq[:m].contiguous())
        cache.bind(key, args).launch()
        if key in tiled:
            outs_tiled.append((key, got))
        else:
            (outs_staged if toggled else outs)[m] = got
    torch.cuda.synchronize()
    assert staged, f"{fmt} {n}x{k}: no staged variant"
    assert tiled, f"{fmt} {n}x{k}: no row-tile variant"
    for key, got in outs_tiled:
        for name in got:
            assert h.same_bits(got[name], outs[32][name]), f"{key.name}: {name} differs from the shipped key"
    for m, got in outs_staged.items():
        for name in got:
            assert h.same_bits(got[name], outs[m][name]), f"{staged[m].name}: {name} differs from the shipped key"
    for name in outs[1]:
        assert not torch.isnan(outs[32][name].float()).any(), f"{fmt} {n}x{k}: {name} not written"
        assert h.same_bits(outs[1][name][0], outs[32][name][0]), f"{fmt} {n}x{k}: {name} row 0, M=1 vs 32"
        assert h.same_bits(outs[4][name], outs[32][name][:4]), f"{fmt} {n}x{k}: {name} rows 0-3, M=4 vs 32"


@pytest.mark.parametrize("fmt,n,k,m", [("q4g64", 10240, 5120, 1), ("q4g64", 10240, 5120, 8), ("q4g64", 320, 128, 4),
                                       ("q4g64", 320, 128, 32)])
def test_conv_in_the_gemv_equals_gemv_then_conv_kernel(h, fmt, n, k, m):
    """The one-token GDN conv in the qkv GEMV's epilogue gives the bits of the GEMV followed by the
    gdn_conv 'update' kernel: the output and the new slot history (a padded row left untouched)."""
    g = torch.Generator(device="cuda").manual_seed(13)
    packed = pack_for_device(random_qmatrix(fmt, n, k, g))
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    taps = (0.5 * torch.randn(n, 4, generator=g, device="cuda")).bfloat16()
    hist0 = torch.randn(m + 2, 3, n, generator=g, device="cuda").bfloat16()
    slots = torch.randperm(m + 2, generator=g, device="cuda")[:m].to(torch.int32)
    if m >= 2:
        slots[-1] = -1
    plain = gemv.make_key(fmt, n, k, m, TARGET)
    fused, conv = replace(plain, conv=4), gdn_conv.Key(n, m, 1, 4, "update", TARGET.arch)
    fused_staged = _stage_x_toggled(fused)
    cache = _variant_cache()
    cache.build([plain, fused, conv] + ([fused_staged] if fused_staged else []))
    planes = [packed["lo"], packed["hi"] if packed["hi"].numel() else None,
              packed["scales"] if packed["scales"].numel() else None, None, None, None]
    y_lin, y_two, y_one = (torch.zeros(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    hist_two, hist_one = hist0.clone(), hist0.clone()
    cache.bind(plain, [y_lin, x, *planes]).launch()
    cache.bind(conv, [y_two, y_lin, taps, hist_two, slots, None, None, None]).launch()
    cache.bind(fused, [y_one, x, *planes, taps, hist_one, slots]).launch()
    if fused_staged:
        y_staged, hist_staged = torch.zeros_like(y_one), hist0.clone()
        cache.bind(fused_staged, [y_staged, x, *planes, taps, hist_staged, slots]).launch()
    torch.cuda.synchronize()
    assert h.same_bits(y_one, y_two), f"{fused.name}: conv output differs from gemv + gdn_conv"
    assert h.same_bits(hist_one, hist_two), f"{fused.name}: history differs from gemv + gdn_conv"
    if fused_staged:
        assert h.same_bits(y_staged, y_one) and h.same_bits(hist_staged, hist_one), f"{fused_staged.name} differs"
    assert not torch.equal(hist_one, hist0)


def _variant(key, **fields):
    """`key` with `fields` replaced, or None where that is not a valid key."""
    try:
        return replace(key, **fields)
    except ValueError:
        return None


def _stage_x_toggled(key):
    """`key` with activation staging toggled, or None where that is not a valid key (too many rows to stage)."""
    try:
        return replace(key, stage_x=not key.stage_x)
    except ValueError:
        return None


@lru_cache(maxsize=1)
def _variant_cache():
    from ninfer_gen.executor.cuda_module import KernelCache
    from ninfer_gen.cli.env import build_root
    return KernelCache(build_root(), jobs=os.cpu_count())


GEMV_STREAMS = ({"interleave": True}, {"interleave": False}, {"prefetch": 0}, {"prefetch": 1},
                {"prefetch": 2, "interleave": True}, {"prefetch": 4},
                {"min_blocks": 3}, {"min_blocks": 4, "interleave": False}, {"stage_x": True},
                {"stage_x": False}, {"stage_x": True, "interleave": True},
                {"stage_x": True, "interleave": False, "min_blocks": 4},
                {"tiles": 2}, {"tiles": 2, "depth": 1}, {"tiles": 4, "depth": 1}, {"depth": 1}, {"depth": 2},
                {"tiles": 2, "depth": 2, "min_blocks": 1}, {"tiles": 3, "depth": 3}, {"x_early": True},
                {"x_early": True, "depth": 1}, {"x_early": True, "tiles": 3, "depth": 3, "min_blocks": 1})


@pytest.mark.parametrize("fmt,n,k,epi", [("q4g64", 34816, 5120, "silu_mul"), ("q5g64", 5120, 17408, "residual"),
                                         ("q5g64", 5120, 6144, "residual"), ("q6g64", 1024, 5120, "none"),
                                         ("w8g32", 4096, 5120, "none"), ("bf16", 96, 5120, "none"),
                                         ("q4g64", 512, 128, "none"), ("q5g64", 200, 320, "residual")])
@pytest.mark.parametrize("m", [1, 4, 32])
def test_gemv_stream_fields_give_the_same_bits(h, fmt, n, k, epi, m):
    """How units stream (L2 prefetch, interleaving, a register cap, activations staged in
    shared memory, row tiles per block, units per load batch, activations loaded with the weights) never changes
    a bit: every valid variant of
    the shipped key gives its output exactly,
    and writes every element."""
    g = torch.Generator(device="cuda").manual_seed(m)
    packed = pack_for_device(random_qmatrix(fmt, n, k, g), gate_up=epi == "silu_mul")
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    res = torch.randn(m, n, generator=g, device="cuda").bfloat16() if epi == "residual" else None
    base = gemv.make_key(fmt, n, k, m, TARGET, epi)
    keys = [base]
    for fields in GEMV_STREAMS:
        try:
            keys.append(replace(base, **fields))
        except ValueError:
            pass                                   # not a valid key at this shape
    cache = _variant_cache()                       # own cache: an M = 32 variant may spill (still the same bits),
    cache.build(keys)                              # which must not count against the shipped kernels' check
    outs = []
    for key in keys:
        y = torch.full((m, n // 2 if epi == "silu_mul" else n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws, tickets = gemv_workspace(key, "cuda")
        args = [y, x, packed["lo"], packed["hi"] if packed["hi"].numel() else None,
                packed["scales"] if packed["scales"].numel() else None, res, ws, tickets]
        cache.bind(key, args).launch()
        outs.append(y)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0].float()).any(), f"{base.name}: unwritten outputs"
    for key, y in zip(keys[1:], outs[1:]):
        assert h.same_bits(y, outs[0]), f"{key.name} differs from {base.name}"


def test_launcher_keeps_its_arguments_alive(h):
    """A launcher bound to tensors nobody else holds (here the split-K workspace) still launches right
    after other allocations: it keeps its arguments, so their memory is not handed out again."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = random_qmatrix("q5g64", 5120, 17408, g)
    packed = pack_for_device(w)
    x = torch.randn(1, 17408, generator=g, device="cuda").bfloat16()
    key = gemv.make_key("q5g64", 5120, 17408, 1, TARGET, out_dtype="f32")
    assert key.splits > 1

    def bound():
        y = torch.full((1, 5120), float("nan"), device="cuda")
        ws, tickets = gemv_workspace(key, "cuda")               # dropped on return: only the launcher holds them
        return y, h.KERNELS.bind(key, [y, x, packed["lo"], packed["hi"], packed["scales"], None, ws, tickets])
    pairs = [bound() for _ in range(8)]                          # each bind's allocations after the last's
    for _, launcher in pairs:
        launcher.launch()
    torch.cuda.synchronize()
    expected = gemv.reference(key, x, w)
    for y, _ in pairs:
        h._check_close(key.name + " (workspace held by the launcher only)", y, expected, "f32")


def test_gemm_output_may_alias_residual(h):
    """y = res (in-place residual add), as the runtime launches the down projection."""
    key = gemm.make_key("q5g64", 1040, 512, 1040, TARGET, "residual")
    case = make_case(key, "cuda", 4)
    y, x, lo, hi, sc, res = case.launches[0][1]
    expected = gemm.reference(key, x, _unpacked(case), res.clone())
    h.KERNELS.bind(key, [res, x, lo, hi, sc, res]).launch()
    torch.cuda.synchronize()
    h._check_close(key.name + " (y aliases res)", res, expected, "bf16")


@pytest.mark.skipif(not gemm_wg.arch_supported(TARGET.arch), reason="gemm_wg needs sm_90 (wgmma)")
@pytest.mark.parametrize("fmt", ["q4g64", "q5g64", "q6g64"])
def test_gemm_wg_zero_scale_groups(h, fmt):
    """Groups with a zero scale (all-zero weights, codes 0) — first, consecutive and last in a row, and
    whole rows — match the reference; all-zero rows give exact zeros."""
    g = torch.Generator(device="cuda").manual_seed(11)
    n, k, m = 256, 640, 192
    w = random_qmatrix(fmt, n, k, g)
    zero = torch.rand(n, k // 64, generator=g, device="cuda") < 0.3
    zero[:16, 0] = zero[16:32, 3:6] = zero[32:48, -1] = zero[48:64, :] = True
    w.scales[zero] = 0
    w.codes.view(n, k // 64, 64)[zero] = 0
    key = gemm_wg.make_key(fmt, n, k, m, TARGET, "none", "f32")
    packed = pack_for_device(w)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    y = torch.full((m, n), float("nan"), device="cuda")
    xp = torch.empty(k // 64, m, 64, device="cuda", dtype=torch.bfloat16)
    pkey = xperm.make_key(m, k, TARGET)
    h.launch_key(pkey, xperm, [xp, x])
    h.launch_key(key, gemm_wg, [y, xp, packed["lo"], packed["hi"] if packed["hi"].numel() else None,
                                 packed["scales"], None])
    torch.cuda.synchronize()
    h._check_close(key.name + " (zero-scale groups)", y, gemm_wg.reference(key, x, w), "bf16")
    assert not y[:, 48:64].any(), "all-zero rows must give exact zeros"


def _unpacked(case):
    """The logical weight a gemv/gemm case packed (read back from its planes)."""
    from compiler.kernels.weight_layout import unpack_from_device
    key, (y, x, lo, hi, sc, res) = case.launches[0]
    empty = torch.zeros(0, dtype=torch.uint8, device="cuda")
    planes = {"lo": lo, "hi": hi if hi is not None else empty,
              "scales": sc if sc is not None else torch.zeros(0, dtype=torch.float16, device="cuda")}
    return unpack_from_device(planes, key.fmt, key.n, key.k, gate_up=key.epilogue == "silu_mul")


@pytest.mark.parametrize("n,k", [(2048, 1024), (2048, 5120)], ids=["one-block", "split-k"])
def test_graph_replay_equals_eager(h, n, k):
    """Replays give the eager bits; split-K keys leave their tickets at zero after every replay."""
    key = gemv.make_key("q4g64", n, k, 4, TARGET, "silu_mul")
    case = make_case(key, "cuda", 5)
    h.run(case)
    eager = case.outputs["y"].clone()
    (launcher,) = h.launchers(case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher.launch()
    for _ in range(2):
        case.poison()
        graph.replay()
        torch.cuda.synchronize()
        assert h.same_bits(case.outputs["y"], eager)
        assert all(not t.any() for t in case.inplace.values()), "tickets not re-armed"


def test_compute86_ptx_runs_here(h):
    """The sm_86 path executes: compute_86 PTX, JIT-compiled by this GPU's driver."""
    key = gemv.make_key("q4g64", 1024, 512, 4, lookup("rtx3090"), "residual")
    h.build([key], ptx=True)
    case = make_case(key, "cuda", 11)
    h.run(case, ptx=True)
    h.compare(case, key.name + " (compute_86 PTX)")

