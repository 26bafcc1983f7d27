"""vision_bench: issue 33's 27B line on the GPU — random 27B weights with the vision tower, 8 lanes of 16K
context over the largest shared KV pool the memory plan leaves beside the tower: a 1024×1024 image's encoder
time and image tokens, the TTFT of that image + a 100-token question (alone, no prefix cache), then 8 such
requests at once (K = 3) with their decode tok/s, and the device peak against the plan's and the 24 GiB budget.

    python -m lab.vision_bench --out /tmp/vision.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--side", type=int, default=1024, help="the image's width and height in pixels")
    p.add_argument("--question", type=int, default=100, help="text tokens after the image")
    p.add_argument("--new", type=int, default=64, help="tokens each cohort request generates")
    p.add_argument("--vision-kernels", action="store_true", help="the tower on the compiler's encoder plans "
                   "(executor.vision_plan) instead of torch")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="any machine: the same flow on the reference backend with "
                   "the tiny vision spec, 2 lanes, a 96-pixel image (checks the script, measures nothing)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.spec, args.lanes, args.context, args.side, args.question, args.new = \
            "model_specs/qwen3.8-tiny-vl.yaml", 2, 1024, 96, 10, 4

    from PIL import Image

    from compiler.spec import load_spec
    from ninfer_gen.api import load
    from ninfer_gen.cli.env import build_root
    from ninfer_gen.engine import Engine, Request
    from ninfer_gen.executor.memory_plan import GiB, plan_memory
    from ninfer_gen.executor.vision_encoder import DEFAULT_PATCHES

    spec = load_spec(args.spec)
    budget = 24 * GiB
    room = plan_memory(spec, args.lanes, args.context, budget, kv_pool_tokens=args.context,
                       prefix_states=0, vision_patches=DEFAULT_PATCHES)
    pool = min(args.lanes * args.context, room.kv_pages * spec.runtime.page_size)
    if args.dry_run:
        model = load(args.spec, max_context=args.context)
    else:
        model = load(args.spec, backend="gpu", random_weights="device", cohorts=args.lanes, max_context=args.context,
                     kv_pool_tokens=pool, draft=3, build_root=build_root(), progress=True, vram_budget=budget,
                     vision_kernels=args.vision_kernels)
    be = model.backend
    cuda = torch.cuda.is_available() and not args.dry_run
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 255, (args.side, args.side, 3), dtype=np.uint8))
    images = model.prepare_images([picture])
    sync()
    times = []
    for _ in range(4):                                     # the first warms torch's kernels and allocator up
        t0 = time.perf_counter()
        be.encode(images.pixels, images.grids)
        sync()
        times.append(time.perf_counter() - t0)
    v = spec.vision
    question = rng.integers(1, min(v.vision_start_token_id, 100000), args.question).tolist()   # text ids
    prompt = model.image_prompt(question, images)
    lanes = model.lanes(args.lanes, prefix_cache=0)
    ttft = []
    for _ in range(3):
        engine = Engine(lanes, lanes=1)
        h = engine.submit(Request(prompt, 1, images=images))
        ttft.append(h.result().stats.ttft_s)
    engine = Engine(lanes, lanes=args.lanes)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    handles = [engine.submit(Request(prompt, args.new, draft=3, images=images)) for _ in range(args.lanes)]
    finals = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    errors = [f.error for f in finals if f.finish != "length"]
    decode = [f.stats.decode_tok_s for f in finals]
    r = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "image": f"{args.side}x{args.side}",
         "grid": images.grids[0],
         "image_tokens": images.tokens[0], "prompt_tokens": len(prompt), "encoder_ms": 1e3 * statistics.median(times[1:]),
         "encoder_first_ms": 1e3 * times[0], "ttft_ms": 1e3 * statistics.median(ttft[1:]),
         "lanes": args.lanes, "context": args.context, "kv_pool_tokens": pool,
         "cohort_wall_s": wall, "cohort_decode_tok_s_per_request": statistics.median(decode) if decode else 0.0,
         "errors": errors, "planned_peak_gib": (be.memory.peak if cuda else room.peak) / GiB,
         "vision_gib": (be.memory.vision if cuda else room.vision) / GiB,
         "device_peak_gib": torch.cuda.max_memory_reserved() / GiB if cuda else 0.0, "budget_gib": budget / GiB,
         "tower_blocks": v.depth}
    print(json.dumps(r, indent=1))
    print(f"[{spec.name} + tower: {args.side}² image → {r['image_tokens']} tokens, encoder {r['encoder_ms']:.1f} ms, TTFT "
          f"(image + {args.question} tokens) {r['ttft_ms']:.0f} ms; C{args.lanes} × {args.context} (pool {pool}): "
          f"{r['cohort_decode_tok_s_per_request']:.1f} tok/s per request; peak {r['device_peak_gib']:.2f} GiB "
          f"(planned {r['planned_peak_gib']:.2f}, budget {r['budget_gib']:.0f})]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
