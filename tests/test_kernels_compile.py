"""CPU tier: every kernel family renders and compiles with NVRTC, with zero spills — the 27B's case keys
(decode/verify buckets, M ∈ {1, 2, 4, 8, 16, 32}, the prefill chunk, the ReplaySSM modes) on sm_86 and
sm_90, the tiny spec's on sm_86, a sample on sm_80 and sm_89, the image kernels (M-RoPE qk_rope_kv,
embed_images), the joined GEMV launches (gemv_chain); a warm rebuild compiles nothing; NVRTC errors name the rendered file; the cache layout.
CI compiles a sample of the largest key sets (`sampled`: the first and last key of each family and format, and on
sm_86 of each GEMV row count); the whole sets, the NINFER_GEMV experiment variants and the other cards' GEMM
tilings are the `sweep` tests (`pytest -m sweep`, ~700 CPU-seconds), which the GPU session scripts run on the
device machine's cores.
The compile tests build into the session's kernel cache (tests/conftest.py), their keys from the `*_keys` functions
their `prebuild` marks name, which the session's background build compiles ahead."""
import json
import os
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from compiler import codegen
from compiler.build_cache import KernelCacheMiss, build_kernels
from compiler.kernels import FAMILY_MODULES, attn_decode, embed_images, gemm, gemm_wg, gemv, module_of, qk_rope_kv, rmsnorm
from compiler.buckets import plan_bucket, plan_rounds, profile_of
from compiler.buckets_vision import plan_vision
from compiler.options import CompileOptions
from compiler.lower_rules import matmul_key
from compiler.spec import load_spec
from compiler.targets import TargetError, lookup, resolve
from lab.cases import case_keys, make_case
from compiler.nvrtc import KernelCompileError, parse_ptxas
from compiler.spec_vision import mrope_axis

ROOT = Path(__file__).resolve().parent.parent
SPECS = {name: load_spec(ROOT / f"model_specs/qwen3.8-{name}.yaml") for name in ("27b", "tiny", "tiny-vl")}


def vision_keys(arch: str) -> list:
    """The kernels of prompts with images, made by hand (the plans with images are not in the cases): qk_rope_kv
    with the 27B's and the tiny-vl spec's M-RoPE sections at b = 1, t = 1 and 256 (the 27B also with bf16 KV),
    and embed_images at one row and at the prefill chunk, 5120 and 128 wide."""
    keys = []
    for name, shapes in (("27b", ((1, "int8"), (1, "bf16"), (256, "int8"))), ("tiny-vl", ((1, "int8"), (256, "int8")))):
        spec = SPECS[name]
        at, profile = spec.model.attention, profile_of(spec)
        keys += [qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, 1, t, kv, profile.page_size,
                                profile.pages_per_seq, spec.model.rms_norm_eps, arch, mrope=spec.vision.mrope_section)
                 for t, kv in shapes]
        keys += [embed_images.Key(spec.model.hidden_size, m, m, spec.vision.image_token_id, arch)
                 for m in (1, profile.prefill_chunk)]
    return keys


def _spec_keys(arch: str, tiny: bool = True) -> list:
    """The 27B's case keys (and the tiny spec's, unless `tiny` is false) for `arch` (planned once per session: five
    tests read them)."""
    return list(_planned_spec_keys(arch, tiny))


@cache
def _planned_spec_keys(arch: str, tiny: bool) -> tuple:
    target = lookup(arch)
    keys = case_keys(SPECS["27b"], target) + (case_keys(SPECS["tiny"], target) if tiny else [])
    a = SPECS["27b"].model
    keys += [gemv.make_key("q6g64", a.hidden_size, a.intermediate_size, m, target, "residual") for m in (1, 32)]
    # the one-graph round's own kernels (compiler.round), one lane, with the coin and a reduced draft head;
    # they are tested on the GPU at the round level (tests/gpu/test_speculative_gpu.py), not as cases
    profile = profile_of(SPECS["27b"], cohorts=(1,), draft=3, accept_coin=True, draft_vocab=32768)
    keys += [k for r in plan_rounds(SPECS["27b"], target, profile).values() for k in r.keys()]
    # the vision encoder's kernels (an 8-token call of two images: 32 patch rows; its buckets:
    # tests/test_vision_kernels_compile.py)
    encoder = [k for name in ("27b", "tiny-vl") for k in plan_vision(SPECS[name], target, 8, 2).keys()]
    return tuple(dict.fromkeys(keys + vision_keys(arch) + chain_keys(arch) + encoder))


def chain_keys(arch: str) -> list:
    """The 27B's chained GEMV launches (CompileOptions.chain "chain") of one lane's decode step and of eight lanes'
    32-row verify: the fewest rows and the most (the tiny spec's groups and chains: tests/test_chains.py)."""
    profile = profile_of(SPECS["27b"], cohorts=(1, 8), draft=3, options=CompileOptions(chain="chain"))
    return [c.key for entry, b, t in (("step", 1, 1), ("verify", 8, 4))
            for c in plan_bucket(SPECS["27b"], lookup(arch), entry, b, t, profile).calls if c.key.family == "gemv_chain"]


