"""CompileOptions.fold_in_verify on the CPU: a fused round with no commit step — its verify writes one record set
and first folds the other (the GDN kernels' commit_record modes), rounds alternate sets, the accept kernel hands
its counts to the next round's verify — planned, bound and compiled. The interpreter's equality of a folding
verify with commit-then-verify is tests/test_replayssm.py's; the rows' bookkeeping tests/test_round_rows.py's;
the GPU's rounds with and without the option, tests/gpu/test_speculative_gpu.py's. The NVRTC build uses the
session's kernel cache (tests/conftest.py).
"""
from pathlib import Path

import pytest

from compiler.buckets import plan_bucket, profile_of
from compiler.options import CompileOptions
from compiler.plan import NULL, BucketInput, State
from compiler.round import plan_round
from compiler.spec import load_spec
from compiler.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
BIG = load_spec(ROOT / "model_specs" / "qwen3.8-27b.yaml")
TINY = load_spec(ROOT / "model_specs" / "qwen3.8-tiny.yaml")
H200 = TARGETS["h200"]
ON, OFF = CompileOptions(fold_in_verify=True), CompileOptions(fold_in_verify=False)   # ON is the default


def _bucket_launches(spec, profile, shape) -> int:
    return plan_bucket(spec, H200, *shape, profile).launches


def test_the_rounds_lose_the_commit_step_and_alternate_record_sets():
    profile, base = profile_of(BIG, cohorts=(1, 8), options=ON), profile_of(BIG, cohorts=(1, 8), options=OFF)
    t = profile.tail_tokens
    assert {("verify.rec", 8, t), ("verify.rec1", 8, t), ("commit.rec1", 8, t)} <= set(profile.shapes())
    before = plan_round(BIG, H200, base, 8, "greedy")
    assert before.buckets()[0] == ("commit", 8, t)
    for parity, (mine, other) in enumerate((("rec", "rec1"), ("rec1", "rec"))):
        rnd = plan_round(BIG, H200, profile, 8, "greedy", parity=parity)
        assert rnd.parity == parity and ("commit", 8, t) not in rnd.buckets()
        assert rnd.buckets()[0] == (f"verify.{mine}", 8, t)
        calls = {c.key.stage: dict(c.args) for c in rnd.calls() if c.key.family == "spec_round" and c.key.j == 0}
        assert [c.key.mode for c in rnd.calls() if c.key.family == "spec_round" and c.key.stage == "begin"] == ["fold"]
        assert calls["accept"]["fold_commit"] == BucketInput((f"verify.{other}", 8, t), "commit")
        assert calls["accept"]["fold_slots"] == BucketInput(("commit" if parity == 0 else "commit.rec1", 8, t), "slots")
        launches = sum(_bucket_launches(BIG, profile, s) for s in rnd.buckets()) + len(rnd.calls())
        base_launches = sum(_bucket_launches(BIG, base, s) for s in before.buckets()) + len(before.calls())
        assert base_launches - launches == 96          # the 48 GDN layers' conv and state folds
    eager = plan_round(BIG, H200, profile, 8, "greedy", fold=False)
    assert eager.buckets()[0] == ("verify", 8, t)      # eager rounds keep the commit bucket after the read-back
    snap = profile_of(BIG, cohorts=(1, 8), options=ON, snapshots=True)   # snapshot mode keeps no records to fold
    assert snap.record_sets == 1 and not {s for s in snap.shapes() if "." in s[0]}
    fused = plan_round(BIG, H200, snap, 8, "greedy")
    assert fused.buckets()[0] == ("commit", 8, t) and set(fused.buckets()) <= set(snap.shapes())


@pytest.mark.parametrize("parity", [0, 1])
def test_a_folding_verify_binds_its_own_set_and_folds_the_other(parity):
    mine, other = ("rec", "rec1")[parity], ("rec", "rec1")[1 - parity]
    plan = plan_bucket(TINY, H200, f"verify.{mine}", 2, 4, profile_of(TINY, cohorts=(1, 2), options=ON))
    gdn = [(c.key, dict(c.args)) for c in plan.calls if c.key.family in ("gdn_conv", "gdn_step")]
    assert gdn and all(key.mode == "commit_record" for key, _ in gdn)
    for key, args in gdn:
        if key.family == "gdn_conv":
            assert args["rec"].name.startswith(f"{mine}.") and args["prev_rec"].name.startswith(f"{other}.")
        else:
            assert all(args[p].name.startswith(f"{mine}.") for p in ("rec_k", "rec_v", "rec_g"))
            assert all(args[p].name.startswith(f"{other}.") for p in ("prev_k", "prev_v", "prev_g"))
        assert isinstance(args["commit"], type(args["slots"])) and args["commit"].name == "commit"
    commit = plan_bucket(TINY, H200, "commit.rec1", 2, 4, profile_of(TINY, cohorts=(1, 2), options=ON))
    assert all(dict(c.args)["rec" if c.key.family == "gdn_conv" else "rec_k"].name.startswith("rec1.")
               for c in commit.calls)
    plain = plan_bucket(TINY, H200, "verify", 2, 4, profile_of(TINY, cohorts=(1, 2), options=OFF))
    for c in plain.calls:
        if c.key.family == "gdn_step":
            assert c.key.mode == "record" and dict(c.args)["prev_k"] == NULL and dict(c.args)["rec_k"] == State("rec.0.k")
            break


def fold_keys(target: str) -> list:
    """The tiny spec's folding keys (commit_record and fold modes) and round kernels, both parities."""
    from compiler.buckets import plan_profile, profile_keys

    profile, t = profile_of(TINY, cohorts=(1, 2), options=ON), TARGETS[target]
    rounds = {(b, a, p): plan_round(TINY, t, profile, b, a, parity=p) for b in (1, 2) for a in ("greedy", "sampled")
              for p in (0, 1)}
    return [k for k in profile_keys(plan_profile(TINY, t, profile), rounds)
            if getattr(k, "mode", "") in ("commit_record", "fold") or k.family == "spec_round"]


@pytest.mark.prebuild(keys=fold_keys)
@pytest.mark.parametrize("target", ["rtx3090", "h200"])
def test_its_kernels_compile_without_spills(target, kernel_cache):
    from compiler.buckets import plan_rounds
    from compiler.build_cache import build_kernels

    keys = fold_keys(target)
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    assert {k.mode for k in keys if k.family in ("gdn_conv", "gdn_step")} >= {"commit_record", "fold"}
    # every key built once (none twice), compiled here or earlier in the session from the same source
    assert summary.kernels == len(keys) == len(summary.built) and summary.spills == 0, summary.table()
    assert plan_rounds(TINY, TARGETS[target], profile_of(TINY, cohorts=(1, 2), options=ON))


def test_record_sets_are_refused_where_they_do_not_belong():
    from compiler.trace import StatePools, trace

    pools = StatePools(8, 2, 4, kv_dtype="f32")
    for entry, kw in (("step", {"records": "rec1"}), ("verify", {"records": "rec", "fold_from": "rec"}),
                      ("commit", {"fold_from": "rec1"}), ("verify", {"records": "rec2"}),
                      ("verify", {"fold_from": "rec1", "snapshots": True})):
        with pytest.raises(ValueError, match="record set"):
            trace(TINY, entry, 2, 4, pools, **kw)
