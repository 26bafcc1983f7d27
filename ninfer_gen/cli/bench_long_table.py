"""bench_long_table: the short table `ninfer-gen bench --long-context` prints last, from its result (bench_long's
JSON): plain decode and MTP rounds per context, TTFT per prompt, peak memory against the plan. Formats only."""
from __future__ import annotations

from ninfer_gen.cli.bench_common import GiB, memory_text


def _ratio(r: dict, name: str) -> str:
    v = r.get("vs_base", {}).get(name)
    return f"{v:.2f}×" if v is not None else "—"


def _pct(v) -> str:
    return f"{100 * v:.1f}%" if v is not None else "—"


HEAD = "{:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8} {:>11}"


def _plain_lines(rows: list[dict]) -> list[str]:
    """Plain decode per context: tok/s, ms per step (engine), its graph replay (GPU), MB, read % (of the replay
    on the GPU), speed and bytes-allowed ratios to the smallest context."""
    lines = ["  " + HEAD.format("context", "tok/s", "ms/step", "replay ms", "MB/step", "read %", "vs base",
                                "bytes allow")]
    for x in rows:
        if "error" in x:
            lines.append(f"  {x['context']:>8,} error: {x['error'][:100]}")
            continue
        speed = "step_replay_ms" if "step_replay_ms" in x else "decode_tok_s"
        lines.append("  " + HEAD.format(
            f"{x['context']:,}", f"{x['decode_tok_s']:.1f}", f"{x['ms_per_step']:.3f}",
            f"{x['step_replay_ms']:.3f}" if "step_replay_ms" in x else "—", f"{x['bytes_per_step']['total'] / 1e6:,.1f}",
            _pct(x.get("replay_read_fraction", x.get("read_fraction"))), _ratio(x, speed), _ratio(x, "bytes_allow")))
    return lines


def _round_lines(rows: list[dict]) -> list[str]:
    """MTP rounds per context: tok/s, ms per round, tokens per round, MB, read %, the round's speed (1 / ms: a
    coin's acceptance moves tok/s from run to run, not the round) and its bytes against the smallest context."""
    lines = ["  " + HEAD.format("context", "tok/s", "ms/round", "tok/round", "MB/round", "read %", "vs base",
                                "bytes allow")]
    for x in rows:
        if "error" in x:
            lines.append(f"  {x['context']:>8,} error: {x['error'][:100]}")
            continue
        lines.append("  " + HEAD.format(
            f"{x['context']:,}", f"{x['decode_tok_s']:.1f}", f"{x['round_ms']:.3f}", f"{x['tokens_per_round']:.2f}",
            f"{x['bytes_per_round']['total'] / 1e6:,.1f}", _pct(x["read_fraction"]), _ratio(x, "round_ms"),
            _ratio(x, "bytes_allow")))
    return lines


def _prompt_lines(rows: list[dict]) -> list[str]:
    """Per prompt length: TTFT, prefill tok/s, effective TFLOP/s and tok/s against the shortest prompt."""
    lines = [f"  {'prompt':>8} {'TTFT ms':>10} {'tok/s':>9} {'TFLOP/s':>8} {'vs base':>8}"]
    for x in rows:
        if "error" in x:
            lines.append(f"  {x['tokens']:>8,} error: {x['error'][:100]}")
            continue
        lines.append(f"  {x['tokens']:>8,} {x['ttft_ms']:>10,.1f} {x['prefill_tok_s']:>9,.0f} "
                     f"{x['effective_TFLOPs']:>8.1f} {_ratio(x, 'prefill_tok_s'):>8}")
    return lines


def table(r: dict) -> str:
    gpu = r["backend"] == "gpu"
    ceil = f"; read stream {r['read_GBps']:,.0f} GB/s, copy {r['copy_GBps']:,.0f} GB/s" if gpu else ""
    lines = [f"long context, one lane: {r['model']} on {r['device']}{ceil}",
             f"plain decode ({r['decode_tokens']} tokens from each context):", *_plain_lines(r["plain"])]
    if r["rounds"]:
        coin = f", --accept-prob {r['accept_prob']} (a coin per draft, bench only)" \
            if r["accept_prob"] is not None else ""
        lines += [f"MTP rounds, K = {r['draft']}{coin}:", *_round_lines(r["rounds"])]
    lines += ["time to first token (plain):", *_prompt_lines(r["prompts"])]
    peak = r["peak_memory"]
    mem = f"peak memory of the runs ({'GiB allocated / reserved / device' if gpu else 'MiB resident'}): " + \
        (memory_text(peak) if peak else "—")
    if r["memory_plan"]:
        mem += f"; planned {r['memory_plan']['peak'] / GiB:.2f} GiB of a {r['budget_bytes'] / GiB:.2f} GiB budget"
    return "\n".join(lines + [mem])