def every_kernel_keys(arch: str, sample: bool = False) -> list:
    """sm_86 (the target): the 27B's and the tiny spec's keys; sm_90: the 27B's (the GPU tier compiles the tiny spec's
    there, the 27B bench every 27B key, refusing spills at load) — every family either way; with `sample`, `sampled`
    of them (on sm_86 those of every GEMV row count too)."""
    keys = _spec_keys(arch, tiny=arch == "sm_86")
    if arch == "sm_90":       # the tiny spec's 32-row residual GEMVs too: unsplit, they take the norm fold (the 27B's
        keys += [k for k in case_keys(SPECS["tiny"], lookup(arch))     # are split-K), which spilled under a register cap
                 if k.family == "gemv" and k.m == 32 and k.epilogue == "residual"]
    return sampled(keys, by_m=arch == "sm_86") if sample else keys


def sampled(keys: list, by_m: bool = False) -> list:
    """The first and last key of each family and weight format (with `by_m`, also of each row count M of a GEMV
    family: the registers a kernel needs grow with M and the format, the shapes change grids): CI's sample of a
    sweep."""
    groups: dict = {}
    for k in keys:
        m = getattr(k, "m", None) if by_m and "gemv" in k.family else None
        groups.setdefault((k.family, getattr(k, "fmt", None), m), []).append(k)
    return list(dict.fromkeys(k for g in groups.values() for k in (g[0], g[-1])))


# A sweep's compiles use the machine's cores (the device machine's 16 when a GPU session script runs them; CI's 2).
SWEEP_JOBS = max(2, min(16, os.cpu_count() or 2))
SWEEP = pytest.mark.sweep


@pytest.mark.slow
@pytest.mark.prebuild(keys=every_kernel_keys)
@pytest.mark.parametrize("arch, sample", [("sm_86", True), ("sm_90", True), pytest.param("sm_86", False, marks=SWEEP),
                                          pytest.param("sm_90", False, marks=SWEEP)])
def test_every_kernel_compiles_without_spills(kernel_cache, arch, sample):
    """The keys of `every_kernel_keys` (in CI their sample, 92 of sm_86's 531 and 51 of sm_90's 301; all of them in the
    sweep, which the GPU session scripts run on the device's cores) compile without spills within the card's limits; a
    warm rebuild compiles nothing. (The background build may have compiled some already: `cold` is this test's first
    look.)"""
    keys = every_kernel_keys(arch)
    assert {k.family for k in keys} == set(FAMILY_MODULES) - ({"gemm_wg", "xperm"} if arch != "sm_90" else set())
    assert {k.m for k in keys if k.family == "gemv"} == {1, 2, 4, 8, 16, 32}
    keys = every_kernel_keys(arch, sample)
    cold = build_kernels(keys, jobs=SWEEP_JOBS, root=kernel_cache, progress=False)
    spilled = [b.key.name for b in cold.built if b.meta["spill_stores"] or b.meta["spill_loads"]]
    assert not spilled and cold.spills == 0, f"spills in {spilled}"
    print(f"\n{arch} cold: {cold.table()}")
    warm = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    assert warm.compiled == 0 and warm.cached == warm.kernels == cold.kernels
    print(f"{arch} warm: {warm.table()}")
    for b in cold.built:           # launch configs fit the card's limits
        cfg = module_of(b.key).launch(b.key, lookup(arch))
        assert cfg.block[0] * cfg.block[1] * cfg.block[2] <= 1024 and b.meta["smem_bytes"] <= 48 * 1024
        assert b.meta["smem_bytes"] + cfg.smem <= lookup(arch).smem_per_block, b.key.name


def gemv_experiment_keys(arch: str) -> list:
    """The decode-GEMV fields not shipped (NINFER_GEMV experiments): a higher min_blocks on the 27B
    Q4/Q5/Q6 shapes, k-quant weights staged at other depths and M, `code_bias` loaded and staged, and the 4-warp
    shapes' activations loaded with their weights at M = 32 (`x_early`) at depth 1 and 2 without the shipped 4-block
    cap."""
    target, a = lookup(arch), SPECS["27b"].model
    shapes = [("q4g64", 2 * a.intermediate_size, a.hidden_size, "silu_mul"), ("q5g64", a.hidden_size, 6144, "residual"),
              ("q5g64", a.hidden_size, a.intermediate_size, "residual"), ("q6g64", a.hidden_size, a.intermediate_size, "residual")]
    keys = [replace(gemv.make_key(fmt, n, k, 1, target, epi), min_blocks=3 if n <= 6144 else 5)
            for fmt, n, k, epi in shapes]
    keys += [replace(gemv.make_key(fmt, 2 * a.intermediate_size, a.hidden_size, m, target, "silu_mul"), stage_w=sw)
             for fmt, sw in (("q4_k", 4), ("q5_k", 3), ("q6_k", 2)) for m in (1, 32)]   # k-quant weights staged
    keys += [replace(gemv.make_key(fmt, 2 * a.intermediate_size, a.hidden_size, m, target, "silu_mul"), code_bias=True,
                     stage_w=sw) for fmt in ("q4_k", "q5_k") for m in (1, 32) for sw in (0, 2)]  # codes + 128
    keys += [replace(gemv.make_key(fmt, n, k, 32, target, epi), x_early=True, depth=d, min_blocks=2)  # early, uncapped
             for fmt, n, k, epi in shapes for d in (1, 2) if gemv.make_key(fmt, n, k, 32, target, epi).warps == 4]
    return keys


