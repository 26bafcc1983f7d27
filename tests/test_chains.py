"""CPU tier for joined GEMV launches (CompileOptions.chain; compiler/chains.py, kernels/gemv_chain.py): the 27B's
decode forward within issue 32's 300 launches, every member keeping its own call's kernel and bindings in order,
the counters' place in the workspace, the launch arithmetic, refusals, and NVRTC builds without spills. The bits
are the GPU tier's (tests/gpu/test_chains_gpu.py). The builds use the session's kernel cache (tests/conftest.py)."""
from pathlib import Path

import pytest

from compiler.buckets import plan_bucket, profile_of
from compiler.build_cache import build_kernels
from compiler.chains import COUNTER_BYTES
from compiler.kernels import gemv, gemv_chain, matmul_keys
from compiler.kquant import KFORMATS
from compiler.options import CompileOptions
from compiler.plan import Workspace
from compiler.spec import load_spec
from compiler.targets import lookup
from ninfer_gen.cli.env import compile_options

ROOT = Path(__file__).resolve().parent.parent
SPEC_27B = load_spec(ROOT / "model_specs/qwen3.8-27b.yaml")
SPEC_TINY = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")


def _plan(spec, arch, mode, entry="step", b=1, t=1):
    profile = profile_of(spec, cohorts=(1, 3, 8), draft=3, options=CompileOptions(chain=mode))
    return plan_bucket(spec, lookup(arch), entry, b, t, profile)


def _members(plan):
    """The plan's launches as (key, bindings) of single kernels, a chain's members in order."""
    out = []
    for c in plan.calls:
        if c.key.family != "gemv_chain":
            out.append((c.key, c.args))
            continue
        args = dict(c.args)
        for i, m in enumerate(c.key.members):
            out.append((m, tuple((p.name, args[gemv_chain.member_param(i, p.name)]) for p in gemv.params(m))))
    return out


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_the_27b_decode_forward_fits_300_launches_and_keeps_every_kernel_and_binding(arch):
    off = _plan(SPEC_27B, arch, "off")
    counts = {}
    for mode in ("group", "chain"):
        plan = _plan(SPEC_27B, arch, mode)
        counts[mode] = plan.launches
        assert _members(plan) == _members(off), f"{mode}: a member's kernel or bindings changed"
        assert all(len(g) == 1 for g in plan.groups) and plan.lanes == 1   # no graph branches left
        assert sum(len(c.key.members) for c in plan.calls if c.key.family == "gemv_chain") > 0
    print(f"27B {arch} decode forward: launches off {off.launches}, group {counts['group']}, chain {counts['chain']}")
    assert off.launches > counts["group"] > counts["chain"]
    assert counts["chain"] <= 300


def test_a_chain_is_dependent_gemvs_and_a_group_concurrent_ones():
    plan = _plan(SPEC_27B, "sm_90", "chain", "verify", 1, 4)
    chains = [c.key for c in plan.calls if c.key.family == "gemv_chain"]
    for key in chains:
        if key.chained:
            assert all(len(s) == 1 for s in key.stages)          # one GEMV per stage, each reading the last
        else:
            assert len(key.stages[0]) > 1                         # a layer's input projections
    shapes = {tuple((m.n, m.k) for m in k.members) for k in chains if k.chained}
    a = SPEC_27B.model
    assert ((a.hidden_size, a.linear_attention.num_value_heads * a.linear_attention.value_head_dim),
            (2 * a.intermediate_size, a.hidden_size), (a.hidden_size, a.intermediate_size)) in shapes


