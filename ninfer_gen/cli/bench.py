"""bench: `ninfer-gen bench` — the reference workload on the GPU backend, with every figure measured
in the same run as a device-to-device copy so speed is reported as bandwidth efficiency.

Phases: (1) copy bandwidth; (2) ~30-token prompts, `--output-tokens` (1024) greedy new tokens
(one request through the engine, as `run` and `serve` decode it): TTFT, end-to-end and decode
tok/s, and the decode step alone (CUDA-event timed graph replays; per call group, its share of the
replay by omission) with the bytes it must move (weights streamed + GDN state read/written + KV read
at the context the replays ran at: the end of the output) → bandwidth efficiency; (3) long prompts
(8K, 32K): prefill tok/s and effective TFLOP/s (2 × matrix parameters × tokens, plus causal attention
2 × 2 × L²/2 × Hq × D per layer).
Peak memory: torch's allocator peak and the device's used memory (every process and the context).
Writes JSON (`--json`) and prints a short table last. `--hf-json` adds same-day ratios against
`lab/hf_baseline.py`'s output.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from compiler.spec import ModelSpec, load_spec

from ninfer_gen.cli.bench_common import draft_vocab_arg, engine_run, random_ids, step_bytes
from ninfer_gen.executor.memory_plan import GiB, parse_bytes

MiB = 2 ** 20


def copy_bandwidth(iters: int = 20) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted), median."""
    src = torch.randn(256 * MiB, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 256 * MiB * 4 / statistics.median(times) / 1e9


def matrix_params(spec: ModelSpec) -> int:
    from compiler.spec import tensor_table
    return sum(t.numel for t in tensor_table(spec)
               if len(t.shape) == 2 and not t.name.startswith("mtp.") and t.role != "embed")


def prefill_flops(spec: ModelSpec, tokens: int) -> float:
    a, at = spec.model, spec.model.attention
    n_attn = sum(k == "full_attention" for k in a.layers.kinds)
    attn = n_attn * 2 * 2 * (tokens * tokens / 2) * at.num_heads * at.head_dim
    return 2 * matrix_params(spec) * tokens + attn


class _Peak:
    """Device memory in use (all processes + contexts), sampled at phase boundaries."""

    def __init__(self):
        self.device = 0

    def sample(self) -> None:
        free, total = torch.cuda.mem_get_info()
        self.device = max(self.device, total - free)


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def time_replays(bucket, iters: int = 50) -> list[float]:
    """Milliseconds per replay of a captured bucket (CUDA events, host queued ahead)."""
    for _ in range(5):
        bucket.run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(50_000_000)
    for s, e in events:
        s.record()
        bucket.run()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def profile_bucket(bucket, repeats: int = 3) -> dict[str, dict]:
    """Per kernel family: launches and µs per forward, from CUDA events around each eager launch
    (the median over `repeats` forwards). Eager gaps are host-bound, so the sum exceeds a replay."""
    from collections import defaultdict

    calls = bucket.plan.calls
    per = defaultdict(list)
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        events[0].record()
        for launcher, ev in zip(bucket.launchers, events[1:]):
            launcher.launch()
            ev.record()
        torch.cuda.synchronize()
        fam = defaultdict(float)
        for c, a, b in zip(calls, events, events[1:]):
            fam[c.key.family] += a.elapsed_time(b) * 1e3
        for k, v in fam.items():
            per[k].append(v)
    count = defaultdict(int)
    for c in calls:
        count[c.key.family] += 1
    return {k: {"launches": count[k], "us": statistics.median(v)} for k, v in
            sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))}


class _Omitted:
    """A launcher that launches nothing (omission_profile)."""

    def launch(self, stream=None) -> None:
        pass


def _call_label(key) -> str:
    """A call's group in omission_profile: its family, and for GEMVs its weight format and shape."""
    return f"gemv {key.fmt} {key.n}x{key.k}" if key.family == "gemv" else key.family


def omission_profile(bucket, iters: int = 30) -> dict[str, dict]:
    """Per call group (_call_label): how much shorter a graph replay of the bucket gets when the group's
    launches are left out (outputs are garbage, only the time counts). Unlike eager events this sees
    what graph branches and programmatic launch overlap: it is each group's share of the critical path."""
    from collections import Counter

    base = statistics.median(time_replays(bucket, iters))
    labels = [_call_label(c.key) for c in bucket.plan.calls]
    launchers, graph, out = bucket.launchers, bucket.graph, {}
    try:
        for label, count in Counter(labels).most_common():
            bucket.launchers = [_Omitted() if lb == label else ln for lb, ln in zip(labels, launchers)]
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph):
                bucket.run(use_graph=False)
            without = statistics.median(time_replays(bucket, iters))
            out[label] = {"launches": count, "saved_us": (base - without) * 1e3}
    finally:
        bucket.launchers, bucket.graph = launchers, graph
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["saved_us"]))


