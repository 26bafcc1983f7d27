"""bench_spec: `ninfer-gen bench --draft K` — C1 speculative rounds on the GPU backend, measured in the
same run as plain decode (engine.speculative's round, driven here so the acceptance can be replaced).

With random weights the drafts are random and nearly all rejected, so `--accept-prob P` (this bench
only, labelled in its output) replaces the acceptance decision by an independent coin per draft
position: drafts are kept until the first failed coin, then the target's own token follows, so a round
commits 1 + (kept drafts) tokens, E = (1 − P^(K+1)) / (1 − P) on average. Everything else runs as in
serving: verify in record mode, the ReplaySSM commit, the MTP align pass and chained drafts.

Figures: ms per round — one-graph rounds in fused mode (the fold first in the next round's graph), the
same in eager mode (the fold its own graph after the host read the round) and host-driven rounds (each
step waits for the host's decision), one request each, same run —
tokens per round, acceptance, decode tok/s, bytes per round (the verify's weights, state and KV, plus
the MTP head's weights once per draft) and bandwidth efficiency, and the ratios to plain decode.
"""
from __future__ import annotations

import statistics
import time

import torch

from compiler.kernels import MATMUL_FAMILIES
from compiler.kernels.weight_layout import device_bytes
from ninfer_gen.engine.sampling import SamplingParams
from ninfer_gen.engine.speculative import Drafter, Stats, accept_greedy


def _plan_weight_bytes(plan) -> int:
    return sum(device_bytes(c.key.fmt, c.key.n, c.key.k) for c in plan.calls if c.key.family in MATMUL_FAMILIES)


def _accept(drafts: list[int], logits: torch.Tensor, prob: float | None, gen: torch.Generator) -> list[int]:
    if prob is None:
        return accept_greedy(drafts, logits)
    kept = 0
    while kept < len(drafts) and torch.rand((), generator=gen).item() < prob:
        kept += 1
    return drafts[:kept] + [int(logits[kept].argmax())]


REPLAYS = 32         # rounds replayed back to back for the device time per round


def run_device_rounds(be, prompt: list[int], k: int, rounds: int, accept_prob: float | None, seed: int = 0) -> dict:
    """One request on the backend's one-graph rounds (its round mode): `rounds` timed rounds after four
    warm-up rounds, timed from one round's token read-back to the next."""
    stats = Stats()
    stamps, emitted = [], []
    stream = be.device_rounds.stream(prompt, 1 << 30, SamplingParams(seed=seed), None, stats, accept_prob, seed)
    for _ in stream:
        if stats.rounds > len(stamps):
            stamps.append(time.perf_counter())
            emitted.append(stats.emitted[-1])
            if len(stamps) == rounds + 5:
                break
    final = be.device_rounds.host[0].item()          # the committed length (ROUND_FIELDS[0])
    replay_ms = be.device_rounds.time_replays(REPLAYS)
    stream.close()
    per_round = [b - a for a, b in zip(stamps[4:], stamps[5:])]
    kept = sum(emitted[5:]) - rounds
    return {"round_ms": statistics.median(per_round) * 1e3, "round_replay_ms": replay_ms, "rounds": rounds,
            "tokens_per_round": sum(emitted[5:]) / rounds, "acceptance": kept / (k * rounds),
            "decode_tok_s": sum(emitted[5:]) / sum(per_round), "final_context": final}


