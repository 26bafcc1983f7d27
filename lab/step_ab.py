"""step_ab: same-run A/B of decode-step variants on the 27B shape (weights drawn on the device). One
process, one weight set, one sequence: each variant is planned, compiled and captured as its own
step graph over the same inputs, and the graphs are timed in alternating rounds, so the ratios are
free of run-to-run drift. Variants whose kernels spill are reported and skipped. Optionally the
omission profile (ninfer_gen.cli.bench.omission_profile) of some of them.

    python -m lab.step_ab --variants "base|5120x6144:min_blocks=3|env:NINFER_NORM_FOLD=0" --omission 0,1

Variants are separated by '|'. A variant is a decode-GEMV override (CompileOptions.gemv, parsed by
compiler/kernels/gemv_rules.py: ';'-separated rules, each optionally limited to a shape NxK),
or `env:NAME=value,...`: NINFER_* variables turned into that variant's CompileOptions (ninfer_gen.cli.env;
e.g. `env:NINFER_NORM_FOLD=0` keeps the norm kernels, `env:NINFER_CONCURRENCY=1` runs the graph serially);
`base` (or an empty string) is the shipped configuration.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

import ninfer_gen
from compiler.buckets import plan_bucket
from compiler.options import CompileOptions
from ninfer_gen.cli.bench import copy_bandwidth, omission_profile, step_bytes, time_replays
from ninfer_gen.cli.env import build_root, compile_options
from ninfer_gen.executor.executable import Bucket
from ninfer_gen.executor.memory_plan import GiB


def load_at_context(spec: str, context: int, max_context: int | None = None, arch_path: str | None = None,
                    weights: str | None = None):
    """(model, seq): `spec` on the GPU with weights drawn on the device under the 24 GiB budget (or the checkpoint /
    GGUF `weights`, as `ninfer-gen bench --weights` loads it), and one sequence prefilled with `context` seeded random
    tokens (the state a timed decode step starts from). `max_context` (default context + 256) sizes the KV pool and the
    attention buckets (`ninfer-gen bench` loads for its longest prompt, 32K + 64). `arch_path`: another arch's code
    path (e.g. sm_86 PTX, JIT-compiled)."""
    model = ninfer_gen.load(weights or spec, backend="gpu", max_context=max_context or context + 256,
                            vram_budget=24 * GiB, random_weights="host" if weights else "device", progress=True,
                            build_root=build_root(), arch_path=arch_path, vision=False)
    ids = torch.randint(0, model.spec.model.vocab_size, (context,), generator=torch.Generator().manual_seed(5))
    seq = model.backend.new_sequence()
    model.backend.prefill(seq, ids.tolist())
    return model, seq


def variant_options(v: str) -> CompileOptions:
    """The CompileOptions a variant is planned with."""
    if v.startswith("env:"):
        pairs = [item.partition("=") for item in v[4:].split(",") if item.strip()]
        if any(not name.strip() or not eq for name, eq, _ in pairs):
            raise SystemExit(f"variant {v!r}: expected env:NAME=value[,NAME=value...]")
        return compile_options({name.strip(): value.strip() for name, _, value in pairs})
    return CompileOptions(gemv="" if v == "base" else v)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml")
    ap.add_argument("--variants", default="base",
                    help="'|'-separated NINFER_GEMV overrides or env:NAME=value settings ('base': none)")
    ap.add_argument("--context", type=int, default=542, help="tokens in the sequence before the timed step")
    ap.add_argument("--max-context", type=int, default=None, help="KV pool / attention bucket size "
                    "(default: context + 256; the bench loads for 32,832)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50, help="replays per timing (median)")
    ap.add_argument("--omission", default="", help="comma-separated indices of variants to profile")
    ap.add_argument("--arch-path", default=None, help="plan and run another card's code path (rtx3090: the RTX 3090's "
                    "kernels; sm_86: that arch's code sized for this GPU's SMs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split("|")]

    model, seq = load_at_context(args.spec, args.context, args.max_context, args.arch_path)
    be, spec = model.backend, model.spec
    exe = be.exe
    shipped = be.bucket("step", 1, 1)
    buckets: dict[str, Bucket] = {}
    for v in variants:
        plan = plan_bucket(spec, exe.target, "step", 1, 1, replace(be.profile, options=variant_options(v)))
        exe.kernels.build(plan.keys())
        spills = sorted({k.name for k in plan.keys()} & set(exe.kernels.spilled()))
        if spills:
            print(f"variant {v!r}: skipped, spills in {', '.join(spills)}")
            continue
        buckets[v] = exe.bind_plan(plan, inputs=shipped.inputs)   # the shipped bucket's inputs: one sequence
    for b in buckets.values():             # bound only once all fit: binding a larger plan moves the arena
        exe._bind(b)
        exe.capture(b)
    be.run("step", [seq], [[1]])                     # the sequence's inputs, shared by every variant's graph
    copy = copy_bandwidth()
    moved = step_bytes(spec, shipped.plan, args.context, be.state.kv_dtype)["total"]

    times: dict[str, list[float]] = {v: [] for v in buckets}
    for _ in range(args.rounds):
        for v, b in buckets.items():
            times[v].append(statistics.median(time_replays(b, args.iters)))
    out = {"copy_GBps": copy, "bytes_per_step": moved, "context": args.context, "arch": exe.target.arch, "variants": {}}
    names = list(buckets)
    base = statistics.median(times[names[0]])
    print(f"copy {copy:.0f} GB/s, {moved / 1e9:.2f} GB per step, context {args.context}, {exe.target.arch} code")
    print(f"{'#':>2} {'step ms':>8} {'% copy':>7} {'vs #0':>6} {'launches':>8}  rounds / variant")
    for i, v in enumerate(names):
        ms = statistics.median(times[v])
        eff = moved / (ms * 1e-3) / 1e9 / copy
        out["variants"][v] = {"step_ms": ms, "rounds_ms": times[v], "efficiency": eff,
                              "launches": buckets[v].plan.launches}
        print(f"{i:>2} {ms:8.3f} {100 * eff:6.1f}% {ms / base:6.3f} {buckets[v].plan.launches:>8}  "
              + " ".join(f"{t:.3f}" for t in times[v]) + f"  {v}")
    for i in [int(x) for x in args.omission.split(",") if x.strip()]:
        v = names[i]
        prof = omission_profile(buckets[v])
        out["variants"][v]["omission_us"] = prof
        print(f"omission #{i}: " + ", ".join(f"{k} {p['saved_us']:.0f} ({p['launches']})"
                                             for k, p in list(prof.items())[:10]))
    be.release(seq)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
