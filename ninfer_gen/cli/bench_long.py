"""bench_long: `ninfer-gen bench [SPEC] --long-context` — one lane at long context (issue 31), through the engine
as `run` and `serve` decode. Owns the workload, its figures and the report; the numbers come from the engine
and its backend, torch is imported only when the bench runs.

Per context C of `--contexts` (default 1,024 / 32,768 / 131,072): a prompt of C seeded random ids is prefilled
(its TTFT kept), then `--decode-tokens` greedy tokens are decoded, with plain steps and then with MTP rounds of
K = `--draft` drafts (default 3; `--accept-prob P` keeps each draft by a coin, bench only). Per `--prompts` length
(default 8K / 32K / 128K): TTFT and prefill tok/s (taken from the plain run of a context of the same length).
Beside each figure: the bytes a step (a round: the verify, plus K MTP steps' weights and MTP-layer KV) must move
at the decode's mean context (executor plans; on the reference backend the spec's formats), the fraction of a
read-only stream and of a copy measured in the same run (GPU; cli.read_stream, cli.bench), the step's graph
replay at the decode's last context (GPU), peak memory (bench_common.Memory) and the memory plan, and each
figure's ratio to the smallest context (prompt) with the ratio the bytes allow. Writes JSON (`--json`) and prints
a short table last. On the CPU `--backend reference` runs it at tiny contexts (the CI test).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ninfer_gen.cli.bench_common import (Memory, device_name, engine_run, int_list, lane_tokens, load_model,
                                         pick_backend, plan_weight_bytes, random_ids, step_bytes, write_report)

DEFAULTS = {"contexts": "1024,32768,131072", "prompts": "8192,32768,131072"}


def add_arguments(p) -> None:
    """The long-context bench's options on the bench command's parser (the shared ones are the bench's)."""
    p.add_argument("--long-context", action="store_true", help="long-context bench: one lane's plain decode and "
                   "MTP rounds (--draft K, default 3; --accept-prob) at each of --contexts, TTFT of each of --prompts, "
                   "bytes per step and the fraction of a same-run read-only stream, peak memory, ratios to the "
                   "smallest context; a table and --json. Runs on the CPU too (--backend reference, tiny contexts)")
    p.add_argument("--contexts", default=DEFAULTS["contexts"], metavar="N,N,...", help="long-context bench: "
                   f"contexts to decode at (default {DEFAULTS['contexts']})")
    p.add_argument("--prompts", default=DEFAULTS["prompts"], metavar="N,N,...", help="long-context bench: prompt "
                   f"lengths to time the first token of (default {DEFAULTS['prompts']})")
    p.add_argument("--decode-tokens", type=int, default=256, metavar="N", help="long-context bench: greedy tokens "
                   "decoded at each context (default 256)")


def _check(args, k: int, contexts: list[int], prompts: list[int], positions: int) -> None:
    if k < 0:
        raise ValueError(f"--draft must be ≥ 0, got {k}")
    if args.accept_prob is not None and not (k > 0 and 0 <= args.accept_prob <= 1):
        raise ValueError("--accept-prob needs --draft K > 0 and a probability in [0, 1]")
    if args.decode_tokens < 1:
        raise ValueError(f"--decode-tokens must be ≥ 1, got {args.decode_tokens}")
    if getattr(args, "tp", 1) > 1:
        raise ValueError("--long-context runs one lane on one device: it has no --tp")
    top = max(max(contexts) + args.decode_tokens + 2 * (k + 1), max(prompts) + 1)
    if top > positions:
        raise ValueError(f"--contexts/--prompts up to {top - 1} positions (with the decode) exceed the model's "
                         f"{positions} (max_position_embeddings)")


@dataclass
class _Bench:
    """What every measurement of one run shares."""
    model: object
    lanes: object
    args: object
    gpu: bool
    k: int
    kv_dtype: str
    ceilings: dict
    plans: dict = field(default_factory=dict)

    @property
    def spec(self):
        return self.model.spec


def _plans(model, k: int, gpu: bool) -> dict:
    """The plans of the step, the verify and one MTP step: the executable's on the GPU, else planned for the
    spec's target (the bytes a GPU would move)."""
    be, spec = model.backend, model.spec
    if gpu:
        plans = {"step": be.exe.bucket("step", 1, 1).plan}
        if k:
            plans |= {"verify": be.exe.plan(("verify", 1, k + 1)), "mtp": be.exe.plan(("mtp", 1, 1))}
        return plans
    from compiler.buckets import plan_bucket, profile_of
    from compiler.targets import resolve

    target, profile = resolve(spec.runtime.target), profile_of(spec, cohorts=(1,), draft=k)
    shapes = {"step": ("step", 1, 1)} | ({"verify": ("verify", 1, k + 1), "mtp": ("mtp", 1, 1)} if k else {})
    return {name: plan_bucket(spec, target, *shape, profile) for name, shape in shapes.items()}


def _kv_token_bytes(spec, kv_dtype: str) -> float:
    """KV bytes of one token in one attention layer (K and V; INT8 codes + an fp16 scale per 64)."""
    at = spec.model.attention
    return 2 * at.num_kv_heads * at.head_dim * ((1 + 2 / 64) if kv_dtype == "int8" else 2)


def round_bytes(spec, plans: dict, context: int, k: int, kv_dtype: str) -> dict[str, int]:
    """A round's bytes at `context`: the verify's (weights, GDN state, KV), then K MTP forwards (the align pass
    and K − 1 chained drafts), each reading the MTP's weights and its own layer's KV."""
    moved = step_bytes(spec, plans["verify"], context, kv_dtype)
    moved["mtp_weights"] = k * plan_weight_bytes(plans["mtp"])
    moved["mtp_kv"] = int(k * context * _kv_token_bytes(spec, kv_dtype))
    moved["total"] += moved["mtp_weights"] + moved["mtp_kv"]
    return moved


def _ceilings(gpu: bool) -> dict:
    if not gpu:
        return {"read_GBps": None, "copy_GBps": None}
    from ninfer_gen.cli.bench import copy_bandwidth
    from ninfer_gen.cli.read_stream import read_bandwidth

    return {"read_GBps": read_bandwidth(), "copy_GBps": copy_bandwidth()}


def _efficiency(row: dict, moved: int, ms: float, ceilings: dict, prefix: str = "") -> None:
    gbs = moved / (ms * 1e-3) / 1e9 if ms else 0.0
    row[prefix + "bandwidth_GBps"] = gbs
    for name in ("read", "copy"):
        ceiling = ceilings[f"{name}_GBps"]
        row[f"{prefix}{name}_fraction"] = gbs / ceiling if ceiling else None


def decode_at(b: _Bench, context: int, draft: int) -> dict:
    """One request: a `context`-token prompt, then --decode-tokens greedy tokens with `draft` K."""
    memory = Memory(b.gpu)
    memory.reset()
    row = {"context": context, "draft": draft}
    row |= engine_run(b.lanes, random_ids(context, b.spec.model.vocab_size, context + draft), b.args.decode_tokens,
                      draft)
    row["memory"] = memory.figures()
    mean = context + row["tokens"] // 2                           # the decode ran from C to C + tokens
    if draft:
        row["bytes_per_round"] = round_bytes(b.spec, b.plans, mean, draft, b.kv_dtype)
        _efficiency(row, row["bytes_per_round"]["total"], row["round_ms"], b.ceilings)
        return row
    row["ms_per_step"] = row["round_ms"]
    row["bytes_per_step"] = step_bytes(b.spec, b.plans["step"], mean, b.kv_dtype)
    _efficiency(row, row["bytes_per_step"]["total"], row["ms_per_step"], b.ceilings)
    if b.gpu:                               # the step bucket's inputs are left at the last step: final context
        from ninfer_gen.cli.bench import time_replays

        row["step_replay_ms"] = statistics.median(time_replays(b.model.backend.exe.bucket("step", 1, 1)))
        moved = step_bytes(b.spec, b.plans["step"], row["final_context"], b.kv_dtype)["total"]
        _efficiency(row, moved, row["step_replay_ms"], b.ceilings, "replay_")
    return row


def _guarded(fn, *a) -> dict:
    """One measurement; a failure is reported in its row (one failing length must not hide the others)."""
    try:
        return fn(*a)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _ratios(rows: list[dict], key: str, figures: dict[str, bool]) -> None:
    """Each row's figures against the first good row's (`figures`: name → higher is better); for a step or a
    round also the ratio its bytes allow."""
    good = [r for r in rows if "error" not in r]
    for r in good:
        base = good[0]
        r["vs_base"] = {"base": base[key]} | {
            name: (r[name] / base[name] if higher else base[name] / r[name]) if r.get(name) and base.get(name) else None
            for name, higher in figures.items()}
        bytes_key = next((name for name in ("bytes_per_step", "bytes_per_round") if name in r), None)
        if bytes_key:
            r["vs_base"]["bytes_allow"] = base[bytes_key]["total"] / r[bytes_key]["total"]


def prompt_at(b: _Bench, n: int, plain: list[dict]) -> dict:
    """TTFT of an n-token prompt: the plain decode run's at a context of n, else a one-token request's."""
    from ninfer_gen.cli.bench import prefill_flops

    same = next((r for r in plain if r.get("context") == n and "error" not in r), None)
    if same is not None:
        row = {"tokens": n, "ttft_ms": same["ttft_ms"], "source": "the plain decode run at this context",
               "memory": same["memory"]}
    else:
        memory = Memory(b.gpu)
        memory.reset()
        run = engine_run(b.lanes, random_ids(n, b.spec.model.vocab_size, 7 * n), 1, 0)
        row = {"tokens": n, "ttft_ms": run["ttft_ms"], "source": "a one-token request", "memory": memory.figures()}
    secs = row["ttft_ms"] * 1e-3
    return row | {"prefill_tok_s": n / secs, "effective_TFLOPs": prefill_flops(b.spec, n) / secs / 1e12}


def _warm_up(b: _Bench, context: int) -> None:
    """Untimed: a prompt of one prefill chunk and 17 tokens (the chunk bucket's and a short bucket's first
    replays, the MTP's too) and 3 decode tokens, plain and with drafts."""
    chunk = b.model.backend.profile.prefill_chunk if b.gpu else b.spec.runtime.prefill_chunk
    n = max(1, min(chunk + 17, context - 2 * (b.k + 1) - 3))
    for draft in sorted({0, b.k}):
        engine_run(b.lanes, random_ids(n, b.spec.model.vocab_size, 5), 3, draft)


def run_long(args) -> dict:
    backend = pick_backend(args)
    gpu = backend == "gpu"
    k = 3 if args.draft is None else args.draft
    contexts, prompts = sorted(int_list(args.contexts, "--contexts")), sorted(int_list(args.prompts, "--prompts"))
    _check(args, k, contexts, prompts, _positions(args))
    context = lane_tokens(max(max(contexts) + args.decode_tokens + 2 * (k + 1), max(prompts) + 1))
    ceilings = _ceilings(gpu)                          # before the model: its memory is still free
    t0 = time.perf_counter()
    model = load_model(args, backend, k, 1, context, context)
    _check(args, k, contexts, prompts, model.spec.model.max_position_embeddings)      # a checkpoint's own
    lanes = model.lanes(1, accept_prob=args.accept_prob, prefix_cache=0)    # GPU: captured and warmed up
    b = _Bench(model, lanes, args, gpu, k, model.backend.state.kv_dtype if gpu else model.spec.runtime.kv_dtype,
               ceilings)
    b.plans = _plans(model, k, gpu)
    _warm_up(b, context)
    result = {"bench": "long-context", "backend": backend, "device": device_name(backend), "model": model.source,
              "draft": k, "accept_prob": args.accept_prob, "decode_tokens": args.decode_tokens,
              "max_context": context, "load_s": time.perf_counter() - t0, **ceilings, "memory_plan": None}
    if gpu:
        from ninfer_gen.executor.memory_plan import parse_bytes

        result |= {"budget_bytes": parse_bytes(args.vram_budget), "memory_plan": model.backend.memory.to_json(),
                   "memory_after_load": Memory(True).figures()}
    result["plain"] = [{"context": c, "draft": 0} | _guarded(decode_at, b, c, 0) for c in contexts]
    _ratios(result["plain"], "context", {"decode_tok_s": True, "step_replay_ms": False})
    result["rounds"] = [{"context": c, "draft": k} | _guarded(decode_at, b, c, k) for c in contexts] if k else []
    _ratios(result["rounds"], "context", {"decode_tok_s": True, "round_ms": False})
    result["prompts"] = [{"tokens": n} | _guarded(prompt_at, b, n, result["plain"]) for n in prompts]
    _ratios(result["prompts"], "tokens", {"prefill_tok_s": True, "ttft_ms": False})
    result["peak_memory"] = _peak([r["memory"] for part in ("plain", "rounds", "prompts") for r in result[part]
                                   if "memory" in r])
    return result


def _positions(args) -> int:
    """The spec's max_position_embeddings before anything loads (a checkpoint's is checked after its load)."""
    if args.weights is not None or not str(args.spec).endswith((".yaml", ".yml")):
        return 1 << 62
    from compiler.spec import load_spec
    return load_spec(args.spec).model.max_position_embeddings


def _peak(figures: list[dict]) -> dict:
    """The largest of each figure over the runs' memory figures."""
    out: dict = {}
    for f in figures:
        for name, value in f.items():
            if isinstance(value, (int, float)):
                out[name] = max(out.get(name, 0), value)
            else:
                out.setdefault(name, value)
    return out


def cmd_bench_long(args) -> int:
    from ninfer_gen.cli.bench_long_table import table

    result = run_long(args)
    write_report(result, args.json, None)
    print(table(result))
    return 0