@SWEEP
@pytest.mark.prebuild(keys=gemv_experiment_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_gemv_experiment_variants_compile_without_spills(kernel_cache, arch):
    """`gemv_experiment_keys` compile without spills, so an experiment never trips the executable's spill check (a
    sweep: experiments run on the device, where the GPU session scripts run the sweeps)."""
    summary = build_kernels(gemv_experiment_keys(arch), jobs=SWEEP_JOBS, root=kernel_cache, progress=False)
    spilled = [b.key.name for b in summary.built if b.meta["spill_stores"] or b.meta["spill_loads"]]
    assert not spilled and summary.spills == 0, f"spills in {spilled}"


def kquant_keys(arch: str) -> list:
    """The GGUF k-quant kernels (issue 34) a Q4_K_M-style file plans, at the 27B's shapes (decode/verify GEMVs
    at M = 1 … 32, with the decode folds and without, the prefill chunk's GEMMs, the Q4_K embedding, the
    GDN norm writing tiled heads) and the tiny GGUF fixture's (K of one super-block: odd Q6_K rows). Planned once
    per arch."""
    return list(_planned_kquant_keys(arch))


@cache
def _planned_kquant_keys(arch: str) -> tuple:
    from compiler.kernels import embed, gated_rmsnorm
    from compiler.kquant import KFORMATS
    from gguf_fixtures import kquant_spec, q4_k_m_recipe

    target, keys = lookup(arch), []
    for spec in (q4_k_m_recipe(SPECS["27b"]), q4_k_m_recipe(kquant_spec())):
        keys += [k for k in case_keys(spec, target) if getattr(k, "fmt", None) in KFORMATS or
                 (isinstance(k, gated_rmsnorm.Key) and k.key_heads)]
    keys += [embed.Key(f, SPECS["27b"].model.hidden_size, 8, arch) for f in KFORMATS]
    return tuple(dict.fromkeys(keys))


def kquant_built_keys(arch: str, sample: bool) -> list:
    """`kquant_keys`, or with `sample` their `sampled` keys (on sm_86, the target, those of every M)."""
    return sampled(kquant_keys(arch), by_m=arch == "sm_86") if sample else kquant_keys(arch)


@pytest.mark.slow
@pytest.mark.prebuild(keys=kquant_built_keys)
@pytest.mark.parametrize("arch, sample", [("sm_86", True), ("sm_80", True), ("sm_90", True),
                                          pytest.param("sm_86", False, marks=SWEEP)])
def test_kquant_kernels_compile_without_spills(kernel_cache, arch, sample):
    """The k-quant keys render (gemv_kq.cu.j2, gemm_kq.cu.j2, the embed and norm variants) and compile with no spills:
    in CI a sample on sm_86 (the target), sm_80 and sm_90 (the GPU tier compiles sm_90's others there), which keeps
    CI's 2-core run short (the whole sm_86 set, 275 keys, is ~280 CPU-seconds); every sm_86 key in the sweep.
    Registers and shared memory per kernel are printed."""
    keys = kquant_keys(arch)
    fmts = {(k.family, k.fmt) for k in keys if hasattr(k, "fmt")}
    assert {(f, q) for f in ("gemv", "gemm", "embed") for q in ("q4_k", "q5_k", "q6_k")} <= fmts
    assert {k.m for k in keys if k.family == "gemv"} == {1, 2, 4, 8, 16, 32}
    summary = build_kernels(kquant_built_keys(arch, sample), jobs=SWEEP_JOBS, root=kernel_cache, progress=False)
    rows = sorted((b.key.name, b.meta["registers"], b.meta["smem_bytes"] + module_of(b.key).launch(b.key).smem,
                   b.meta["spill_stores"] + b.meta["spill_loads"], b.meta["stack_bytes"]) for b in summary.built)
    print(f"\n{arch}: {summary.table()}\n" + "\n".join(f"  {n}: {r} registers, {m} B shared, {sp} B spilled, "
                                                      f"{st} B stack" for n, r, m, sp, st in rows))
    assert summary.spills == 0, f"spills in {[n for n, *_, sp, _ in rows if sp]}"
    # a register array indexed at run time lives on the stack without counting as a spill
    assert not [n for n, *_, st in rows if st], f"stack frames in {[n for n, *_, st in rows if st]}"
    assert all(m <= lookup(arch).smem_per_block for _, _, m, _, _ in rows)


def lean_loop_keys(arch: str = "sm_90") -> list:
    """The staged gate/up GEMVs of Q4_K and Q5_K at M = 1 and 8 as shipped (kq_lean) and with code_bias alone; the
    staged Q6_K down projection at M = 1 and 8 as shipped (q6_lean) and without it."""
    shipped = [gemv.make_key(fmt, 34816, 5120, m, lookup(arch), "silu_mul") for fmt in ("q4_k", "q5_k") for m in (1, 8)]
    q6 = [gemv.make_key("q6_k", 5120, 17408, m, lookup(arch), "residual") for m in (1, 8)]
    return shipped + q6 + [replace(k, kq_lean=False) for k in shipped] + [replace(k, q6_lean=False) for k in q6]


@pytest.mark.prebuild(keys=lean_loop_keys, ptx=True)
def test_kquant_lean_unit_loop_has_fewer_instructions(kernel_cache):
    """The point of `kq_lean` (shipped with code_bias) and `q6_lean`, in PTX (lab/kq_loop_count.py; its SASS counts need
    a disassembler): the staged gate/up unit loop of Q4_K and Q5_K at M = 1 and 8 on sm_90 has ≥ 13 % fewer
    instructions than code_bias alone (PTX 458 → 368 for Q4_K at M = 1; SASS 474 → 319), the staged Q6_K down
    projection's ≥ 20 % fewer than without q6_lean (PTX 885 → 603 at M = 1; SASS 779 → 566)."""
    from lab.kq_loop_count import count

    keys = lean_loop_keys()
    half = len(keys) // 2
    for shipped, alone in zip(keys[:half], keys[half:]):
        lean, base = (count(k, kernel_cache, None) for k in (shipped, alone))
        bound = 0.8 if shipped.fmt == "q6_k" else 0.87
        assert (shipped.kq_lean or shipped.q6_lean) and lean["ptx_per_unit"] <= bound * base["ptx_per_unit"], \
            (shipped.name, base, lean)


def gemm_variants(key, warps=None):
    """Every tiling gemm.config may pick on `key`'s shape (only those of `warps` warps when given),
    stage counts cycled over 2–4 (they do not change registers)."""
    return [replace(key, wr=wr, wc=wc, nt=nt, stages=2 + i % 3) for i, (wr, wc, nt) in enumerate(gemm.TILINGS)
            if warps is None or wr * wc in warps]


def gemm_tiling_keys(arch: str) -> list:
    """q6g64 (two hi words: the most registers) everywhere, all tilings on sm_86/sm_90; w8g32 and bf16 (four A
    words per lane) there too."""
    target = lookup(arch)
    key = lambda fmt: gemm.make_key(fmt, 5120, 17408, 1024, target, "residual")   # noqa: E731
    if arch in ("sm_86", "sm_90"):
        keys = gemm_variants(key("q6g64")) + gemm_variants(key("w8g32"), {4}) + gemm_variants(key("bf16"), {4})
    else:
        keys = gemm_variants(key("q6g64"), {4, 8})
    return keys


@pytest.mark.slow
@pytest.mark.prebuild(keys=gemm_tiling_keys)
@pytest.mark.parametrize("arch", ["sm_86", pytest.param("sm_80", marks=SWEEP), pytest.param("sm_89", marks=SWEEP),
                                  pytest.param("sm_90", marks=SWEEP)])
def test_every_gemm_tiling_compiles_without_spills(kernel_cache, arch):
    """No tiling the prefill GEMM config may pick spills (`gemm_tiling_keys`): the target's in CI, the other cards' in
    the sweep."""
    summary = build_kernels(gemm_tiling_keys(arch), jobs=SWEEP_JOBS, root=kernel_cache, progress=False)
    spilled = [b.key.name for b in summary.built if b.meta["spill_stores"] or b.meta["spill_loads"]]
    assert not spilled and summary.spills == 0, f"spills in {spilled}"


def rmsnorm_keys(arch: str) -> list:
    return [rmsnorm.Key(h, 16, add, "bf16", 1e-6, arch) for h in (2048, 3072, 4096, 8192) for add in (False, True)]


@pytest.mark.slow
@pytest.mark.prebuild(keys=rmsnorm_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_rmsnorm_of_other_hidden_sizes_compiles_without_spills(kernel_cache, arch):
    """Hidden sizes of other checkpoints than the 27B's 5120 (a 9B-class 4096 spilled 16 bytes when the
    unrolled loop kept its bounds check although THREADS divides the row), with and without the add."""
    summary = build_kernels(rmsnorm_keys(arch), jobs=2, root=kernel_cache, progress=False)
    spilled = [b.key.name for b in summary.built if b.meta["spill_stores"] or b.meta["spill_loads"]]
    assert not spilled and summary.spills == 0, f"spills in {spilled}"


def gemm_wg_keys() -> list:
    key = lambda fmt: gemm_wg.make_key(fmt, 5120, 17408, 1024, lookup("sm_90"), "residual")   # noqa: E731
    return [replace(key("q6g64"), wgs=w, rt=r, bn=b, stages=3) for w, r, b in gemm_wg.TILINGS] + \
           [key(fmt) for fmt in gemm_wg.FMTS]


@pytest.mark.slow
@pytest.mark.prebuild(keys=gemm_wg_keys)
def test_every_gemm_wg_tiling_compiles_without_spills_or_serialised_wgmma(kernel_cache):
    """Every tiling gemm_wg.config may pick, on q6g64 (the most registers), and the default tiling of
    the other formats: no spills, fits shared memory, and ptxas keeps the wgmma asynchronous (it
    serialises them, warning C7513, when a branch or an input definition sits under one in flight)."""
    target = lookup("sm_90")
    summary = build_kernels(gemm_wg_keys(), jobs=2, root=kernel_cache, progress=False)
    for b in summary.built:
        assert not (b.meta["spill_stores"] or b.meta["spill_loads"]), f"spills in {b.key.name}"
        assert "C7513" not in (b.dir / "nvrtc.log").read_text(), f"ptxas serialised the wgmma of {b.key.name}"
        assert gemm_wg.launch(b.key).smem <= target.smem_per_block, b.key.name


def image_keys(arch: str) -> list:
    """`vision_keys` and their qk_rope_kv without M-RoPE (the 1-D kernels they are compared with)."""
    keys = vision_keys(arch)
    return keys + list(dict.fromkeys(replace(k, mrope=()) for k in keys if k.family == "qk_rope_kv"))


@pytest.mark.prebuild(keys=image_keys)
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_image_kernels_compile_without_spills(kernel_cache, arch):
    """qk_rope_kv with M-RoPE and embed_images compile with no spills (sm_80 too: holding the three positions
    spilled there) and with no more stack than the 1-D kernel (its sincosf slow path)."""
    keys = vision_keys(arch)
    summary = build_kernels(image_keys(arch), jobs=2, root=kernel_cache, progress=False)
    built = {b.key: b.meta for b in summary.built}
    assert summary.spills == 0 and not [k.name for k in built if built[k]["spill_stores"] or built[k]["spill_loads"]]
    for k in keys:
        assert module_of(k).launch(k).block == (128, 1, 1) and built[k]["registers"] <= 64, k.name
        if k.family == "qk_rope_kv":
            assert built[k]["stack_bytes"] <= built[replace(k, mrope=())]["stack_bytes"], k.name


def _compile_with_asserts(key, checks: str):
    """NVRTC compiles `key`'s rendered source with `checks` (static_asserts on its constants) appended."""
    from compiler import nvrtc

    source = codegen.render(key, "13.0").source + checks
    nvrtc.compile_source(source, key.name, key.arch, codegen.nvrtc_options() + nvrtc.include_options(codegen.TEMPLATE_DIR),
                         ptx=True)


def test_1d_rope_kernel_source_has_no_mrope_part():
    """A key made without `mrope` keeps today's name and text: no rope_pos parameter, the angle from pos."""
    one = qk_rope_kv.Key(24, 4, 256, 64, 1, 1, "int8", 64, 512, 1e-6, "sm_90")
    assert one.name == "qk_rope_kv_q24_kv4_d256_r64_b1_t1_int8_p64x512_sm90"
    body = codegen.render(one, "13.0").source.split("KERNEL_NAME(", 1)[1]
    assert "rope_pos" not in body and "mrope" not in body and "v_scales) {" in body
    assert "sincosf(__fmul_rn((float)p, inv_freq[dim % HALF]), &sn, &cs);" in body
    three = codegen.render(replace(one, mrope=SPECS["27b"].vision.mrope_section), "13.0").source
    assert "const int* __restrict__ rope_pos) {" in three and "(float)p," not in three


@pytest.mark.parametrize("d,rd,section", [(256, 64, (11, 11, 10)), (64, 16, (3, 3, 2)), (256, 64, (16, 8, 8))])
def test_template_mrope_axis_is_spec_vision_rule(d, rd, section):
    """The template's constexpr mrope_axis gives compiler.spec_vision.mrope_axis for every frequency: NVRTC
    evaluates static_asserts appended to the rendered source."""
    key = qk_rope_kv.Key(4, 2, d, rd, 1, 1, "int8", 64, 8, 1e-6, "sm_86", mrope=section)
    checks = "".join(f'static_assert(mrope_axis({m}) == {mrope_axis(m, section)}, "frequency {m}");\n'
                     for m in range(rd // 2))
    _compile_with_asserts(key, checks)


@pytest.mark.parametrize("hq,hkv,d,t,kv", [(24, 4, 256, 1, "int8"), (24, 4, 256, 4, "int8"), (24, 4, 256, 9, "int8"),
                                         (24, 4, 256, 4, "bf16"), (4, 2, 64, 9, "int8"), (4, 2, 64, 3, "bf16")])
def test_attn_decode_template_cuts_the_work_as_its_launch_does(hq, hkv, d, t, kv):
    """The template's row tiles, row blocks, keys per chunk and warps are attn_decode.tiling's (the grid and
    block the runtime launches): NVRTC evaluates static_asserts appended to the rendered source."""
    key = attn_decode.make_key(hq, hkv, d, 2, t, kv, 64, lookup("sm_86"))
    cut, launch = attn_decode.tiling(key), attn_decode.launch(key)
    assert launch.grid == (key.splits, hkv * cut.row_blocks, 2) and launch.block == (32 * cut.warps, 1, 1)
    assert 16 * cut.mt * cut.row_blocks >= hq // hkv * t > 16 * cut.mt * (cut.row_blocks - 1)
    check = (f"static_assert(MT == {cut.mt} && RB == {cut.row_blocks} && TOKC == {cut.chunk} && "
             f"THREADS == {32 * cut.warps}, \"tiling\");\n")
    _compile_with_asserts(key, check)


@pytest.mark.parametrize("hq,hkv,d,t", [(24, 4, 256, 1), (24, 4, 256, 4), (24, 4, 256, 9), (4, 2, 64, 3),
                                        (4, 2, 128, 7)])
def test_attn_decode_keys_split_template_cuts_the_work_as_its_launch_does(hq, hkv, d, t):
    """The keys split (templates/attn_decode_keys.cu.j2, shipped on sm_90): its row tiles a block, row blocks,
    threads and shared memory are attn_decode.keys_tiling's and keys_smem's (the grid, block and dynamic shared
    memory the runtime launches with) — NVRTC evaluates static_asserts appended to the rendered source."""
    key = attn_decode.make_key(hq, hkv, d, 2, t, "int8", 64, lookup("sm_90"))
    cut, launch = attn_decode.keys_tiling(key), attn_decode.launch(key)
    assert key.kw and launch.grid == (key.splits, hkv * cut.row_blocks, 2) and launch.block == (32 * cut.warps, 1, 1)
    assert 8 * cut.row_tiles * cut.row_blocks >= hq // hkv * t > 8 * cut.row_tiles * (cut.row_blocks - 1)
    assert key.early                                        # shipped with its first copies before the PDL wait
    check = (f"static_assert(NRB == {cut.row_tiles} && RB == {cut.row_blocks} && THREADS == {32 * cut.warps} && "
             f"SMEM_BYTES == {launch.smem} && EARLY, \"tiling\");\n")
    _compile_with_asserts(key, check)


def test_prefill_matmul_dispatch():
    """Up to 32 rows the gemv; above, gemm_wg on sm_90 for group-64 formats, else the mma.sync gemm."""
    h200, rtx = lookup("h200"), lookup("rtx3090")
    assert matmul_key("q4g64", 1024, 512, 32, h200).family == "gemv"
    assert matmul_key("q4g64", 1024, 512, 1024, h200).family == "gemm_wg"
    assert matmul_key("bf16", 512, 512, 64, h200).family == "gemm_wg"
    assert matmul_key("bf16", 96, 512, 64, h200).family == "gemm"        # below gemm_wg.MIN_N
    assert matmul_key("q4g64", 1024, 512, 48, h200).family == "gemm"      # below gemm_wg.MIN_M
    assert matmul_key("w8g32", 1024, 512, 1024, h200).family == "gemm"    # group 32
    assert matmul_key("q4g64", 1024, 512, 1024, rtx).family == "gemm"
    k = matmul_key("q5g64", 5120, 17408, 1024, h200, "residual")
    assert k.compile_arch == "sm_90a" and k.arch == "sm_90" and k.name.endswith("_sm90")
    with pytest.raises(ValueError, match="needs sm_90"):
        replace(k, arch="sm_86").check_arch()
    for m in (64, 100, 1024, 4096):     # the chosen tiling always fits the card
        for fmt in gemm_wg.FMTS:
            key = gemm_wg.make_key(fmt, 34816, 5120, m, h200, "silu_mul")
            assert gemm_wg.launch(key).smem <= h200.smem_per_block and key.stages >= 3


def sample_keys(arch: str) -> list:
    keys = [k for k in _spec_keys(arch) if getattr(k, "m", None) in (None, 1, 32) or k.family == "gemm"]
    return list({k.family + str(i % 3): k for i, k in enumerate(keys)}.values())   # ≤ 3 per family


@pytest.mark.slow
@pytest.mark.prebuild(keys=sample_keys)
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_sample_compiles_on_other_archs(kernel_cache, arch):
    keys = sample_keys(arch)
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    assert summary.spills == 0 and {k.family for k in keys} == set(FAMILY_MODULES) - {"gemm_wg", "xperm"}


def test_cache_folder_meta_and_no_jit(tmp_path):
    key = rmsnorm.Key(128, 2, True, "bf16", 1e-6, "sm_86")
    with pytest.raises(KernelCacheMiss):
        build_kernels([key], root=tmp_path, no_jit=True, progress=False)
    built = build_kernels([key], root=tmp_path, jobs=1, ptx=True, progress=False).built[0]
    assert built.dir.parent == tmp_path / "sm_86" / "rmsnorm" and built.dir.name.startswith(key.name + "-")
    assert {p.name for p in built.dir.iterdir()} == {"kernel.cu", "kernel.cubin", "kernel.ptx", "meta.json", "nvrtc.log"}
    meta = json.loads((built.dir / "meta.json").read_text())
    assert meta["key"] == key.fields() and meta["nvrtc_version"].startswith("13.0") and meta["registers"] > 0
    src = (built.dir / "kernel.cu").read_text()
    assert src.startswith(f"// kernel: {key.name}\n// key: ") and f"// hash: {built.dir.name[-12:]}" in src
    assert f"#define KERNEL_NAME {key.name}" in src and b".target sm_86" in (built.dir / "kernel.ptx").read_bytes()
    assert build_kernels([key], root=tmp_path, no_jit=True, progress=False).compiled == 0
    other = replace(key, eps=1e-5)
    assert codegen.render(other, "13.0").hash != codegen.render(key, "13.0").hash


def test_a_build_that_loses_the_race_to_a_folder_without_ptx_adds_its_ptx(tmp_path, monkeypatch):
    """Two builds of one key at once (a test and the session's background build): when the one asked for PTX finishes
    second, its folder rename fails against the first one's, which has no PTX — it moves its PTX in (a test read a
    missing kernel.ptx in CI, session 25)."""
    from compiler import build_worker

    key = rmsnorm.Key(128, 2, True, "bf16", 1e-6, "sm_86")
    compile_into = build_worker._compile_into

    def racing(tmp, job, out):              # the other build's folder, without PTX, lands while this one compiles
        if job["ptx"] and not out.exists():
            build_kernels([key], root=tmp_path, jobs=1, progress=False)
        return compile_into(tmp, job, out)
    monkeypatch.setattr(build_worker, "_compile_into", racing)
    built = build_kernels([key], root=tmp_path, jobs=1, ptx=True, progress=False).built[0]
    assert {p.name for p in built.dir.iterdir()} == {"kernel.cu", "kernel.cubin", "kernel.ptx", "meta.json", "nvrtc.log"}
    assert b".target sm_86" in (built.dir / "kernel.ptx").read_bytes()
    assert not [p for p in built.dir.parent.iterdir() if p.name.startswith(".")]      # no temporary folder left


def test_compile_error_names_the_rendered_file(tmp_path, monkeypatch):
    key = rmsnorm.Key(128, 1, False, "bf16", 1e-6, "sm_86")
    real = codegen.render

    def broken(k, v, **kw):
        r = real(k, v, **kw)
        return replace(r, source=r.source + "\nthis is not C++;\n")
    monkeypatch.setattr(codegen, "render", broken)
    with pytest.raises(KernelCompileError) as err:
        build_kernels([key], root=tmp_path, jobs=1, progress=False)
    assert "kernel.cu" in str(err.value) and "error" in str(err.value) and Path(err.value.source_path).exists()


def test_targets_and_arch_lookup():
    t = lookup("rtx3090")
    assert (t.arch, t.sms, t.bandwidth_gbs, t.l2_bytes) == ("sm_86", 82, 936.0, 6 * 2**20)
    assert resolve(arch="sm_90").arch == "sm_90" and resolve("a100").arch == "sm_80"
    assert lookup("sm_87").arch == "sm_87"
    with pytest.raises(TargetError, match="unknown target"):
        lookup("gtx1080")
    with pytest.raises(TargetError, match="unsupported arch"):
        resolve(arch="sm_75")


def test_ptxas_report_parsing():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_86'\nptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 368 bytes cmem[0]\n")
    r = parse_ptxas(log)["k"]
    assert (r.registers, r.smem_bytes, r.stack_bytes, r.spills) == (40, 2048, 8, 8)


def test_every_key_has_matching_params_and_args():
    """Launch argument lists built by the cases match each family's parameter list (tiny, on CPU)."""
    for key in case_keys(SPECS["tiny"], lookup("rtx3090")):
        if key.family == "attn_combine":
            continue
        for k, args in make_case(key, "cpu").launches:
            assert len(args) == len(module_of(k).params(k)), k.name


def test_every_kernel_body_waits_for_its_predecessor():
    """The runtime launches sm_90+ kernels programmatically (Call.programmatic): each kernel may
    start before its predecessor ends, so every kernel body must call pdl_entry() (common/ptx.cuh) — or, where the
    contract allows work before the wait (attn_decode's `early` ring copies), pdl_release() first and pdl_wait()
    on every path after it."""
    for key in dict.fromkeys(_spec_keys("sm_90")):
        source = codegen.render(key, "13.0").source
        body = source.split("KERNEL_NAME(", 1)[1]
        if key.family == "gemv_chain" and not key.chained:      # a group: each member waits in its own body
            members = source.split("KERNEL_NAME(", 1)[0].split("struct Block {")[1:]
            assert len(members) == len(key.members) and all(m.count("pdl_entry();") == 1 for m in members), key.name
            assert "pdl_entry();" not in body, key.name
            continue
        if key.family == "attn_combine":                        # the row's length (a step input) before the wait
            assert "pdl_entry();" not in body and body.count("pdl_release();") == body.count("pdl_wait();") == 1
            assert body.index("pdl_release();") < body.index("pdl_wait();") < body.index("part_ml["), key.name
            continue
        if getattr(key, "early", False):
            assert "pdl_entry();" not in body and body.count("pdl_release();") == 1, key.name
            release = body.index("pdl_release();")
            assert body.count("if (EARLY && !pre) pdl_wait();") == body.count("if (EARLY && pre) pdl_wait();") == 1
            waits = [body.index(w) for w in ("if (EARLY && !pre) pdl_wait();", "if (EARLY && pre) pdl_wait();")]
            assert release < waits[0] < waits[1] < body.index("qb[G][s][0] = f.x;"), key.name   # before Q's loads
            continue
        assert body.count("pdl_entry();") == 1, key.name


def test_every_27b_sequence_key_has_a_case_on_cpu():
    """The GPU tier's inputs for the 27B shape's attention, RoPE/KV and GDN keys (the prefill chunk's among
    them: a chunk longer than the cases' usual sequence cap once made its case fail to build) can be drawn."""
    families = ("qk_rope_kv", "attn_prefill", "attn_decode", "gdn_step", "gdn_chunk", "gdn_conv")
    keys = [k for k in dict.fromkeys(_spec_keys("sm_90")) if k.family in families and k.arch == "sm_90"]
    assert any(getattr(k, "t", 0) == SPECS["27b"].runtime.prefill_chunk for k in keys)
    for key in keys:
        assert make_case(key, "cpu").launches, key.name


def test_every_tiny_key_has_a_reference_on_cpu():
    """Every family's case reference (what the GPU tier compares kernels with) runs for the tiny spec's
    keys on CPU, sm_90 keys included (gemm_wg, whose cases share gemv's reference)."""
    for key in dict.fromkeys(case_keys(SPECS["tiny"], lookup("sm_90"))):
        if key.family == "attn_combine":
            continue
        assert make_case(key, "cpu").reference(), key.name


def test_an_empty_nvrtc_log_leaves_python_bytes_alone():
    """NVRTC writes its log and image into buffers we hand it: an empty log (one "\\0") once went into CPython's
    shared one-byte b" ", and every b" " of the process became b"\\0" (safetensors headers were padded with
    zeros after a PTX build). The buffers are our own now."""
    from compiler import nvrtc

    res = nvrtc.compile_source('extern "C" __global__ void k() {}', "k", "sm_86", [], ptx=True)
    assert res.log == "" and res.image.startswith(b"//")
    assert b" " * 3 == bytes([32, 32, 32]) and bytes(" ", "ascii") == b"\x20"


def gemv_smem_keys(arch: str) -> list:
    """The group-64 GEMV at every row-tile count, M and fold the key accepts (a refused count is checked to be
    over the static limit)."""
    target, keys = lookup(arch), []
    for m in (8, 32):
        for base in (gemv.make_key("bf16", 96, 5120, m, target, out_dtype="f32"),
                     replace(gemv.make_key("q5g64", 5120, 6144, m, target, "residual"), norm_out=True),
                     replace(gemv.make_key("q5g64", 6144, 5120, m, target), scale_in=True, eps=1e-6),
                     replace(gemv.make_key("q4g64", 10240, 5120, m, target), conv=4)):
            for tiles in (1, 2, 3, 4):
                try:
                    keys.append(replace(base, tiles=tiles, min_blocks=1))
                except ValueError as err:
                    assert "static limit" in str(err) and gemv.reduce_bytes(replace(base, tiles=1)) * tiles > 40 * 1024
    return list(dict.fromkeys(keys))


@pytest.mark.slow
@pytest.mark.prebuild(keys=gemv_smem_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_gemv_shared_memory_check_matches_ptxas(kernel_cache, arch):
    """`gemv.static_smem_bytes` is what ptxas reports for the group-64 template at every row-tile count, M and fold
    (the warp reduction grows with tiles × M: the key refuses what would not fit 48 KiB instead of failing to
    compile), up to the 48 KiB edge."""
    summary = build_kernels(gemv_smem_keys(arch), jobs=2, root=kernel_cache, progress=False)
    assert max(b.meta["smem_bytes"] for b in summary.built) > 44 * 1024          # the edge is in the sample
    for b in summary.built:
        assert b.meta["smem_bytes"] == gemv.static_smem_bytes(b.key), b.key.name


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_attn_combine_split_groups(kernel_cache, arch):
    """The combine reduces the 27B's 66 splits in 4 groups (attn_combine.split_groups: ≥ 8 splits a group), few
    splits in one; a block covers 32 of the 256 dims at 4 groups (128 threads: room beside the decode's blocks); every
    group count, with all the dims or a slice, compiles without spills within 128 registers in blocks of ≤ 128
    threads (a group's loads in one round trip) and 64 in larger ones; impossible counts and slices are refused."""
    from compiler.kernels import attn_combine

    target = lookup(arch)
    dk = attn_decode.make_key(24, 4, 256, 8, 4, "int8", 2048, target)
    key = attn_combine.for_decode(dk)
    assert dk.splits >= 32 and key.groups == 4 and key.ds == 32 and "_g4_x32_" in key.name
    assert attn_combine.launch(key).block == (128, 1, 1) and attn_combine.launch(key).grid == (24, 32, 8)
    assert attn_combine.split_groups(256, 7) == 1 and attn_combine.split_groups(64, 200) == 4
    assert attn_combine.for_decode(attn_decode.make_key(4, 2, 64, 1, 1, "int8", 2048, target)).ds == 32  # 2 slices
    keys = [replace(key, groups=g) for g in (1, 2, 3, 4)] + [replace(key, ds=0), replace(key, groups=1, ds=0)]
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    for b in summary.built:
        cap = 128 if attn_combine.launch(b.key).block[0] <= 128 else 64
        assert b.meta["registers"] <= cap and not b.meta["spill_stores"], (b.key.name, b.meta["registers"])
    with pytest.raises(ValueError, match="ds · groups ≤ 1024"):
        replace(key, groups=5, ds=0)
    for ds in (48, 256):                                       # not whole warps; all dims spelt as 256 (0 is)
        with pytest.raises(ValueError, match="whole warps"):
            replace(key, ds=ds)
    with pytest.raises(ValueError, match="1 ≤ groups ≤ splits"):
        attn_combine.Key(24, 256, 1, 1, 64, 2, True, arch, 3)
