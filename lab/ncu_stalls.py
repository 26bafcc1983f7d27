"""ncu_stalls: where a kernel's warps wait, per SASS instruction — reads Nsight Compute's source page (CSV, SASS view:
`ncu -i REPORT --page source --csv --print-source sass`) and prints the sampled stalls summed by opcode and by stall
reason, then the instructions with the most samples (address, SASS, samples, top reasons). Device-side companion of
lab/gemv_ncu.py: the report must hold the SourceCounters section (PC sampling).

    ncu --section SourceCounters --kernel-name regex:gemv --launch-skip 4 --launch-count 1 -o /tmp/r \\
        python -m lab.gemv_ncu --shapes q6_k:5120x17408:residual
    ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass > /tmp/r.csv
    python -m lab.ncu_stalls /tmp/r.csv
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("==")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), 0)   # after the "Kernel Name" line
    lines = lines[start:]
    rows = list(csv.DictReader(lines))
    if not rows:
        sys.exit("no rows in the source page")
    cols = list(rows[0])
    src = next((c for c in cols if c.lower() == "source"), cols[1])
    total = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    if total is None:
        print("columns:", cols)
        sys.exit("no 'Warp Stall Sampling (All Samples)' column (was SourceCounters collected?)")
    # per-reason sample columns: names like 'stall_long_sb' or 'Stall Long Scoreboard' (ncu versions differ)
    reasons = [c for c in cols if re.search(r"stall", c, re.I) and c != total and "Not-issued" not in c
               and "Not Issued" not in c and "Sampling" not in c]
    by_op, by_reason, all_samples = Counter(), Counter(), 0.0
    for r in rows:
        s = _num(r.get(total, "0"))
        all_samples += s
        op = (r.get(src) or "").split()
        op = next((w for w in op if not w.startswith("@")), "?").split(".")[0]
        by_op[op] += s
        for c in reasons:
            by_reason[c] += _num(r.get(c, "0"))
    print(f"{len(rows)} SASS rows, {all_samples:.0f} samples; reason columns: {len(reasons)}")
    print("by opcode:", " ".join(f"{o}:{v / all_samples:.1%}" for o, v in by_op.most_common(16)))
    if by_reason:
        tot = sum(by_reason.values()) or 1
        print("by reason:", " ".join(f"{c}:{v / tot:.1%}" for c, v in by_reason.most_common(10) if v))
    print(f"top {args.top} instructions:")
    for r in sorted(rows, key=lambda r: -_num(r.get(total, "0")))[: args.top]:
        s = _num(r.get(total, "0"))
        top = sorted(((_num(r.get(c, "0")), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c}={v:.0f}" for v, c in top if v)
        print(f"  {r.get('Address', '?'):>6} {s / all_samples:6.1%}  {(r.get(src) or '')[:70]:<70} {why}")


if __name__ == "__main__":
    main()