def run_bench(args) -> dict:
    import ninfer_gen
    from ninfer_gen.cli.env import build_root, compile_options
    from ninfer_gen.executor.memory_plan import plan_memory

    if not torch.cuda.is_available():
        raise RuntimeError("ninfer-gen bench needs a CUDA GPU; none is visible")
    budget = parse_bytes(args.vram_budget)
    spec = load_spec(args.spec) if args.weights is None else None
    longs = [int(x) for x in args.prefill.split(",") if x] if args.prefill else []
    rounds_ctx = args.prompt_tokens + args.output_tokens + 4 * (args.draft + 1) if args.draft else 0
    ctx = max([args.prompt_tokens + args.output_tokens, rounds_ctx, *longs]) + 64
    result: dict = {"device": torch.cuda.get_device_name(), "budget_bytes": budget, "max_context": ctx}
    peak = _Peak()
    copy_gbs = copy_bandwidth()
    result["copy_GBps"] = copy_gbs
    t0 = time.perf_counter()
    source = args.weights or args.spec
    if args.accept_prob is not None and not (args.draft > 0 and 0 <= args.accept_prob <= 1):
        raise ValueError("--accept-prob needs --draft K > 0 and a probability in [0, 1]")
    model = ninfer_gen.load(source, backend="gpu", max_context=ctx, vram_budget=budget,
                            random_weights="device" if args.weights is None else "host", progress=True,
                            compile_options=compile_options(), build_root=build_root(), draft=args.draft,
                            accept_coin=args.accept_prob is not None, draft_vocab=draft_vocab_arg(args),
                            state_mode=getattr(args, "state_mode", "replayssm"), arch_path=args.arch_path,
                            vision=not getattr(args, "no_vision", False),
                            vision_kernels=getattr(args, "vision_kernels", False))
    spec = model.spec
    be = model.backend
    torch.cuda.synchronize()
    result["load_s"] = time.perf_counter() - t0
    result["model"] = model.source
    result["memory_plan"] = plan_memory(spec, 1, ctx, budget).to_json()
    result["weights_bytes"] = be.weights.nbytes
    peak.sample()

    # warm-up: the lanes capture every bucket and round graph and run a short request of each kind
    t0 = time.perf_counter()
    lanes = model.lanes(1, accept_prob=args.accept_prob)
    if longs:                                         # the chunk bucket's first replay, outside the timings
        seq = be.new_sequence()
        be.prefill(seq, random_ids(min(be.profile.prefill_chunk, be.max_context - 1), spec.model.vocab_size, 99))
        be.release(seq)
    result["warmup_s"] = time.perf_counter() - t0

    # (2) the reference workload: short prompt, long greedy output, one request through the engine
    vocab = spec.model.vocab_size
    runs = []
    for r in range(args.repeats):
        run = engine_run(lanes, random_ids(args.prompt_tokens, vocab, r), args.output_tokens, 0)
        run["step_replay_ms"] = statistics.median(time_replays(be.exe.bucket("step", 1, 1)))
        runs.append(run)
    peak.sample()
    step_plan = be.exe.bucket("step", 1, 1).plan
    best = min(runs, key=lambda r: r["step_replay_ms"])
    moved = step_bytes(spec, step_plan, best["final_context"], be.state.kv_dtype)    # where the replays ran
    decode = {
        "runs": runs,
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in runs),
        "step_replay_ms": best["step_replay_ms"],
        "bytes_per_step": moved,
        "bandwidth_GBps": moved["total"] / (best["step_replay_ms"] * 1e-3) / 1e9,
        "launches_per_forward": len(step_plan.calls),
        "profile_eager_us": profile_bucket(be.exe.bucket("step", 1, 1)),
        "profile_omitted_us": omission_profile(be.exe.bucket("step", 1, 1)),
    }
    decode["bandwidth_efficiency"] = decode["bandwidth_GBps"] / copy_gbs
    result["decode"] = decode
    if args.draft:
        from ninfer_gen.cli.bench_spec import speculative_figures
        result["speculative"] = speculative_figures(model, args, decode, copy_gbs)
        peak.sample()

    # (3) long prompts
    result["prefill"] = []
    for n in longs:
        seq = be.new_sequence()
        try:
            start = _sync_time()
            be.prefill(seq, random_ids(n, vocab, 7))
            secs = _sync_time() - start
            result["prefill"].append({"tokens": n, "seconds": secs, "tok_s": n / secs,
                                      "effective_TFLOPs": prefill_flops(spec, n) / secs / 1e12,
                                      "chunk_profile_eager_us": profile_bucket(
                                          be.exe.bucket("prefill", 1, be.profile.prefill_chunk), 1)})
        except Exception as err:       # report and go on: one failing length must not hide the others
            result["prefill"].append({"tokens": n, "error": f"{type(err).__name__}: {err}"})
        finally:
            be.release(seq)
        peak.sample()
    result["launches"] = {f"{e}:{b}x{t}": n for (e, b, t), n in be.exe.launches.items()}
    result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    result["peak_device_used_bytes"] = peak.device
    if args.hf_json:
        result["hf"] = _hf_ratios(json.loads(Path(args.hf_json).read_text()), result)
    return result


