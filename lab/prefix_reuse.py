"""prefix_reuse: the acceptance figure of issue 22 item 4 — the second turn of an 8K-token conversation
with and without prefix reuse: TTFT of each, their ratio, the tokens each prefilled, and whether the two
outputs are equal token for token (and how far apart their first logits are).

    python -m lab.prefix_reuse                          # the shipped small model on the reference backend
    python -m lab.prefix_reuse --draft 3 --repeats 3    # MTP drafts; the best TTFT of 3 runs each
    python -m lab.prefix_reuse --backend gpu [--weights DIR]

Turn 1 is `--first` tokens of this repository's Python source and `--answer` greedy tokens; turn 2 is
turn 1, its answer and `--new` more tokens. With reuse, turn 2 restores turn 1's answer checkpoint and
prefills the new tokens only; without, it prefills everything. Each TTFT is the best of `--repeats` runs,
after one warm-up of each (the reference traces a graph per new chunk shape on first use). Run it pinned
to two cores (`taskset -c 0,1`) to mimic the CI box; other processes on those cores distort it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # before torch loads: idle threads sleep

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def source_tokens(tokenizer, count: int) -> list[int]:
    """`count` tokens of the repository's Python source, files in a fixed order."""
    ids: list[int] = []
    for path in sorted((REPO / "ninfer_gen").rglob("*.py")) + sorted((REPO / "compiler").rglob("*.py")):
        ids += tokenizer.encode(path.read_text())
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"the repository's source has only {len(ids)} tokens, fewer than {count}")


def turn(model, prompt: list[int], answer: int, draft: int, prefix_cache: int, lanes=None) -> dict:
    """One request through its own engine: its tokens, TTFT, prompt tokens prefilled and cached, and the
    logits row its first token was chosen from."""
    from ninfer_gen.engine import Engine, Request

    lanes = lanes or model.lanes(1, prefix_cache=prefix_cache)
    lanes_module = sys.modules[type(lanes).__module__]   # lanes.contract or lanes.gpu: its `choose`
    first_logits = []
    choose = lanes_module.choose                         # the row the first token is chosen from (ReferenceLanes)
    lanes_module.choose = lambda lane, row: (first_logits.append(row.clone()) if not first_logits else None,
                                             choose(lane, row))[1]
    try:
        engine = Engine(lanes, lanes=1)
        handle = engine.submit(Request(prompt, answer, draft=draft))
        final = handle.result()
    finally:
        lanes_module.choose = choose
    stats = engine.stats()
    return {"tokens": handle.tokens, "ttft_s": final.stats.ttft_s, "prefilled": stats["prefill_tokens"],
            "cached": final.stats.cached_tokens, "acceptance": final.stats.acceptance,
            "logits": first_logits[0] if first_logits else None, "lanes": lanes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="the model (default: the shipped small model)")
    ap.add_argument("--backend", default="reference", choices=("reference", "gpu"))
    ap.add_argument("--first", type=int, default=7600, help="turn 1's prompt tokens (default 7600)")
    ap.add_argument("--answer", type=int, default=64, help="greedy tokens per answer (default 64)")
    ap.add_argument("--new", type=int, default=400, help="turn 2's new tokens (default 400)")
    ap.add_argument("--draft", type=int, default=0, help="MTP drafts per round (default 0)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each turn 2 (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (reference)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import ninfer_gen

    context = args.first + args.new + 2 * args.answer + 64
    # the GPU: room in the KV pool for the run without reuse beside the checkpoints' pages (else it evicts them)
    gpu = dict(prefix_states=16, max_context=context, kv_pool_tokens=2 * context) if args.backend == "gpu" else {}
    model = ninfer_gen.load(args.weights, backend=args.backend, draft=args.draft or None, **gpu)
    ids = source_tokens(model.tokenizer, args.first + args.new)
    first = turn(model, ids[:args.first], args.answer, args.draft, 16)
    second = ids[:args.first] + first["tokens"] + ids[args.first:]
    reuse_lanes = first["lanes"]
    runs: dict[str, list[dict]] = {"reuse": [], "no_reuse": []}
    for i in range(args.repeats + 1):                 # run 0 warms up: graphs traced for the new chunk shapes
        fresh = turn(model, second, args.answer, args.draft, 0)
        reused = turn(model, second, args.answer, args.draft, 16, lanes=reuse_lanes)
        if i:
            runs["no_reuse"].append(fresh)
            runs["reuse"].append(reused)
    best = {k: min(v, key=lambda r: r["ttft_s"]) for k, v in runs.items()}
    r, n = best["reuse"], best["no_reuse"]
    delta = (r["logits"].float() - n["logits"].float()).abs().max().item() if r["logits"] is not None else None
    report = {"backend": args.backend, "model": str(model.source), "turn1_prompt": args.first,
              "turn2_prompt": len(second), "answer": args.answer, "draft": args.draft,
              "threads": torch.get_num_threads(), "turn1_ttft_s": first["ttft_s"],
              "ttft_no_reuse_s": n["ttft_s"], "ttft_reuse_s": r["ttft_s"], "ttft_ratio": n["ttft_s"] / r["ttft_s"],
              "prefilled_no_reuse": n["prefilled"], "prefilled_reuse": r["prefilled"], "cached_reuse": r["cached"],
              "tokens_equal": all(x["tokens"] == n["tokens"] for x in runs["reuse"] + runs["no_reuse"]),
              "first_logits_max_abs_diff": delta, "acceptance_reuse": r["acceptance"],
              "acceptance_no_reuse": n["acceptance"]}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['model']} on the {args.backend} backend, {report['threads']} threads, draft {args.draft}: "
          f"turn 1 {args.first} prompt tokens + {args.answer} answer, turn 2 {len(second)} prompt tokens")
    print(f"  turn 2 without reuse: TTFT {n['ttft_s'] * 1e3:9.1f} ms, {n['prefilled']} tokens prefilled")
    print(f"  turn 2 with reuse:    TTFT {r['ttft_s'] * 1e3:9.1f} ms, {r['prefilled']} tokens prefilled, "
          f"{r['cached']} restored")
    print(f"  TTFT ratio {report['ttft_ratio']:.1f}x; outputs equal token for token: {report['tokens_equal']}; "
          f"first logits max |diff| {delta}")
    if args.draft:
        print(f"  acceptance: with reuse {r['acceptance']:.3f}, without {n['acceptance']:.3f}")
    return 0 if report["tokens_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
