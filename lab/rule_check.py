"""rule_check: are the decode-GEMV keys an experiment rule (NINFER_GEMV syntax, compiler.kernels.gemv_rules) makes
still correct? Before a rule's A/B in a whole step, each k-quant projection of the 27B Q4_K_M step it changes — with
the step's folds (the output projection's norm_out, the GDN input projection's scale_in) — runs on the GPU against
its reference (tests/gpu/harness: poisoned outputs, the family's tolerances) at M = 1, 8 and 32 (a split count is the
shape's at every M, so a row's bits stay independent of M: the batch-invariance tests cover split-K). Prints one line
per key and exits 1 on any failure.

    python -m lab.rule_check "q6_k/5120x17408:splits=3;q4_k/5120x6144:splits=2"
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from compiler.kernels import gemv, gemv_rules
from lab.cases import make_case

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
import harness  # noqa: E402

SHAPES = (("q4_k", 34816, 5120, "silu_mul", {}), ("q4_k", 5120, 17408, "residual", {}),
          ("q6_k", 5120, 17408, "residual", {}), ("q4_k", 5120, 6144, "residual", {"norm_out": True}),
          ("q4_k", 6144, 5120, "none", {"scale_in": True, "eps": 1e-6}), ("q5_k", 10240, 5120, "none", {"conv": 4}),
          ("q4_k", 1024, 5120, "none", {}), ("q6_k", 1024, 5120, "none", {}))


def keys_of(rule: str, ms=(1, 8, 32)) -> list:
    """The keys the rule changes (shipped key ≠ ruled key), per shape and M."""
    out = []
    for fmt, n, k, epi, folds in SHAPES:
        for m in ms:
            key = replace(gemv.make_key(fmt, n, k, m, harness.TARGET, epi), **folds)
            ruled = gemv_rules.apply_overrides(key, rule)
            if ruled != key:
                out.append(ruled)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rule", help="NINFER_GEMV-style rules, e.g. q6_k/5120x17408:splits=3")
    args = ap.parse_args(argv)
    keys = keys_of(args.rule)
    if not keys:
        print(f"rule {args.rule!r} changes none of the step's k-quant keys")
        return 1
    harness.build(keys)
    failed = 0
    for key in keys:
        try:
            case = make_case(key, "cuda", seed=11)
            harness.run(case)
            harness.compare(case, key.name)
            print(f"{key.name}: matches the reference")
        except AssertionError as err:
            failed += 1
            print(f"{key.name}: FAILED {err}")
    print(f"{len(keys)} keys, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
