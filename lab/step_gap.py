"""step_gap: what the host's read of each plain step costs the GPU lanes (the next-session item "plain steps in
flight", lab/NOTES.md sessions 31–32). A plain step (lanes.gpu.GpuLanes._steps) sets its inputs, replays the step
graph, then waits for its tokens on the host (argmax, `.tolist()`) before the next step's inputs go up, so the
device idles between steps. This times, per step bucket b, on throwaway lanes of a one-token prompt
(lanes.round_costs.throwaway_lanes):

  engine   the adapter's own plain steps (`lanes.round` with K = 0), back to back — what a K = 0 lane runs;
  replay   the same bucket's graph replayed back to back with its inputs left as set — the device's step alone;
  parts    the host's pieces of one engine step, each timed alone: inputs.set, argmax + tolist after a drained step.

engine − replay is the gap in-flight plain steps could take back (an upper bound: the device's step for a new token
also reads one more KV position). Random weights of the spec, drawn on the device.

  python -m lab.step_gap [--spec model_specs/qwen3.8-27b.yaml] [--iters 24] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ninfer_gen.lanes.gpu import GpuLanes
from ninfer_gen.lanes.round_costs import period_s, raise_failed, throwaway_lanes


def _host_ms(call, n: int) -> float:
    """Host milliseconds of `call()` with the device drained before each call (the call's own sync included)."""
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        total += time.perf_counter() - t0
    return total / n * 1e3


def measure(lanes: GpuLanes, b: int, iters: int) -> dict:
    be = lanes.be
    with throwaway_lanes(lanes, b, 0) as probe:
        engine_ms = 1e3 * period_s(lambda: raise_failed(lanes.round(probe)), iters, be.device)
        bucket = be.bucket("step", b, 1)
        replay_ms = 1e3 * period_s(lambda: bucket.run(be.use_graphs), iters, be.device)
        logits = bucket.logits.view(b, -1)
        read_ms = _host_ms(lambda: logits.argmax(-1).tolist(), iters)

        def inputs():
            bucket.inputs.set([[lane.anchor] for lane in probe], [lane.length for lane in probe],
                              [lane.seq.table.pages for lane in probe], [lane.slot for lane in probe],
                              [lane.seq.positions for lane in probe])
        set_ms = _host_ms(inputs, iters)
    return {"batch": b, "engine_ms": engine_ms, "replay_ms": replay_ms, "gap_ms": engine_ms - replay_ms,
            "gap_share": (engine_ms - replay_ms) / engine_ms, "inputs_set_ms": set_ms, "argmax_tolist_ms": read_ms}


def main(argv=None) -> int:
    import ninfer_gen
    from ninfer_gen.cli.env import build_root, compile_options

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = ninfer_gen.load(args.spec, backend="gpu", max_context=args.context, random_weights="device", progress=True,
                            compile_options=compile_options(), build_root=build_root(), draft=0, cohorts=args.lanes,
                            vision=False)
    lanes = GpuLanes.for_model(model, args.lanes)
    rows = []
    print(f"{args.spec}: plain steps on {torch.cuda.get_device_name()}, {args.iters} a figure")
    print("  b  engine ms  replay ms  gap ms  gap %  inputs.set ms  argmax+tolist ms")
    for b in lanes.step_sizes:
        if b > args.lanes:
            continue
        r = measure(lanes, b, args.iters)
        rows.append(r)
        print(f"{b:3d}  {r['engine_ms']:9.3f}  {r['replay_ms']:9.3f}  {r['gap_ms']:6.3f}  {100 * r['gap_share']:5.1f}  "
              f"{r['inputs_set_ms']:13.3f}  {r['argmax_tolist_ms']:16.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"spec": args.spec, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
