"""cohort_gpu: the cohort engine's GPU acceptance figures that are not throughput (issue 21), in one process:

  memory   the 27B model (random weights drawn on the device), K = 3, 24 GiB budget, 8 lanes sharing one
           16K-token KV pool: peak device bytes (torch's allocator and the device's used memory) after
           start-up and after 8 lanes decoded together; then 8 lanes × 16K tokens each (a second load);
           8 × 32K each must be refused by the memory plan (its message printed);
  ttft     after start-up (every bucket and round graph captured), the first request of each of 10
           prompt lengths between 20 and 5,000 tokens against the same request repeated: TTFT ratio.

    PYTHONPATH=. python3 -m lab.cohort_gpu --json out.json [--spec model_specs/qwen3.8-27b.yaml]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

GiB = 2 ** 30


def used_device_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def load_lanes(spec: str, max_context: int, kv_pool_tokens: int | None, accept_prob: float):
    from ninfer_gen.api import load

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = load(spec, backend="gpu", random_weights="device", cohorts=8, draft=3, accept_coin=True,
                 max_context=max_context, kv_pool_tokens=kv_pool_tokens)
    lanes = model.lanes(8, accept_prob=accept_prob)      # captured and warmed up: start-up
    return model, lanes, time.perf_counter() - t


def decode_together(lanes, n: int, tokens: int) -> dict:
    from ninfer_gen.engine import Engine, Request

    engine = Engine(lanes, lanes=n, max_queue=n)
    rng = random.Random(0)
    handles = [engine.submit(Request([rng.randrange(1, 100000) for _ in range(30)], tokens, draft=3))
               for _ in range(n)]
    t = time.perf_counter()
    engine.run_until_idle()
    wall = time.perf_counter() - t
    out = sum(len(h.tokens) for h in handles)
    return {"lanes": n, "tokens": out, "wall_s": wall, "tok_s": out / wall}


def memory_row(name: str, model, lanes, startup_s: float, tokens: int) -> dict:
    row = {"setting": name, "startup_s": startup_s, "after_startup_device": used_device_bytes()}
    row["run"] = decode_together(lanes, 8, tokens)
    row["peak_allocated"] = torch.cuda.max_memory_allocated()
    row["device_used"] = used_device_bytes()
    row["kv_pages"] = model.backend.blocks.num_pages
    print(f"[{name}: start-up {startup_s:.1f} s; allocator peak {row['peak_allocated'] / GiB:.2f} GiB, device used "
          f"{row['device_used'] / GiB:.2f} GiB; 8 lanes {row['run']['tok_s']:.1f} tok/s]", flush=True)
    return row


def ttft_cold(lanes, vocab: int) -> list[dict]:
    from ninfer_gen.engine import Engine, Request

    engine = Engine(lanes, lanes=1, max_queue=4)
    lengths = [20, 37, 100, 250, 513, 999, 1700, 2500, 3800, 5000]
    rows = []
    for n in lengths:
        prompt = [random.Random(n).randrange(1, vocab) for _ in range(n)]
        times = []
        for _ in range(2):
            h = engine.submit(Request(prompt, 2, draft=3))
            h.result()
            times.append(h.final.stats.ttft_s)
        rows.append({"prompt": n, "first_ms": times[0] * 1e3, "repeat_ms": times[1] * 1e3,
                     "ratio": times[0] / times[1]})
        print(f"[prompt {n:5d}: first {times[0] * 1e3:8.1f} ms, repeated {times[1] * 1e3:8.1f} ms, "
              f"ratio {times[0] / times[1]:.2f}]", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml")
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per lane in the memory runs")
    p.add_argument("--accept-prob", type=float, default=0.8)
    args = p.parse_args(argv)
    from compiler.spec import load_spec
    from ninfer_gen.executor.memory_plan import MemoryPlanError, plan_memory

    spec = load_spec(args.spec)
    out = {"spec": args.spec, "device": torch.cuda.get_device_name()}
    model, lanes, startup = load_lanes(args.spec, 16384, 16384, args.accept_prob)
    out["ttft"] = ttft_cold(lanes, spec.model.vocab_size)
    worst = max(r["ratio"] for r in out["ttft"])
    print(f"TTFT first/repeated: worst {worst:.2f} (acceptance ≤ 1.5)")
    out["memory"] = [memory_row("C8, one shared 16K-token KV pool", model, lanes, startup, args.tokens)]
    del model, lanes
    gc.collect()
    torch.cuda.empty_cache()
    model, lanes, startup = load_lanes(args.spec, 16384, None, args.accept_prob)
    out["memory"].append(memory_row("C8 x 16K tokens per lane", model, lanes, startup, args.tokens))
    del model, lanes
    gc.collect()
    torch.cuda.empty_cache()
    try:
        plan_memory(spec, 8, 32768, 24 * GiB, draft=3)
        out["c8x32k"] = "fits (unexpected)"
    except MemoryPlanError as err:
        out["c8x32k"] = f"refused: {err}"
    print(f"C8 x 32K tokens per lane: {out['c8x32k']}")
    for r in out["memory"]:
        print(f"{r['setting']:<36} allocator peak {r['peak_allocated'] / GiB:6.2f} GiB   device used "
              f"{r['device_used'] / GiB:6.2f} GiB   KV pages {r['kv_pages']}")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