def run_rounds(be, prompt: list[int], k: int, rounds: int, accept_prob: float | None, seed: int = 0) -> dict:
    """Host-driven rounds (engine.speculative's steps, each waiting for the host's decision): prefill
    `prompt`, then `rounds` timed rounds after four warm-up rounds; one sequence."""
    gen = torch.Generator().manual_seed(seed)
    drafter = Drafter(be, SamplingParams(), k, gen)
    seq = be.new_sequence()
    try:
        logits, hidden = be.prefill(seq, prompt, all_hidden=True)
        anchor = int(torch.argmax(logits[-1]))
        drafts, _ = drafter.propose(seq, hidden, prompt[1:] + [anchor], 0)
        per_round, kept, emitted = [], 0, 0
        for r in range(rounds + 4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start = seq.length
            logits, v_hidden = be.verify(seq, [anchor] + drafts)
            out = _accept(drafts, logits, accept_prob, gen)
            be.commit(seq, len(out))
            anchor = out[-1]
            drafts, _ = drafter.propose(seq, v_hidden[:len(out)], out, start)
            torch.cuda.synchronize()
            if r >= 4:
                per_round.append(time.perf_counter() - t0)
                kept += len(out) - 1
                emitted += len(out)
        context = seq.length
    finally:
        be.release(seq)
    return {"round_ms": statistics.median(per_round) * 1e3, "rounds": rounds, "tokens_per_round": emitted / rounds,
            "acceptance": kept / (k * rounds), "decode_tok_s": emitted / sum(per_round), "final_context": context}


def speculative_figures(be, spec, args, plain: dict, copy_gbs: float) -> dict:
    """The C1 round figures beside `plain` (the decode phase's figures of the same run)."""
    from ninfer_gen.cli.bench import _ids, step_bytes

    k = args.draft
    prompt = _ids(args.prompt_tokens, spec.model.vocab_size, 11)
    modes = {}
    snapshots = be.profile.snapshots
    for mode in ("snapshot",) if snapshots else ("fused", "eager", "host"):   # the same request in each mode
        be.set_round_mode(mode)
        run = run_rounds if mode == "host" else run_device_rounds
        modes[mode] = run(be, prompt, k, args.rounds, args.accept_prob)
    be.set_round_mode("snapshot" if snapshots else "fused")
    out = dict(modes["snapshot" if snapshots else "fused"])
    out["modes"] = modes
    rnd = be.device_rounds._round("coin" if args.accept_prob is not None else "greedy")
    out["launches_per_round"] = rnd.launches
    verify = be.exe.plan(("verify", 1, k + 1))
    mtp_weights = _plan_weight_bytes(be.exe.plan(("mtp", 1, 1)))
    moved = step_bytes(spec, verify, out["final_context"], be.state.kv_dtype)
    moved["mtp"] = k * mtp_weights
    moved["total"] += moved["mtp"]
    g = spec.model.linear_attention
    n_gdn = sum(kind == "linear_attention" for kind in spec.model.layers.kinds)
    state = n_gdn * g.num_value_heads * g.key_head_dim * g.value_head_dim * 4
    lanes = max(be.profile.cohorts)                      # the records hold one row per lane of a round
    records = sum(t.numel() * t.element_size() for layer in be.state.records.values() for t in layer.values()) // lanes
    out |= {"draft": k, "accept_prob": args.accept_prob, "bytes_per_round": moved,
            "state_mode": "snapshot" if snapshots else "replayssm", "draft_vocab": be.profile.draft_vocab,
            "bandwidth_GBps": moved["total"] / (out["round_ms"] * 1e-3) / 1e9,
            "round_vs_plain_step": out["round_ms"] / plain["step_replay_ms"],
            "round_replay_vs_step_replay": out["round_replay_ms"] / plain["step_replay_ms"],
            "speedup_vs_plain_decode": out["decode_tok_s"] / plain["decode_tok_s"],
            "gdn_state_bytes_per_lane": {"committed": state, "verify_buffers": records, "total": state + records}}
    out["bandwidth_efficiency"] = out["bandwidth_GBps"] / copy_gbs
    return out


def table_lines(s: dict) -> list[str]:
    coin = f", --accept-prob {s['accept_prob']} (a coin per draft, bench only)" if s["accept_prob"] is not None else ""
    mode = "snapshot design, fused" if s.get("state_mode") == "snapshot" else "one graph, fused"
    vocab = f", draft vocabulary {s['draft_vocab']} ids" if s.get("draft_vocab") else ""
    return [f"speculative rounds, K = {s['draft']}{coin}{vocab}:",
            f"{f'  ms per round ({mode})':<34} {s['round_ms']:>14.3f}",
            *(f"{f'  ms per round ({m})':<34} {r['round_ms']:>14.3f}   {r['decode_tok_s']:.1f} tok/s"
              for m, r in s.get("modes", {}).items() if m not in ("fused", "snapshot")),
            f"{'  launches per round':<34} {s.get('launches_per_round', 0):>14}",
            f"{'  tokens per round / acceptance':<34} {s['tokens_per_round']:>8.2f} / {s['acceptance']:.1%}",
            f"{'  decode tok/s':<34} {s['decode_tok_s']:>14.1f}",
            f"{'  bytes per round (MB)':<34} {s['bytes_per_round']['total'] / 1e6:>14.1f}",
            f"{'  bandwidth efficiency':<34} {s['bandwidth_efficiency']:>14.1%}",
            f"{'  round / plain step':<34} {s['round_vs_plain_step']:>13.2f}×",
            f"{'  round replay / step replay':<34} {s['round_replay_vs_step_replay']:>13.2f}×   "
            f"({s['round_replay_ms']:.3f} ms: the round graph replayed {REPLAYS}× back to back)",
            f"{'  decode vs plain decode':<34} {s['speedup_vs_plain_decode']:>13.2f}×",
            f"{'  GDN state per lane (MiB)':<34} {s['gdn_state_bytes_per_lane']['total'] / 2**20:>14.1f}   "
            f"(committed {s['gdn_state_bytes_per_lane']['committed'] / 2**20:.1f} + "
            f"{'K+1 snapshots' if s.get('state_mode') == 'snapshot' else 'ReplaySSM records'} "
            f"{s['gdn_state_bytes_per_lane']['verify_buffers'] / 2**20:.1f})"]
