"""lab/kernel_lab.py's plan on the CPU (no kernel runs): the `buckets` and `verify` groups carry the 27B plans'
decode GEMVs with their launch counts, and the verify variants are what they say — the shipped keys, session 19's
keys (the baseline the next runs compare with) and neighbours that never change a bit — on the H200's path and the
3090's (`--arch-path rtx3090`)."""
from collections import Counter
from dataclasses import fields

import pytest

from compiler.buckets import plan_bucket
from compiler.spec import load_spec
from compiler.targets import lookup
from lab import kernel_lab

SPEC = load_spec("model_specs/qwen3.8-27b.yaml")
ORDER = ("fmt", "n", "k", "m", "epilogue", "out_dtype", "warps", "splits", "norm_out", "scale_in", "conv", "code_bias")


def _labelled(target, group):
    out = {}
    for _, items in (g for g in kernel_lab.verify_plan(target, target.l2_bytes) if g[0] == group):
        for item in items:
            out.setdefault(item.plan, []).append((item.key, item.in_plan))
    return out


@pytest.mark.parametrize("arch", ["sm_90", "sm_86"])
def test_verify_variants_are_the_plans_keys_with_stream_fields_changed(arch):
    target = lookup(arch)
    variants = _labelled(target, "verify")
    for batch, tokens in ((8, 4), (4, 4)):
        shipped = Counter(c.key for c in plan_bucket(SPEC, target, "step", batch, tokens).calls
                          if c.key.family == "gemv")
        prefix = f"verify B = {batch}, T = {tokens}, "
        assert {k: n for k, n in variants[prefix + "shipped"]} == dict(shipped)
        names = [label[len(prefix):] for label in variants if label.startswith(prefix)]
        assert names == [name for name, _ in kernel_lab.VERIFY_VARIANTS]
        for name in names:
            rows = variants[prefix + name]
            assert sorted(n for _, n in rows) == sorted(shipped.values())
            for (key, _), base in zip(rows, shipped):         # the order fields, hence the bits, stay the plan's
                assert all(getattr(key, f) == getattr(base, f) for f in ORDER), (name, key.name)
    s19 = {k.name for k, _ in variants["verify B = 8, T = 4, session 19"]}
    if arch == "sm_90":          # session 19's names, as its kernel lab `buckets` group printed them (H100)
        assert {"gemv_q4g64_n10240_k5120_m32_w4t1_p1_sm90", "gemv_q4g64_n34816_k5120_m32_silu_w4t2_p1_rs_sm90",
                "gemv_q5g64_n5120_k17408_m32_res_w4t1_s6_p1_hn_sm90",
                "gemv_w8g32_n248320_k5120_m32_f32_w4t2_p1_sm90"} <= s19
    assert not any("_d" in n.split("_sm")[0].split("_")[-1] for n in s19)          # no load depth in session 19


def test_every_kernel_lab_group_plans_valid_keys():
    """Each group's thunks carry a key (built in one parallel batch before timing), for the H200's path and the
    3090's; the verify group's `in_plan` counts sum to the plan's GEMV launches."""
    for arch in ("sm_90", "sm_86"):
        target = lookup(arch)
        labels = Counter()
        for label, items in kernel_lab.plan(target, (1, 32)):
            labels[label] += len(items)
            for item in items:
                assert hasattr(item, "key") and {f.name for f in fields(item.key)} >= {"arch"}, label
                assert item.key.arch == target.arch, (label, item.key.name)
        assert labels["verify"] == 2 * len(kernel_lab.VERIFY_VARIANTS) * 14 and labels["buckets"] == 3 * 14
