"""gemv_ncu: the shipped decode GEMVs of the 27B spec (M = 1, or `--m` rows: 32 is the C8 verify), launched back
to back over rotated weight copies (bigger than L2), for a profiler to read: run it under Nsight Compute to see where a shape's
warps stall. Each shape is launched `--launches` times after a warm-up; the kernel names say the shape.
A shape may end in `:RULE`, an experiment rule of `compiler.kernels.gemv_rules` (e.g.
`q4_k:34816x5120:silu_mul:stage_w=2`), to profile a variant.

    ncu --clock-control none --kernel-name regex:gemv --launch-skip 8 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python -m lab.gemv_ncu --shapes q5g64:5120x17408:residual
"""
from __future__ import annotations

import argparse

import torch

from compiler.kernels.gemv_rules import apply_overrides
from lab.kernel_lab import KERNELS, gemv_runs, time_chain
from compiler.targets import lookup

DEFAULT = "q5g64:5120x17408:residual,q4g64:34816x5120:silu_mul,q5g64:5120x6144:residual"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT, help="comma-separated FMT:NxK:EPILOGUE[:RULE]")
    ap.add_argument("--launches", type=int, default=12)
    ap.add_argument("--m", type=int, default=1, help="activation rows (1 … 32)")
    args = ap.parse_args(argv)
    major, minor = torch.cuda.get_device_capability()
    target = lookup(f"sm_{major}{minor}")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    thunks = []
    for shape in args.shapes.split(","):
        fmt, nk, epi, *rule = shape.split(":")
        n, k = (int(v) for v in nk.split("x"))
        cfg = [lambda key, r=rule[0]: apply_overrides(key, r)] if rule else None
        thunks += gemv_runs(fmt, n, k, [args.m], epi, "bf16", target, l2, cfg)
    KERNELS.build([t.key for t in thunks])
    for thunk in thunks:
        key, runs, *_ = thunk()
        us = time_chain(runs, args.launches)
        print(f"{key.name}: {us:.1f} us per launch (chained, {args.launches} launches)", flush=True)


if __name__ == "__main__":
    main()
