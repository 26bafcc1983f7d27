"""bench_agent: `ninfer-gen bench --workload agent` — multi-turn agent sessions over a long shared repository
context, run through engine.Engine with and without prefix reuse. Owns the workload (sessions, turns, token
ids), its per-turn figures and the report (table, JSON, PNG of TTFT per turn); the stepping, memory and
plotting are bench_common's, the numbers the engine's and its backend's.

Every session's first prompt is the same repository context (`--context-tokens`) and a short task of its
own; each later turn's prompt is the previous prompt + the answer the session got + a tool result
(`--tool-tokens`, drawn per turn), concatenated as token ids (no chat template: a trained model sees raw
source text), and asks for `--answer-tokens` greedy tokens (drawn per turn; no stop tokens, so exactly
that many). Ids: a trained model's tokenizer over this package's own Python source (the context, and tool
results as windows of it); random weights get seeded random ids. The draws are seeded and equal in every run.

Per session count S (`--sessions`): S sessions start at once, and each submits its next turn as soon as its
answer is complete (closed loop), after an untimed warm-up of two short turns per session. The run without
prefix reuse passes `prefix_cache=0` to the lanes (when they take the option), the run with reuse
`--prefix-cache` checkpoints; both start with no checkpoint cached. Sessions that start together all
prefill the context: a lane looks for a checkpoint when it is admitted, before another has prefilled it.
TTFT is the engine's submit → first token per request, split by turn 1 and the later turns (mean, p50, p99
by nearest rank); tok/s is every answer token / the wall time from the first submit to the last token;
prefilled tokens per request are its prompt minus what the engine restored (`RequestStats.cached_tokens`),
beside the engine's own `prefill_tokens` and `prefix_hit_tokens` counts over the run.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from ninfer_gen.cli.bench_common import (MEMORY_HEAD_GPU, Driver, Memory, device_name, gdn_state_per_lane, int_list,
                                         lane_tokens, line_plot, load_model, memory_text, pct, pick_backend, random_ids,
                                         write_report)

CONTEXT_DEFAULT = {"gpu": 8192, "reference": 1024}
SESSIONS_DEFAULT = {"gpu": "1,2,4,8", "reference": "1,2"}   # the CPU: about a minute on 2 cores
SEED = 22
TASKS = ("find where the prefill budget is checked", "add a test for an empty prompt",
         "explain how a lane is released", "rename the draft option", "why does this request fail?",
         "list the modules that import torch", "speed up the page allocator", "document the bench options")


def add_arguments(p) -> None:
    """The agent bench's options on the bench command's parser (the shared ones are the bench's)."""
    p.add_argument("--workload", choices=("agent",), default=None, help="agent: multi-turn agent sessions sharing "
                   "a long repository context, through the cohort engine with and without prefix reuse: per session "
                   "count, TTFT of turn 1 and of the later turns (mean / p50 / p99), tok/s, acceptance, prefill "
                   "tokens run against prompt tokens, peak memory; prints a table, writes --json and a PNG of TTFT "
                   "per turn beside it. Runs on the CPU too (--backend reference). Of the bench's other options it "
                   "takes --weights, --draft (default 3), --accept-prob, --draft-vocab, --vram-budget, --json, "
                   "--backend, --prefill-budget, --batch-steps")
    p.add_argument("--context-tokens", type=int, default=None, metavar="N", help="agent: tokens of the repository "
                   f"context every session starts with (default {CONTEXT_DEFAULT['gpu']:,} on the GPU, "
                   f"{CONTEXT_DEFAULT['reference']:,} on the reference backend)")
    p.add_argument("--turns", type=int, default=6, help="agent: turns per session (default 6); a turn's prompt is "
                   "the previous turn's prompt + its answer + a tool result")
    p.add_argument("--sessions", default=None, metavar="S,S,...", help="agent: sessions at once, one run per "
                   f"count (default {SESSIONS_DEFAULT['gpu']} on the GPU, {SESSIONS_DEFAULT['reference']} on the "
                   "reference backend)")
    p.add_argument("--tool-tokens", default="20-200", metavar="MIN-MAX", help="agent: tokens of each tool result, "
                   "drawn per turn (default 20-200)")
    p.add_argument("--answer-tokens", default="16-64", metavar="MIN-MAX", help="agent: greedy tokens of each "
                   "answer, drawn per turn (default 16-64; no stop tokens, so exactly that many)")
    p.add_argument("--prefix-cache", type=int, default=None, metavar="N", help="agent: prefix checkpoints the run "
                   "with reuse keeps (default 16, or 2 per session when that is more)")
    p.add_argument("--no-reuse-run", action="store_true", help="agent: skip the comparison run without prefix reuse")


def _range(text: str, option: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{option}: expected MIN-MAX (e.g. 20-200), got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{option}: expected 1 ≤ MIN ≤ MAX, got {text!r}")
    return bounds


@dataclass(frozen=True)
class Workload:
    """Token ids of up to `len(tasks)` sessions: the shared context, each session's task, its tool results
    (turns 2..T) and its answer lengths (turns 1..T)."""
    context: list[int]
    tasks: list[list[int]]
    tools: list[list[list[int]]]
    answers: list[list[int]]
    source: str

    def first_prompt(self, session: int) -> list[int]:
        return self.context + self.tasks[session]


def workload(model, sessions: int, turns: int, context: int, tool: tuple[int, int], answer: tuple[int, int],
             seed: int = SEED) -> Workload:
    rngs = [random.Random(seed * 1000 + i) for i in range(sessions)]     # a session's draws: its own
    answers = [[rng.randint(*answer) for _ in range(turns)] for rng in rngs]
    tool_sizes = [[rng.randint(*tool) for _ in range(turns - 1)] for rng in rngs]
    if model.tokenizer.name != "bytes":
        corpus = _source_ids(model.tokenizer, context + tool[1])
        tasks = [model.tokenizer.encode(f"\n\n# Task {i + 1}: {TASKS[i % len(TASKS)]}\n") for i in range(sessions)]
        tools = [[_window(corpus, n, rng) for n in sizes] for sizes, rng in zip(tool_sizes, rngs)]
        return Workload(corpus[:context], tasks, tools, answers, "this package's Python source, tokenised")
    vocab = model.spec.model.vocab_size
    tasks = [random_ids(16, vocab, seed * 1000 + i) for i in range(sessions)]
    tools = [[random_ids(n, vocab, seed * 100_000 + 100 * i + t) for t, n in enumerate(sizes)]
             for i, sizes in enumerate(tool_sizes)]
    return Workload(random_ids(context, vocab, seed), tasks, tools, answers, "seeded random ids")


def _source_ids(tokenizer, n: int) -> list[int]:
    """At least `n` ids of this package's Python files in path order (repeated if it is shorter)."""
    files = sorted(Path(__file__).resolve().parents[1].rglob("*.py"))
    ids: list[int] = []
    while len(ids) < n:
        for f in files:
            ids += tokenizer.encode(f"# file: {f.name}\n{f.read_text()}\n")
            if len(ids) >= n:
                break
    return ids


def _window(corpus: list[int], n: int, rng: random.Random) -> list[int]:
    start = rng.randrange(len(corpus) - n + 1)
    return corpus[start:start + n]


def _drop_checkpoints(adapter) -> None:
    """Evicts every prefix checkpoint the adapter keeps (lanes.reuse), so that a run starts cold."""
    if adapter.reuse is not None:
        adapter.reuse.cache.clear()


def _warm_up(engine, memory: Memory, s: int, k: int, vocab: int, context: int) -> None:
    """Two short turns per session on other ids: a full prefill chunk (or the context), a partial one, rounds."""
    from ninfer_gen.engine import Request

    d = Driver(engine, memory)
    n = min(engine.prefill_budget, context) + 8
    handles = [d.submit(Request(random_ids(n, vocab, 10_000 + i), 2 * k + 4, draft=k)) for i in range(s)]
    d.finals(handles)
    d.finals([d.submit(Request(random_ids(n, vocab, 10_000 + i) + h.tokens + random_ids(8, vocab, 20_000 + i), 2 * k + 4,
                               draft=k)) for i, h in enumerate(handles)])


def agent_run(adapter, work: Workload, s: int, turns: int, k: int, args, memory: Memory, reuse: bool,
              vocab: int) -> dict:
    """S sessions of `turns` turns each, every next turn submitted when its answer is complete: one row."""
    from ninfer_gen.engine import Engine, Request

    engine = Engine(adapter, lanes=s, max_queue=s, prefill_budget=args.prefill_budget)
    _warm_up(engine, memory, s, k, vocab, len(work.context))
    _drop_checkpoints(adapter)
    memory.reset()
    before = engine.stats()
    d = Driver(engine, memory)
    prompts = [work.first_prompt(i) for i in range(s)]
    t0 = time.perf_counter()
    live = {d.submit(Request(prompts[i], work.answers[i][0], draft=k)): (i, 0) for i in range(s)}
    done = []                                                  # (turn, RequestStats)
    while live:
        if not d.step():
            raise RuntimeError("the engine went idle with turns unfinished")
        for h in [h for h in live if h.final is not None]:
            i, t = live.pop(h)
            done.append((t, d.finals([h])[0].stats))
            if t + 1 < turns:
                prompts[i] = prompts[i] + h.tokens + work.tools[i][t]
                live[d.submit(Request(prompts[i], work.answers[i][t + 1], draft=k))] = (i, t + 1)
    end = max(stamps[-1][0] for stamps in d.arrivals.values())
    after = engine.stats()
    stats = [st for _, st in done]
    tokens, drafted, rounds = (sum(getattr(st, f) for st in stats) for f in ("tokens", "drafted", "rounds"))
    groups = {"turn1": [st for t, st in done if t == 0], "later": [st for t, st in done if t > 0]}
    return {"sessions": s, "reuse": reuse, "requests": len(done), "output_tokens": tokens, "wall_s": end - t0,
            "tok_s": tokens / (end - t0),
            "acceptance": sum(st.accepted for st in stats) / drafted if drafted else None,
            "tokens_per_round": sum(st.tokens - 1 for st in stats) / rounds if rounds else None,
            "ttft_ms": {name: _ttft(g) for name, g in groups.items()},
            "ttft_ms_per_turn": [statistics.fmean(st.ttft_s * 1e3 for t, st in done if t == n) for n in range(turns)],
            "prompt_tokens": {name: sum(st.prompt_tokens for st in g) for name, g in groups.items()},
            "prefilled_tokens": {name: sum(st.prompt_tokens - getattr(st, "cached_tokens", 0) for st in g)
                                 for name, g in groups.items()},
            "engine": {key: after[key] - before[key] if key in after else None
                       for key in ("prefill_tokens", "prefix_hit_tokens")},
            "memory": memory.figures()}


def _ttft(stats: list) -> dict | None:
    if not stats:
        return None
    ms = [st.ttft_s * 1e3 for st in stats]
    return {"mean": statistics.fmean(ms), "p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "n": len(ms)}


def _check(args, k: int, turns: int) -> None:
    if k < 0:
        raise ValueError(f"--draft must be ≥ 0, got {k}")
    if args.accept_prob is not None and not (k > 0 and 0 <= args.accept_prob <= 1):
        raise ValueError("--accept-prob needs --draft K > 0 and a probability in [0, 1]")
    for name in ("context_tokens", "prefix_cache", "prefill_budget"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if turns < 1:
        raise ValueError(f"--turns must be ≥ 1, got {turns}")


def run(args) -> dict:
    backend = pick_backend(args)
    k = 3 if args.draft is None else args.draft
    sweep = int_list(args.sessions or SESSIONS_DEFAULT[backend], "--sessions")
    tool, answer = _range(args.tool_tokens, "--tool-tokens"), _range(args.answer_tokens, "--answer-tokens")
    _check(args, k, args.turns)
    n, lanes = args.context_tokens or CONTEXT_DEFAULT[backend], max(sweep)
    context = n + 32 + (args.turns - 1) * tool[1] + args.turns * answer[1] + 4 * k + 48
    checkpoints = args.prefix_cache or max(16, 2 * lanes)
    t0 = time.perf_counter()
    model = load_model(args, backend, k, lanes, context, lanes * lane_tokens(context), checkpoints)
    vocab = model.spec.model.vocab_size
    work = workload(model, lanes, args.turns, n, tool, answer)

    options = {"batch_steps": True} if args.batch_steps and backend == "reference" else {}
    modes = ([] if args.no_reuse_run else [False]) + [True]
    result = {"workload": "agent", "model": model.source, "backend": backend, "device": device_name(backend),
              "draft": k, "accept_prob": args.accept_prob, "batch_steps": bool(options), "context_tokens": n,
              "context_source": work.source, "turns": args.turns, "tool_tokens": list(tool),
              "answer_tokens": list(answer), "prefix_cache": checkpoints, "load_s": time.perf_counter() - t0, "runs": {},
              "gdn_state_bytes_per_lane": gdn_state_per_lane(model, k) if backend == "gpu" else None}
    memory = Memory(backend == "gpu")
    for reuse in modes:
        cache = {"prefix_cache": checkpoints if reuse else 0}
        adapter = model.lanes(lanes, accept_prob=args.accept_prob, **options, **cache)
        result.update(prefill_budget=args.prefill_budget or adapter.prefill_chunk, max_context=adapter.max_context)
        result["runs"]["reuse" if reuse else "no_reuse"] = [
            agent_run(adapter, work, s, args.turns, k, args, memory, reuse, vocab) for s in sweep]
        _drop_checkpoints(adapter)
    return result


def table(r: dict) -> str:
    gpu = r["backend"] == "gpu"
    coin = f", --accept-prob {r['accept_prob']} (a coin per draft, bench only)" if r["accept_prob"] is not None else ""
    cache = f"prefix cache {r['prefix_cache']} checkpoints"
    lines = [f"agent bench: {r['model']}; {r['backend']} backend on {r['device']}",
             f"  {r['context_tokens']:,}-token shared context ({r['context_source']}), {r['turns']} turns per session, "
             f"tool results {r['tool_tokens'][0]}-{r['tool_tokens'][1]} tokens, answers {r['answer_tokens'][0]}-"
             f"{r['answer_tokens'][1]} greedy tokens, K = {r['draft']}{coin}; prefill budget {r['prefill_budget']} "
             f"tokens per step; {cache}",
             f"{'S':>2} {'reuse':>5} {'TTFT turn 1 ms':>22} {'TTFT turns 2+ ms':>22} {'prefilled / prompt tok':>23} "
             f"{'turns 2+':>8} {'tok/s':>7} {'accept':>7} {MEMORY_HEAD_GPU if gpu else 'peak RSS MiB':>34}",
             f"{'':8} {'mean / p50 / p99':>22} {'mean / p50 / p99':>22} {'(engine, all turns)':>23} {'prefilled':>8}"]
    rows = sorted((x for rs in r["runs"].values() for x in rs), key=lambda x: (x["sessions"], x["reuse"]))
    for x in rows:
        ttft = [f"{t['mean']:,.0f} / {t['p50']:,.0f} / {t['p99']:,.0f}" if t else "-" for t in x["ttft_ms"].values()]
        later = x["prefilled_tokens"]["later"] / x["prompt_tokens"]["later"] if x["prompt_tokens"]["later"] else None
        prefill = f"{x['engine']['prefill_tokens']:,} / {sum(x['prompt_tokens'].values()):,}"
        accept = f"{x['acceptance']:7.1%}" if x["acceptance"] is not None else f"{'-':>7}"
        lines.append(f"{x['sessions']:>2} {'yes' if x['reuse'] else 'no':>5} {ttft[0]:>22} {ttft[1]:>22} "
                     f"{prefill:>23} {f'{later:.0%}' if later is not None else '-':>8} {x['tok_s']:7.1f} {accept} "
                     f"{memory_text(x['memory']):>34}")
    if r.get("gdn_state_bytes_per_lane"):
        st = r["gdn_state_bytes_per_lane"]
        lines.append(f"GDN state per lane, K = {r['draft']} (sized by K, whatever the acceptance): ReplaySSM "
                     f"{st['total'] / 2**20:,.1f} MiB (state {st['committed'] / 2**20:,.1f} + records "
                     f"{st['verify_buffers'] / 2**20:,.1f}); the snapshot design {st['snapshot_total'] / 2**20:,.1f} MiB "
                     f"(state + K + 1 snapshots); a prefix checkpoint holds {st['committed'] / 2**20:,.1f} MiB in either")
    if len(r["runs"]) == 2:
        pairs = [(a, b) for a, b in zip(r["runs"]["reuse"], r["runs"]["no_reuse"]) if a["ttft_ms"]["later"]]
        lines.append("TTFT of turns 2+ with reuse / without (mean): " + ", ".join(
            f"S={a['sessions']} {a['ttft_ms']['later']['mean'] / b['ttft_ms']['later']['mean']:.2f}×"
            for a, b in pairs) if pairs else "one turn per session: no later turns to compare")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    """Mean TTFT per turn, one colour per session count, with reuse solid and without dashed."""
    lines = [(f"S={x['sessions']}, {'reuse' if x['reuse'] else 'no reuse'}", list(range(1, r["turns"] + 1)),
              x["ttft_ms_per_turn"], "o-" if x["reuse"] else "s--", x["sessions"])
             for rows in r["runs"].values() for x in rows]
    line_plot(path, lines, xlabel="turn", ylabel="mean TTFT, ms (log)", xticks=list(range(1, r["turns"] + 1)),
              log_y=True, title=f"{Path(str(r['model']).split(' ')[0]).name} on {r['device']}\nagent sessions: "
              f"{r['context_tokens']:,}-token shared context, K = {r['draft']}")


def cmd_bench_agent(args) -> int:
    result = run(args)
    write_report(result, args.json, plot)
    print(table(result))
    return 0
