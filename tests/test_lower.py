"""Lowering: every fused equation maps to kernel keys, the arena never overlaps two live values,
and `ninfer-gen build` compiles the tiny spec's kernels for sm_86 and sm_90 with zero spills (into a folder of its
own, then moved into the session's kernel cache: tests/conftest.py)."""
from collections import Counter
from pathlib import Path

import pytest

from compiler.buckets import plan_bucket, plan_rounds, profile_of
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


def test_prefill_projects_only_the_last_token_to_the_vocabulary():
    plan = plan_bucket(BIG, RTX3090, "prefill", 1, BIG.runtime.prefill_chunk)
    heads = [c.key for c in plan.calls if getattr(c.key, "n", 0) == BIG.model.vocab_size]
    assert len(heads) == 1 and heads[0].family == "gemv" and heads[0].m == 1
    assert all(c.key.family != "gemv" or c.key.m == 1 for c in plan.calls)


@pytest.mark.parametrize("entry,b,t", [("step", 2, 4), ("prefill", 1, 256)])
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


def test_speculative_entries_lower_to_record_fold_and_mtp_kernels():
    """verify: the GDN conv and step in record mode, writing the layer's records; commit: the folds
    reading them with the commit counts; mtp: the concat kernel, decode attention for the aligned and
    chained slots, prefill attention for the pass over a prompt."""
    verify = plan_bucket(TINY, RTX3090, "verify", 2, 4)
    modes = {(c.key.family, c.key.mode) for c in verify.calls if c.key.family in ("gdn_conv", "gdn_step")}
    assert modes == {("gdn_conv", "record"), ("gdn_step", "record")}
    recs = {str(b) for c in verify.calls for _, b in c.args if str(b).startswith("state:rec.")}
    assert recs == {f"state:rec.{i}.{p}" for i in (0, 1, 2) for p in ("conv", "k", "v", "g")}
    commit = plan_bucket(TINY, RTX3090, "commit", 2, 4)
    assert [(c.key.family, c.key.mode) for c in commit.calls] == [("gdn_conv", "fold"), ("gdn_step", "fold")] * 3
    assert all(str(c.binding("commit")) == "input:commit" for c in commit.calls)
    assert commit.step_inputs() == {"slots": 2, "commit": 2} and not commit.outputs
    fam = plan_bucket(TINY, RTX3090, "mtp", 2, 4).family_counts()
    assert fam["concat"] == 1 and fam["attn_decode"] == 1 and "attn_prefill" not in fam
    prompt = plan_bucket(TINY, RTX3090, "mtp", 1, 64)
    assert prompt.family_counts()["attn_prefill"] == 1 and prompt.step_tensors() == {"hidden": ((64, 128), "bf16")}


def test_profile_shapes_cover_decode_verify_and_prefill_sizes():
    profile = profile_of(BIG, cohorts=(1, 2, 4, 8), draft=3)
    shapes = profile.shapes()
    assert ("step", 8, 4) in shapes and ("step", 1, 1) in shapes and ("step", 8, 1) in shapes
    assert Counter(e for e, _, _ in shapes)["step"] == 8
    assert [t for e, _, t in shapes if e == "prefill"] == [4096, 2048, 1024, 512, 256, 128, 64, 32, 16]
    assert profile_of(BIG, prefill_chunk=96).prefill_sizes() == [96, 64, 32, 16]
    assert {("verify", 8, 4), ("commit", 8, 4), ("mtp", 8, 4), ("mtp", 8, 1), ("mtp", 1, 4096)} <= set(shapes)
    no_drafts = profile_of(BIG, cohorts=(2,), draft=0).shapes()
    assert [s for s in no_drafts if s[0] == "step"] == [("step", 2, 1), ("step", 2, 4)]   # 4: a prompt's tail
    assert all(e in ("step", "prefill") for e, _, _ in no_drafts)