def _hf_ratios(hf: dict, ours: dict) -> dict:
    """Same-day ratios against lab/hf_baseline.py's JSON (its `measurements`: decode at batch 1,
    prefill per length)."""
    ms = [m for m in hf.get("measurements", []) if "tok_s" in m]
    out: dict = {"transformers": hf.get("versions", {}).get("transformers") if isinstance(hf.get("versions"), dict)
                 else hf.get("transformers")}
    dec = [m for m in ms if m.get("kind") == "decode" and m.get("batch") == 1]
    if dec:
        out["decode_tok_s"] = dec[0]["tok_s"]
        out["decode_ratio"] = ours["decode"]["decode_tok_s"] / dec[0]["tok_s"]
    for p in ours["prefill"]:
        theirs = [m for m in ms if m.get("kind") == "prefill" and m.get("tokens") == p["tokens"]]
        if theirs and "tok_s" in p:
            out[f"prefill_{p['tokens']}_tok_s"] = theirs[0]["tok_s"]
            out[f"prefill_{p['tokens']}_ratio"] = p["tok_s"] / theirs[0]["tok_s"]
    return out


def table(r: dict) -> str:
    d = r["decode"]
    lines = [f"device {r['device']}; copy {r['copy_GBps']:.0f} GB/s; model {r['model']}",
             f"{'metric':<34} {'value':>14}",
             f"{'TTFT (ms)':<34} {d['ttft_ms']:>14.1f}",
             f"{'decode tok/s (end to end loop)':<34} {d['decode_tok_s']:>14.1f}",
             f"{'decode step (graph replay, ms)':<34} {d['step_replay_ms']:>14.3f}",
             f"{'bytes per step (MB)':<34} {d['bytes_per_step']['total'] / 1e6:>14.1f}",
             f"{'bandwidth efficiency':<34} {d['bandwidth_efficiency']:>14.1%}",
             f"{'launches per decode forward':<34} {d['launches_per_forward']:>14d}"]
    for p in r["prefill"]:
        if "error" in p:
            lines.append(f"{'prefill ' + str(p['tokens']):<34} {'error':>14}  {p['error'][:60]}")
        else:
            lines.append(f"{'prefill ' + str(p['tokens']) + ' tok/s (TFLOP/s)':<34} {p['tok_s']:>14.0f}"
                         f"  ({p['effective_TFLOPs']:.0f})")
    prof = d.get("profile_eager_us", {})
    if prof:
        lines.append("decode step by family (eager, µs): " + ", ".join(
            f"{k} {v['us']:.0f} ({v['launches']})" for k, v in prof.items()))
    omitted = d.get("profile_omitted_us", {})
    if omitted:
        lines.append("decode step, µs saved by leaving a group out of the graph: " + ", ".join(
            f"{k} {v['saved_us']:.0f} ({v['launches']})" for k, v in omitted.items()))
    if "speculative" in r:
        from ninfer_gen.cli.bench_spec import table_lines
        lines += table_lines(r["speculative"])
    lines.append(f"{'peak alloc / reserved / device GiB':<34} {r['peak_allocated_bytes'] / GiB:>6.2f} / "
                 f"{r['peak_reserved_bytes'] / GiB:.2f} / {r['peak_device_used_bytes'] / GiB:.2f}")
    for k, v in r.get("hf", {}).items():
        if k.endswith("ratio"):
            lines.append(f"{'vs HF ' + k.replace('_ratio', ''):<34} {v:>13.2f}×")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    result = run_bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0
