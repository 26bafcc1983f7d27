"""bench_spec: `ninfer-gen bench --draft K` — C1 speculative decoding on the GPU backend through the engine
(the one round driver, lanes.gpu), measured in the same run as plain decode.

With random weights the drafts are random and nearly all rejected, so `--accept-prob P` (this bench
only, labelled in its output) replaces the acceptance decision by an independent coin per draft
position: drafts are kept until the first failed coin, then the target's own token follows, so a round
commits 1 + (kept drafts) tokens, E = (1 − P^(K+1)) / (1 − P) on average. Everything else runs as in
serving: verify in record mode, the ReplaySSM commit, the MTP align pass and chained drafts.

Figures: ms per round — one-graph rounds in fused mode (the fold first in the next round's graph, rounds
in flight) and in eager mode (the fold its own graph after the host read the round), one request each,
same run — tokens per round, acceptance, decode tok/s, bytes per round (the verify's weights, state and
KV, plus the MTP head's weights once per draft) and bandwidth efficiency, and the ratios to plain decode;
with `--per-k`, the same request at every K from 1 to the built K (a lane's own K in the K-bucket).
"""
from __future__ import annotations

from ninfer_gen.cli.bench_common import engine_run, gdn_state_per_lane, plan_weight_bytes, random_ids, step_bytes


def speculative_figures(model, args, plain: dict, copy_gbs: float) -> dict:
    """The C1 round figures beside `plain` (the decode phase's figures of the same run)."""
    be, spec, k = model.backend, model.spec, args.draft
    prompt = random_ids(args.prompt_tokens, spec.model.vocab_size, 11)
    snapshots = be.profile.snapshots
    modes = {}
    for mode in ("fused",) if snapshots else ("eager", "fused"):      # fused last: its lanes stay the model's
        lanes = model.lanes(1, accept_prob=args.accept_prob, round_mode=mode)
        modes["snapshot" if snapshots else mode] = engine_run(lanes, prompt, args.output_tokens, k)
    out = dict(modes["snapshot" if snapshots else "fused"])
    out["modes"] = modes
    if getattr(args, "per_k", False):
        out["per_k"] = {j: engine_run(lanes, prompt, args.output_tokens, j) for j in range(1, k + 1)}
    rnd = be.exe.round(1, "coin" if args.accept_prob is not None else "greedy")
    out["launches_per_round"] = rnd.launches
    verify = be.exe.plan(("verify", 1, k + 1))
    mtp_weights = plan_weight_bytes(be.exe.plan(("mtp", 1, 1)))
    moved = step_bytes(spec, verify, out["final_context"], be.state.kv_dtype)
    moved["mtp"] = k * mtp_weights
    moved["total"] += moved["mtp"]
    plain_ms = 1e3 / plain["decode_tok_s"]
    out |= {"draft": k, "accept_prob": args.accept_prob, "bytes_per_round": moved,
            "state_mode": "snapshot" if snapshots else "replayssm", "draft_vocab": be.profile.draft_vocab,
            "bandwidth_GBps": moved["total"] / (out["round_ms"] * 1e-3) / 1e9,
            "round_vs_plain_step": out["round_ms"] / plain_ms,
            "round_vs_step_replay": out["round_ms"] / plain["step_replay_ms"],
            "speedup_vs_plain_decode": out["decode_tok_s"] / plain["decode_tok_s"],
            "gdn_state_bytes_per_lane": gdn_state_per_lane(model, k)}
    out["bandwidth_efficiency"] = out["bandwidth_GBps"] / copy_gbs
    return out


def table_lines(s: dict) -> list[str]:
    coin = f", --accept-prob {s['accept_prob']} (a coin per draft, bench only)" if s["accept_prob"] is not None else ""
    mode = "snapshot design, fused" if s.get("state_mode") == "snapshot" else "one graph, fused, in flight"
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
            f"{'  round / step replay':<34} {s['round_vs_step_replay']:>13.2f}×",
            *(f"{f'  K = {j}: tok/s, acceptance':<34} {r['decode_tok_s']:>14.1f}   {r['acceptance']:.1%}, "
              f"{r['tokens_per_round']:.2f} tokens per round" for j, r in s.get("per_k", {}).items()),
            f"{'  decode vs plain decode':<34} {s['speedup_vs_plain_decode']:>13.2f}×",
            f"{'  GDN state per lane (MiB)':<34} {s['gdn_state_bytes_per_lane']['total'] / 2**20:>14.1f}   "
            f"(committed {s['gdn_state_bytes_per_lane']['committed'] / 2**20:.1f} + "
            f"{'K+1 snapshots' if s.get('state_mode') == 'snapshot' else 'ReplaySSM records'} "
            f"{s['gdn_state_bytes_per_lane']['verify_buffers'] / 2**20:.1f})"]
