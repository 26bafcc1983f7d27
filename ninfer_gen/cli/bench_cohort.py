"""bench_cohort: `ninfer-gen bench --concurrency 1,2,4,8` and `--long-prompt N` — the reference workload run
as a cohort through engine.Engine over the lanes Model.lanes makes (the GPU adapter, or
ReferenceLanes on the CPU). Owns the workload, its timings and the report (table, JSON, PNG plot); the
stepping, memory and plotting are bench_common's, the numbers come from the engine and its backend, and
torch is imported only when a bench runs.

Per concurrency C, with K drafts and then without (draft 0): C requests of `--prompt-tokens` tokens each
(distinct windows of a fixed text where the model has a tokenizer, else seeded random ids), submitted at
once, each asking for `--output-tokens` greedy tokens, after an untimed warm-up at the same C. The engine is
stepped by hand and every token arrival stamped after its step. End to end tok/s: every output token / the
wall time from the submits to the last token; decode tok/s: the tokens of the steps after every request
has its first one / that stretch; TTFT: the engine's submit → first token per request (mean, p50, max);
acceptance and tokens per round from the engine's per-request counts; peak memory of the timed run: on the
GPU torch's allocator peak and the device's used bytes (every process and context, sampled), on the CPU
the resident set's high-water mark.

`--long-prompt N`, what a long prompt arriving costs the decoding lanes, is bench_interference's.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from ninfer_gen.cli.bench_interference import MIN_CHUNK, WINDOW
from ninfer_gen.cli.bench_common import (MEMORY_HEAD_GPU, Driver, Memory, device_name, int_list, lane_tokens,
                                         line_plot, load_model, memory_text, pick_backend, random_ids, write_report)

LONG_DEFAULT = {"gpu": 32768, "reference": 2048}
# distinct prompts for models with a real tokenizer: windows of this text (not in the small model's corpus)
TEXT = '''
def merge_intervals(intervals):
    """Merge overlapping [start, end] pairs and return them sorted."""
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key, default=None):
        if key not in self.items:
            return default
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        while len(self.items) > self.capacity:
            self.items.pop(next(iter(self.items)))

'''


def add_arguments(p) -> None:
    """The cohort bench's options on the bench command's parser (the shared ones are the bench's)."""
    p.add_argument("--concurrency", default=None, metavar="C,C,...", help="cohort bench: run the reference "
                   "workload with C requests at once through the cohort engine for each C of this list (e.g. "
                   "1,2,4,8), with --draft K (default 3) and then without drafts; prints a table, writes --json and "
                   "a PNG plot beside it. "
                   "Runs on the CPU too (--backend reference). Of the options above it takes --weights, "
                   "--prompt-tokens, --output-tokens, --draft, --accept-prob, --draft-vocab, --vram-budget, --json")
    from ninfer_gen.cli.bench_agent import add_arguments as add_agent_arguments
    add_agent_arguments(p)                  # --workload agent and its options
    p.add_argument("--no-plain", action="store_true", help="cohort bench: skip the runs without drafts")
    p.add_argument("--cohort-repeats", type=int, default=1, metavar="N", help="cohort bench: run every kind N times "
                   "in turn (MTP, adaptive, plain, MTP, ...) and report each row's run of median end-to-end speed, "
                   "with every run's figure in the JSON: kinds compared a few %% apart need it (the GPU's clocks "
                   "drift between runs)")
    p.add_argument("--adaptive", action="store_true", help="cohort bench: also run with the engine's adaptive draft "
                   "length (each lane K or plain steps by its tokens per round against the measured round cost)")
    p.add_argument("--long-prompt", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="cohort bench: --running-lanes requests decode, then one N-token prompt arrives: its TTFT "
                   "and the running lanes' gaps between tokens before, during and after its prefill (N default: "
                   f"{LONG_DEFAULT['gpu']:,} on the GPU, {LONG_DEFAULT['reference']:,} on the reference backend)")
    p.add_argument("--running-lanes", type=int, default=7, help="--long-prompt: lanes decoding when it arrives "
                   "(default 7)")
    p.add_argument("--prefill-budget", type=int, default=None, help="cohort bench: prompt tokens the engine "
                   "prefills per step between decode rounds (default: the backend's prefill chunk)")
    p.add_argument("--max-gap-ms", type=float, default=None, help="--long-prompt: the engine prefills only as many "
                   "prompt tokens per step as keep a decoding lane's gap between tokens under this bound "
                   "(engine.prefill_policy; default: no bound, the whole --prefill-budget every step)")
    p.add_argument("--backend", choices=("auto", "gpu", "reference"), default="auto", help="cohort bench: gpu "
                   "(the compiled kernels, lanes.gpu), reference (the interpreter on the CPU, "
                   "ReferenceLanes) or auto (default: gpu when a CUDA device is visible)")
    p.add_argument("--batch-steps", action="store_true", help="cohort bench, reference backend: the plain lanes' "
                   "steps as one B-row call (faster on the CPU; rows equal to fp32 rounding)")


def _check(args, k: int) -> None:
    if k < 0:
        raise ValueError(f"--draft must be ≥ 0, got {k}")
    if args.accept_prob is not None and not (k > 0 and 0 <= args.accept_prob <= 1):
        raise ValueError("--accept-prob needs --draft K > 0 and a probability in [0, 1]")
    for name in ("prompt_tokens", "output_tokens", "running_lanes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.prefill_budget is not None and args.prefill_budget < 1:
        raise ValueError(f"--prefill-budget must be ≥ 1, got {args.prefill_budget}")
    if args.max_gap_ms is not None and args.max_gap_ms <= 0:
        raise ValueError(f"--max-gap-ms must be positive, got {args.max_gap_ms}")
    if args.long_prompt is not None and args.long_prompt < 0:
        raise ValueError(f"--long-prompt must be ≥ 1 tokens, got {args.long_prompt}")


def _prompts(model, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct prompts of `tokens` ids: windows of TEXT where the model has a tokenizer (real
    acceptance on a trained model), else seeded random ids (random weights)."""
    if model.tokenizer.name != "bytes":
        ids = model.tokenizer.encode(TEXT)
        stride = max(1, (len(ids) - tokens) // max(1, count - 1))
        windows = [ids[i * stride:i * stride + tokens] for i in range(count)]
        if len(ids) >= tokens and len({tuple(w) for w in windows}) == count and all(len(w) == tokens for w in windows):
            return windows
    return [random_ids(tokens, model.spec.model.vocab_size, 1000 + i) for i in range(count)]


def cohort_run(lanes, prompts: list[list[int]], c: int, k: int, args, memory: Memory, adaptive: bool = False) -> dict:
    """C requests at once (after an untimed warm-up at C): one row of the table. `adaptive`: the engine's
    adaptive draft length (a lane whose drafts do not pay drops to plain steps)."""
    from ninfer_gen.engine import Engine, Request

    engine = Engine(lanes, lanes=c, max_queue=c, prefill_budget=args.prefill_budget, adaptive_draft=adaptive)
    warm = [engine.submit(Request(p, min(args.output_tokens, 2 * k + 4), draft=k)) for p in prompts[c:2 * c]]
    engine.run_until_idle()
    Driver(engine, memory).finals(warm)
    memory.reset()
    rounds_before, by_k_before = engine.stats()["rounds"], engine.stats()["lane_rounds_by_k"]
    d = Driver(engine, memory)
    t0 = time.perf_counter()
    handles = [d.submit(Request(p, args.output_tokens, draft=k)) for p in prompts[:c]]
    while d.step():
        pass
    finals = d.finals(handles)
    stamps = [d.arrivals[h] for h in handles]
    end = max(s[-1][0] for s in stamps)
    all_first = max(stamps, key=lambda s: s[0][1])[0]           # the step that gave the last first token
    decode_tokens = sum(n for s in stamps for _, step, n in s if step > all_first[1])
    stats = [f.stats for f in finals]
    ttft = [s.ttft_s * 1e3 for s in stats]
    tokens = sum(s.tokens for s in stats)
    drafted, rounds = sum(s.drafted for s in stats), sum(s.rounds for s in stats)
    return {"concurrency": c, "draft": k, "output_tokens": tokens, "wall_s": end - t0, "e2e_tok_s": tokens / (end - t0),
            "decode_tok_s": decode_tokens / (end - all_first[0]) if end > all_first[0] else None,
            "ttft_ms": {"mean": statistics.fmean(ttft), "p50": statistics.median(ttft), "max": max(ttft)},
            "acceptance": sum(s.accepted for s in stats) / drafted if drafted else None,
            "tokens_per_round": sum(s.tokens - 1 for s in stats) / rounds if rounds else None,
            "engine_rounds": engine.stats()["rounds"] - rounds_before, "memory": memory.figures(),
            "lane_rounds_by_k": {j: n - by_k_before.get(j, 0) for j, n in engine.stats()["lane_rounds_by_k"].items()
                                 if n > by_k_before.get(j, 0)}}


def median_run(runs: list[dict]) -> dict:
    """The run of median end-to-end speed (the lower of the middle two), with every run's e2e and decode speeds."""
    chosen = sorted(runs, key=lambda r: r["e2e_tok_s"])[(len(runs) - 1) // 2]
    return chosen | {"repeats": [{"e2e_tok_s": r["e2e_tok_s"], "decode_tok_s": r["decode_tok_s"]} for r in runs]}


def _sizes(args, sweep: list[int], n: int, k: int) -> tuple[int, int, int]:
    """(lanes, context per lane, shared KV pool tokens) for the sweep and the long prompt; the running lanes
    of --long-prompt decode for WINDOW steps each side of its prefill of ≤ n / MIN_CHUNK steps."""
    run_ctx = args.prompt_tokens + args.output_tokens + 2 * k + 16 if sweep else 0
    smallest = 16 if args.max_gap_ms is not None else (args.prefill_budget or MIN_CHUNK)     # the pacer's floor
    steps = 2 * WINDOW + -(-n // smallest) + 8
    long_run_ctx = args.prompt_tokens + steps * (k + 1) if n else 0
    long_ctx = n + (WINDOW + 2) * (k + 1) + 16 if n else 0
    lanes = max(sweep + ([args.running_lanes + 1] if n else []))
    pool = max(max(sweep or [0]) * lane_tokens(run_ctx),
               lane_tokens(long_ctx) + args.running_lanes * lane_tokens(long_run_ctx))
    return lanes, max(run_ctx, long_run_ctx, long_ctx), pool


def run(args) -> dict:
    backend = pick_backend(args)
    k = 3 if args.draft is None else args.draft
    sweep = int_list(args.concurrency, "--concurrency") if args.concurrency else []
    _check(args, k)
    n = (args.long_prompt or LONG_DEFAULT[backend]) if args.long_prompt is not None else 0
    lanes, context, pool = _sizes(args, sweep, n, k)
    t0 = time.perf_counter()
    model = load_model(args, backend, k, lanes, context, pool)
    adapter_options = {"batch_steps": True} if args.batch_steps and backend == "reference" else {}

    adapter = model.lanes(lanes, accept_prob=args.accept_prob, **adapter_options)
    memory = Memory(backend == "gpu")
    result = {"model": model.source, "backend": backend, "device": device_name(backend), "draft": k,
              "accept_prob": args.accept_prob, "batch_steps": bool(adapter_options),
              "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "prefill_budget": args.prefill_budget or adapter.prefill_chunk,
              "max_context": adapter.max_context, "load_s": time.perf_counter() - t0, "runs": {}}
    prompts = _prompts(model, 2 * max(lanes, 1), args.prompt_tokens)
    kinds = ([("mtp", k)] if k else []) + ([("adaptive", k)] if k and args.adaptive else []) + \
        ([] if k and args.no_plain else [("plain", 0)])
    result["round_cost"] = dict(adapter.caps.round_cost)
    repeats = getattr(args, "cohort_repeats", 1)
    if repeats < 1:
        raise ValueError(f"--cohort-repeats must be ≥ 1, got {repeats}")
    runs = {(name, c): [] for name, _ in kinds for c in sweep}
    for _ in range(repeats):                     # the kinds in turn, so a drift of the clocks reaches each alike
        for name, draft in kinds if sweep else []:
            for c in sweep:
                runs[name, c].append(cohort_run(adapter, prompts, c, draft, args, memory, name == "adaptive"))
    for name, _ in kinds if sweep else []:
        result["runs"][name] = [median_run(runs[name, c]) for c in sweep]
    if n:
        from ninfer_gen.cli.bench_interference import interference
        result["interference"] = interference(adapter, prompts, n, k, args, memory, model.spec.model.vocab_size)
    return result


def table(r: dict) -> str:
    gpu = r["backend"] == "gpu"
    coin = f", --accept-prob {r['accept_prob']} (a coin per draft, bench only)" if r["accept_prob"] is not None else ""
    workload = (f"{r['prompt_tokens']}-token prompts, {r['output_tokens']} greedy tokens per request; "
                if r["runs"] else "")
    lines = [f"cohort bench: {r['model']}; {r['backend']} backend on {r['device']}; {workload}"
             f"prefill budget {r['prefill_budget']} tokens per step"]
    head = (f"{'C':>3} {'e2e tok/s':>10} {'decode tok/s':>13} {'TTFT mean / p50 / max ms':>26} {'accept':>7} "
            f"{'tok/round':>9} {MEMORY_HEAD_GPU if gpu else 'peak RSS MiB':>34}")
    titles = {"mtp": f"with MTP, K = {r['draft']}{coin}:", "plain": "plain decode (draft 0):",
              "adaptive": f"adaptive draft length, K = {r['draft']} or 0 per lane{coin} (round cost in plain steps: "
                          + (", ".join(f"C{b} {x:.2f}" for b, x in r.get("round_cost", {}).items())
                             or "not measured on this backend: K throughout") + "):"}
    for name, rows in r["runs"].items():
        lines += [titles[name], head]
        for x in rows:
            t = x["ttft_ms"]
            decode = f"{x['decode_tok_s']:13.1f}" if x["decode_tok_s"] is not None else f"{'-':>13}"
            accept = f"{x['acceptance']:7.1%}" if x["acceptance"] is not None else f"{'-':>7}"
            per_round = f"{x['tokens_per_round']:9.2f}" if x["tokens_per_round"] is not None else f"{'-':>9}"
            ttft = f"{t['mean']:,.0f} / {t['p50']:,.0f} / {t['max']:,.0f}"
            lines.append(f"{x['concurrency']:>3} {x['e2e_tok_s']:10.1f} {decode} {ttft:>26} {accept} {per_round} "
                         f"{memory_text(x['memory']):>34}")
            if name == "adaptive":
                share = x.get("lane_rounds_by_k", {})
                total = sum(share.values()) or 1
                lines.append(f"    lane rounds by K: " + ", ".join(f"K={j} {n / total:.0%}" for j, n in sorted(share.items())))
    for name in ("mtp", "adaptive"):
        if name in r["runs"] and "plain" in r["runs"]:
            lines.append(f"{'MTP' if name == 'mtp' else 'adaptive'} / plain, end to end: " + ", ".join(
                f"C={a['concurrency']} {a['e2e_tok_s'] / b['e2e_tok_s']:.2f}×"
                for a, b in zip(r["runs"][name], r["runs"]["plain"])))
    if "interference" in r:
        from ninfer_gen.cli.bench_interference import table_lines
        lines += table_lines(r["interference"])
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    """tok/s against concurrency, end to end and decode, with and without MTP."""
    labels = {"mtp": f"MTP K={r['draft']}", "plain": "no MTP", "adaptive": f"adaptive K={r['draft']}/0"}
    lines = []
    for name, rows in r["runs"].items():
        cs = [x["concurrency"] for x in rows]
        lines.append((f"{labels[name]}, end to end", cs, [x["e2e_tok_s"] for x in rows], "o-", name))
        decode = [(c, x["decode_tok_s"]) for c, x in zip(cs, rows) if x["decode_tok_s"] is not None]
        if decode:                   # none where every request is one token long
            lines.append((f"{labels[name]}, decode", *zip(*decode), "s--", name))
    line_plot(path, lines, xlabel="concurrent requests", ylabel="tokens/s (all requests)", xticks=cs, log2_x=True,
              title=f"{Path(str(r['model']).split(' ')[0]).name} on {r['device']}\n{r['prompt_tokens']}-token "
              f"prompts, {r['output_tokens']} tokens each")


def cmd_bench_cohort(args) -> int:
    result = run(args)
    write_report(result, args.json, plot if result["runs"] else None)
    print(table(result))
    return 0
