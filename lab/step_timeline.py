"""step_timeline: where a replayed 27B decode step's time goes, kernel by kernel, from a CUPTI trace
(torch.profiler) of graph replays. Each kernel is charged its *advance*: how far it moves the end of the
work done so far (kernels sorted by end time; advance = end − the latest earlier end, ≥ 0). Advances
add up to the replay's span, so unlike summed durations (which double-count programmatic-launch
overlap and parallel branches) they split the step between kernel groups — the critical path as the
GPU ran it, including each kernel's share of launch and dependency latency.

    python -m lab.step_timeline [--context 542] [--replays 5] [--json out.json] [--weights model.gguf]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lab.step_ab import load_at_context


def group_of(name: str) -> str:
    """Kernel name → its group: 'gemv q5g64 5120x17408', else the family words before the first shape token."""
    m = re.match(r"gemv_(\w+?)_n(\d+)_k(\d+)", name)
    if m:
        return f"gemv {m.group(1)} {m.group(2)}x{m.group(3)}"
    words = []
    for w in name.split("_"):
        if any(c.isdigit() for c in w):
            break
        words.append(w)
    return "_".join(words) or name


def replay_kernels(prof, replays: int) -> list[list[tuple[str, float, float]]]:
    """The traced kernels as (name, start µs, end µs), cut into `replays` equal runs of the graph."""
    ks = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ("Memcpy", "Memset")),
                key=lambda k: k[1])
    per = len(ks) // replays
    return [ks[i * per:(i + 1) * per] for i in range(replays)]


def advances(kernels: list[tuple[str, float, float]]) -> tuple[float, dict[str, dict]]:
    """(span µs, {group: launches, advance µs, summed duration µs})."""
    t0 = min(k[1] for k in kernels)
    frontier, out = t0, defaultdict(lambda: {"launches": 0, "advance_us": 0.0, "duration_us": 0.0})
    for name, start, end in sorted(kernels, key=lambda k: k[2]):
        g = out[group_of(name)]
        g["launches"] += 1
        g["advance_us"] += max(0.0, end - frontier)
        g["duration_us"] += end - start
        frontier = max(frontier, end)
    return frontier - t0, dict(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml")
    ap.add_argument("--context", type=int, default=542, help="tokens in the sequence before the traced steps")
    ap.add_argument("--max-context", type=int, default=None, help="KV pool / attention bucket size "
                    "(default: context + 256; the bench loads for 32,832)")
    ap.add_argument("--weights", default=None, help="a checkpoint or GGUF to load instead of the spec's random weights")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, seq = load_at_context(args.spec, args.context, args.max_context, weights=args.weights)
    be = model.backend
    be.run("step", [seq], [[1]])
    bucket = be.bucket("step", 1, 1)
    for _ in range(5):
        bucket.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            bucket.run()
            torch.cuda.synchronize()            # replays apart, so each is cut out whole
    runs = [advances(k) for k in replay_kernels(prof, args.replays)]
    spans = [s for s, _ in runs]
    span, groups = runs[spans.index(statistics.median_low(spans))]
    order = sorted(groups.items(), key=lambda kv: -kv[1]["advance_us"])
    print(f"replay span {span:.0f} µs (median of {args.replays}; spans {', '.join(f'{s:.0f}' for s in spans)})")
    print(f"{'group':<28} {'launches':>8} {'advance µs':>11} {'share':>6} {'µs/launch':>10} {'Σ duration':>11}")
    for g, v in order:
        print(f"{g:<28} {v['launches']:>8} {v['advance_us']:>11.0f} {100 * v['advance_us'] / span:>5.1f}% "
              f"{v['advance_us'] / v['launches']:>10.2f} {v['duration_us']:>11.0f}")
    be.release(seq)
    out = {"span_us": span, "spans_us": spans, "groups": dict(order)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
