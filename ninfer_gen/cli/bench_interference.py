"""bench_interference: `ninfer-gen bench --long-prompt N` — what a long prompt arriving costs the lanes that
decode. `--running-lanes` (7) requests decode through engine.Engine; after WINDOW steps an N-token request
arrives and the engine prefills it `--prefill-budget` tokens per step (or, with `--max-gap-ms`, as many as keep
the running lanes' gap under that bound: engine.prefill_policy), one chunk between the running lanes' rounds.
Reported: its TTFT (and alone, the engine otherwise idle: the second of two runs, the first warming the chunk
shapes up), and the gaps between a running lane's token arrivals (one arrival per round) before,
during and after that prefill — p50, p99 and max over WINDOW steps each side. The stepping, stamps and
memory are bench_common's; this module owns the scenario and its table lines."""
from __future__ import annotations

from ninfer_gen.cli.bench_common import Driver, Memory, pct, random_ids

WINDOW = 32                   # --long-prompt: engine steps measured before and after the long prefill
MIN_CHUNK = 64                # --long-prompt: the smallest prefill budget the running lanes' context is sized for


def interference(lanes, prompts: list[list[int]], n: int, k: int, args, memory: Memory, vocab: int) -> dict:
    """The long request's TTFT alone and while `args.running_lanes` decode, and their gaps by phase."""
    from ninfer_gen.engine import Engine, Request

    r = args.running_lanes
    gap = args.max_gap_ms / 1e3 if args.max_gap_ms is not None else None
    engine = Engine(lanes, lanes=r + 1, max_queue=r + 1, prefill_budget=args.prefill_budget, max_gap_s=gap)
    long_prompt = random_ids(n, vocab, 7)
    alone = []
    for _ in range(2):                                       # the first also warms the chunk shapes up
        h = engine.submit(Request(long_prompt, 1, draft=k))
        alone.append(Driver(engine, memory).finals([h])[0].stats.ttft_s)
    d = Driver(engine, memory)
    room = lanes.max_context - args.prompt_tokens - 1
    running = [d.submit(Request(p, room, draft=k)) for p in prompts[:r]]
    while not all(d.arrivals[h] for h in running):
        d.step()
    start = d.steps
    for _ in range(WINDOW):
        d.step()
    submitted = d.steps
    late = d.submit(Request(long_prompt, WINDOW, draft=k))
    while not d.arrivals[late]:
        d.step()
    first = d.steps
    for _ in range(WINDOW):
        d.step()
    for h in running + [late]:
        h.cancel()
    engine.run_until_idle()
    if any(h.final.finish != "cancelled" for h in running):
        raise RuntimeError("--long-prompt: a running lane ended before the measurement did (its context is sized for a "
                           f"prefill budget ≥ {MIN_CHUNK} tokens: give --prefill-budget)")
    phases = {"before": (start, submitted), "during": (submitted, first), "after": (first, first + WINDOW)}
    gaps = {name: [] for name in phases}                      # (ms since the lane's last arrival, tokens)
    for h in running:
        for (t0, _, _), (t1, step, n_tokens) in zip(d.arrivals[h], d.arrivals[h][1:]):
            for name, (lo, hi) in phases.items():
                if lo < step <= hi:
                    gaps[name].append(((t1 - t0) * 1e3, n_tokens))
    return {"prompt_tokens": n, "running_lanes": r, "draft": k, "prefill_budget": engine.prefill_budget,
            "max_gap_ms": args.max_gap_ms,
            "ttft_ms": late.final.stats.ttft_s * 1e3, "ttft_alone_ms": alone[-1] * 1e3,
            "prefill_steps": first - submitted,
            "gap_ms": {name: _gap_figures(g) for name, g in gaps.items()}, "window_steps": WINDOW}


def _gap_figures(gaps: list[tuple[float, int]]) -> dict | None:
    """p50, p99 and max of the gaps, and the mean ms per token (a gap / the tokens that arrived after it)."""
    if not gaps:
        return None
    ms = [g for g, _ in gaps]
    return {"p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "max": max(ms), "n": len(ms),
            "ms_per_token": sum(ms) / sum(n for _, n in gaps)}

def table_lines(x: dict) -> list[str]:
    paced = f", paced to a {x['max_gap_ms']:g} ms gap" if x.get("max_gap_ms") else ""
    lines = [f"long prompt: {x['prompt_tokens']:,} tokens arriving while {x['running_lanes']} lanes decode "
             f"(K = {x['draft']}), prefill budget {x['prefill_budget']} tokens per step{paced}:",
             f"  TTFT {x['ttft_ms']:,.0f} ms (alone {x['ttft_alone_ms']:,.0f} ms), {x['prefill_steps']} steps",
             f"  {'ms between a running lane’s arrivals':<36} {'p50':>8} {'p99':>8} {'max':>8} {'gaps':>5} "
             f"{'ms/token':>9}"]
    for name, g in x["gap_ms"].items():
        label = f"{name} its prefill ({x['window_steps']} steps)" if name != "during" else "during its prefill"
        lines.append(f"  {label:<36} " + (f"{g['p50']:8.1f} {g['p99']:8.1f} {g['max']:8.1f} {g['n']:5d} "
                                            f"{g['ms_per_token']:9.1f}" if g else "-"))
    return lines