def test_chained_launches_count_in_zeroed_workspace_past_every_call():
    off, plan = _plan(SPEC_27B, "sm_90", "off"), _plan(SPEC_27B, "sm_90", "chain")
    chained = [c for c in plan.calls if c.key.family == "gemv_chain" and c.key.chained]
    assert chained
    counters = {c.binding("counters") for c in chained}
    assert counters == {Workspace("zeroed", off.workspace["zeroed"][0], 0)}
    assert plan.workspace["zeroed"][0] == off.workspace["zeroed"][0] + COUNTER_BYTES
    assert plan.workspace["zeroed"][1:] == off.workspace["zeroed"][1:] and plan.workspace["scratch"] == off.workspace["scratch"]
    assert 4 * (max(len(c.key.stages) for c in chained) + 2) <= COUNTER_BYTES
    group = _plan(SPEC_27B, "sm_90", "group")
    assert group.workspace == off.workspace and all(not c.key.chained for c in group.calls if c.key.family == "gemv_chain")


def test_launch_arithmetic_virtual_blocks_and_matmul_keys():
    t = lookup("sm_90")
    qkv = gemv.make_key("q4g64", 10240, 5120, 1, t)                 # 4 warps, 640 blocks
    z = gemv.make_key("q5g64", 6144, 5120, 1, t)                    # 8 warps, 384 blocks
    a = gemv.make_key("bf16", 48, 5120, 1, t, out_dtype="f32")      # 8 warps, split 5: 15 blocks
    key = gemv_chain.Key(((qkv, z, a),), "sm_90")
    assert (qkv.warps, z.warps, a.warps) == (4, 8, 8) and key.threads == 256
    assert [key.items(m) for m in key.members] == [320, 384, 15]    # two 4-warp blocks to a chain block
    assert gemv_chain.launch(key).grid == (719, 1, 1) and gemv_chain.launch(key).block == (256, 1, 1)
    assert matmul_keys(key) == [qkv, z, a] and matmul_keys(qkv) == [qkv]
    names = [p.name for p in gemv_chain.params(key)]
    assert names[0] == "m0.y" and "counters" not in names
    assert gemv_chain.params(gemv_chain.Key(((qkv,), (z,)), "sm_90"))[0].name == "counters"


def test_refusals():
    t = lookup("sm_90")
    qkv = gemv.make_key("q4g64", 10240, 5120, 1, t)
    with pytest.raises(ValueError, match="2..16 members"):
        gemv_chain.Key(((qkv,),), "sm_90")
    with pytest.raises(ValueError, match="arch"):
        gemv_chain.Key(((qkv, gemv.make_key("q4g64", 1024, 5120, 1, lookup("sm_86"))),), "sm_90")
    kq = gemv.make_key(sorted(KFORMATS)[0], 1024, 5120, 1, t)
    with pytest.raises(ValueError, match="our weight formats"):
        gemv_chain.Key(((qkv, kq),), "sm_90")
    with pytest.raises(ValueError, match="chain 'all'"):
        CompileOptions(chain="all")
    assert compile_options({"NINFER_CHAIN": "group"}).chain == "group"
    with pytest.raises(ValueError, match="chain 'x'"):
        compile_options({"NINFER_CHAIN": "x"})


def test_the_default_plans_join_nothing():
    plan = _plan(SPEC_27B, "sm_90", "off")
    assert not any(c.key.family == "gemv_chain" for c in plan.calls) and plan.launches == len(_members(plan))


def joined_keys(arch: str) -> list:
    """Every chain and group of the tiny spec's decode buckets (1 and 3 lanes, the 4-row verify)."""
    keys = []
    for entry, b, t in (("step", 1, 1), ("step", 3, 1), ("verify", 1, 4)):
        for mode in ("group", "chain"):
            keys += [c.key for c in _plan(SPEC_TINY, arch, mode, entry, b, t).calls if c.key.family == "gemv_chain"]
    return list(dict.fromkeys(keys))


@pytest.mark.prebuild(keys=joined_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_the_tiny_specs_joined_launches_compile_without_spills(kernel_cache, arch):
    """`joined_keys` compile within the static shared memory (the template asserts it) and without spills. The
    27B's are in the slow tier of tests/test_kernels_compile.py."""
    keys = joined_keys(arch)
    assert any(k.chained for k in keys) and any(not k.chained for k in keys)
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    assert summary.spills == 0 and all(b.meta["smem_bytes"] <= 48 * 1024 for b in summary.built)
