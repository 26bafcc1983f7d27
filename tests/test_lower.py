"""Lowering: every fused equation maps to kernel keys, the arena never overlaps two live values,
and `ninfer-gen build` compiles the tiny spec's kernels for sm_86 and sm_90 with zero spills."""
from collections import Counter
from pathlib import Path

import pytest

from compiler.buckets import bucket_shapes, plan_bucket
from compiler.lower import LoweringError, lower
from compiler.spec import load_spec
from compiler.targets import resolve
from compiler.trace import StatePools, trace
from ninfer_gen.cli import main

SPECS = Path(__file__).parent.parent / "model_specs"
TINY = load_spec(SPECS / "qwen3.8-tiny.yaml")
BIG = load_spec(SPECS / "qwen3.8-27b.yaml")
RTX3090 = resolve("rtx3090")


def test_decode_plan_of_the_27b_model():
    plan = plan_bucket(BIG, RTX3090, "step", 1, 1)
    fam = plan.family_counts()
    # 64 layers: GDN qkv, z, a, b, out (48×5) + attention q, k, v, o (16×4) + MLP gate/up, down (64×2) + head
    assert fam["gemv"] == 48 * 5 + 16 * 4 + 64 * 2 + 1
    assert fam["gdn_step"] == 48 and fam["qk_rope_kv"] == 16
    # two norm kernels: layer 0's input norm (it reads the embedding) and the final norm (the hidden is an
    # output); the other 127 ride on the projections around them (passes.fold_norms_into_projections)
    gemvs = [c.key for c in plan.calls if c.key.family == "gemv"]
    assert fam["rmsnorm"] == 2 and sum(k.norm_out for k in gemvs) == 2 * 64 - 1
    assert sum(k.scale_in for k in gemvs) == 48 * 4 + 16 * 3 + 64 - 4      # (layer 0 is GDN: qkv, z, a, b)
    assert "gdn_conv" not in fam and sum(k.conv == 4 for k in gemvs) == 48  # the conv rides on the qkv GEMV
    assert fam["attn_decode"] == 16 and fam["embed"] == 1
    assert plan.launches == sum(fam.values())
    assert plan.absorbed["norm_rope→qk_rope_kv"] == 32


def test_prefill_projects_only_the_last_token_to_the_vocabulary():
    plan = plan_bucket(BIG, RTX3090, "prefill", 1, BIG.runtime.prefill_chunk)
    heads = [c.key for c in plan.calls if getattr(c.key, "n", 0) == BIG.model.vocab_size]
    assert len(heads) == 1 and heads[0].family == "gemv" and heads[0].m == 1
    assert all(c.key.family != "gemv" or c.key.m == 1 for c in plan.calls)


@pytest.mark.parametrize("entry,b,t", [("step", 2, 4), ("prefill", 1, 256), ("mtp", 2, 1)])
def test_arena_never_overlaps_live_values(entry, b, t):
    plan = plan_bucket(TINY, RTX3090, entry, b, t)
    items = list(plan.arena.items())
    for i, (na, (oa, sa)) in enumerate(items):
        for nb, (ob, sb) in items[i + 1:]:
            (a0, a1), (b0, b1) = plan.live[na], plan.live[nb]
            if oa < ob + sb and ob < oa + sa:
                assert a1 < b0 or b1 < a0, f"{na} and {nb} share memory while both live"
    assert 0 < plan.arena_bytes < sum(s for _, s in plan.arena.values())


def test_unfused_graph_is_refused_with_the_primitive_named():
    g = trace(TINY, "step", 1, 1, StatePools(8, 1, 8), "bf16")
    with pytest.raises(LoweringError, match="no lowering rule for primitive 'gdn_gates'"):
        lower(g, TINY, RTX3090)


def test_buckets_cover_decode_verify_mtp_and_prefill():
    shapes = bucket_shapes(BIG, (1, 2, 4, 8), 3)
    assert ("step", 8, 4) in shapes and ("step", 1, 1) in shapes and ("mtp", 8, 1) in shapes
    assert ("prefill", 1, BIG.runtime.prefill_chunk) in shapes
    assert Counter(e for e, _, _ in shapes)["step"] == 8


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_build_cli_compiles_tiny_spec_without_spills(tmp_path, capsys, arch):
    argv = ["build", str(SPECS / "qwen3.8-tiny.yaml"), "--arch", arch, "--build-dir", str(tmp_path), "--jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "spills 0" in out and "cached 0" in out
    assert main(argv) == 0
    assert "compiled 0" in capsys.readouterr().out  # warm rebuild does no NVRTC work
    assert list(tmp_path.glob(f"{arch}/gemv/*/kernel.cubin"))