def test_build_cli_compiles_exactly_the_profile_without_spills(tmp_path, capsys, adopt_kernels):
    """`ninfer-gen build` of a small profile (one lane, one draft, a 256-token context): it compiles the keys of
    the profile's plans and nothing else, without spills, and a warm rebuild does no NVRTC work. (Every
    family and arch is compiled by tests/test_kernels_compile.py; this is the command's path.)"""
    argv = ["build", str(SPECS / "qwen3.8-tiny.yaml"), "--arch", "sm_86", "--cohorts", "1", "--draft", "1",
            "--max-context", "256", "--build-dir", str(tmp_path), "--jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    profile = profile_of(TINY, cohorts=(1,), draft=1, max_context=256)
    expected = {k.name for shape in profile.shapes() for k in plan_bucket(TINY, resolve(arch="sm_86"), *shape,
                                                                             profile).keys()}
    expected |= {k.name for r in plan_rounds(TINY, resolve(arch="sm_86"), profile).values() for k in r.keys()}
    built = {p.parent.name.rsplit("-", 1)[0] for p in tmp_path.glob("sm_86/*/*/kernel.cubin")}
    assert built == expected and f"kernels: {len(expected)}, every one launched" in out
    assert "spills 0" in out and "cached 0" in out and "verify B=1 T=2" in out and "mtp B=1 T=1" in out
    assert "round B=1 greedy" in out and "round B=1 sampled" in out
    assert main(argv) == 0
    assert "compiled 0" in capsys.readouterr().out  # warm rebuild does no NVRTC work
    adopt_kernels(tmp_path)     # 82 of them are test_kernels_compile's too: they join the session's kernel cache


@pytest.mark.parametrize("n,chunk,expected", [
    (30, 1024, [("prefill", 16), ("step", 4), ("step", 4), ("step", 4), ("step", 1), ("step", 1)]),
    (2048 + 40, 1024, [("prefill", 1024), ("prefill", 1024), ("prefill", 32), ("step", 4), ("step", 4)]),
    (1000, 4096, [("prefill", 512), ("prefill", 256), ("prefill", 128), ("prefill", 64), ("prefill", 32),
                  ("step", 4), ("step", 4)]),
    (3, 64, [("step", 1)] * 3),
])
def test_prompt_pieces(n, chunk, expected):
    pieces = profile_of(BIG, draft=3).prompt_pieces(n, chunk)
    assert pieces == expected and sum(t for _, t in pieces) == n
    assert all(("prefill", 1, t) in profile_of(BIG, draft=3).shapes() for e, t in pieces if e == "prefill")
    with pytest.raises(ValueError, match="not a bucket of this profile"):
        profile_of(BIG).prompt_pieces(n, 48)


PLAN_CASES = [("rtx3090", "step", 1, 1), ("h200", "step", 2, 4), ("h200", "prefill", 1, 64)]


@pytest.mark.parametrize("target,entry,b,t", PLAN_CASES)
def test_golden_plan_text(target, entry, b, t):
    """`ninfer-gen inspect --plan`: every call with its launch and one binding per parameter, as stable
    text (regenerate with NINFER_UPDATE_GOLDEN=1 and review the diff)."""
    import os

    from compiler.plan import format_plan

    text = format_plan(plan_bucket(TINY, resolve(target), entry, b, t)) + "\n"
    path = Path(__file__).parent / "golden" / f"qwen3.8-tiny.plan.{entry}.b{b}t{t}.{target}.txt"
    if os.environ.get("NINFER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; regenerate with NINFER_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"plan text changed for {path.name}"


def test_plan_bindings_are_checked_against_the_family_parameters():
    from compiler.plan import NULL, PlanError, check_args
    from compiler.kernels import rmsnorm

    key = rmsnorm.Key(128, 1, False, "bf16", 1e-6, "sm_86")
    args = {"y": NULL, "x": NULL, "delta": NULL, "w": NULL}
    assert [n for n, _ in check_args(key, args)] == ["y", "x", "delta", "w"]
    with pytest.raises(PlanError, match=f"{key.name}: no binding for w"):
        check_args(key, {k: v for k, v in args.items() if k != "w"})
    with pytest.raises(PlanError, match="unknown parameter\\(s\\) bias"):
        check_args(key, args | {"bias": NULL})
    with pytest.raises(PlanError, match="unknown step input 'lengths'"):
        from compiler.plan import Input
        check_args(key, args | {"x": Input("lengths")})


def test_compiler_never_reaches_the_runtime_or_the_environment():
    """The compiler sits below everything: no module under compiler/ imports ninfer_gen, and none reads or
    writes os.environ (options come in as CompileOptions; NVRTC's cache is bypassed per compile by an option)."""
    import re

    for path in (Path(__file__).parent.parent / "compiler").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+ninfer_gen", text, re.M), f"{path} imports the runtime"
        uses = re.findall(r"os\.environ\S*|\b(?:get|put|unset)env\b", text)
        assert not uses, f"{path} reads or writes the environment: {uses}"
