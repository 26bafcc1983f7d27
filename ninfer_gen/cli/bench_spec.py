"""bench_spec: `ninfer-gen bench --draft K` — C1 speculative rounds on the GPU backend, measured in the
same run as plain decode (engine.speculative's round, driven here so the acceptance can be replaced).

With random weights the drafts are random and nearly all rejected, so `--accept-prob P` (this bench
only, labelled in its output) replaces the acceptance decision by an independent coin per draft
position: drafts are kept until the first failed coin, then the target's own token follows, so a round
commits 1 + (kept drafts) tokens, E = (1 − P^(K+1)) / (1 − P) on average. Everything else runs as in
serving: verify in record mode, the ReplaySSM commit, the MTP align pass and chained drafts.

Figures: ms per round (host-driven rounds: each step of the round waits for the host's decision),
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
from ninfer_gen.engine.speculative import Drafter, accept_greedy


def _plan_weight_bytes(plan) -> int:
    return sum(device_bytes(c.key.fmt, c.key.n, c.key.k) for c in plan.calls if c.key.family in MATMUL_FAMILIES)


def _accept(drafts: list[int], logits: torch.Tensor, prob: float | None, gen: torch.Generator) -> list[int]:
    if prob is None:
        return accept_greedy(drafts, logits)
    kept = 0
    while kept < len(drafts) and torch.rand((), generator=gen).item() < prob:
        kept += 1
    return drafts[:kept] + [int(logits[kept].argmax())]


def run_rounds(be, prompt: list[int], k: int, rounds: int, accept_prob: float | None, seed: int = 0) -> dict:
    """Prefill `prompt`, then `rounds` timed rounds after four warm-up rounds; one sequence."""
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
    out = run_rounds(be, prompt, k, args.rounds, args.accept_prob)
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
            "bandwidth_GBps": moved["total"] / (out["round_ms"] * 1e-3) / 1e9,
            "round_vs_plain_step": out["round_ms"] / plain["step_replay_ms"],
            "speedup_vs_plain_decode": out["decode_tok_s"] / plain["decode_tok_s"],
            "gdn_state_bytes_per_lane": {"replayssm": state + records, "snapshot_k_plus_1_copies": (k + 1) * state}}
    out["bandwidth_efficiency"] = out["bandwidth_GBps"] / copy_gbs
    return out


def table_lines(s: dict) -> list[str]:
    coin = f", --accept-prob {s['accept_prob']} (a coin per draft, bench only)" if s["accept_prob"] is not None else ""
    return [f"speculative rounds, K = {s['draft']}{coin}:",
            f"{'  ms per round (host-driven)':<34} {s['round_ms']:>14.3f}",
            f"{'  tokens per round / acceptance':<34} {s['tokens_per_round']:>8.2f} / {s['acceptance']:.1%}",
            f"{'  decode tok/s':<34} {s['decode_tok_s']:>14.1f}",
            f"{'  bytes per round (MB)':<34} {s['bytes_per_round']['total'] / 1e6:>14.1f}",
            f"{'  bandwidth efficiency':<34} {s['bandwidth_efficiency']:>14.1%}",
            f"{'  round / plain step':<34} {s['round_vs_plain_step']:>13.2f}×",
            f"{'  decode vs plain decode':<34} {s['speedup_vs_plain_decode']:>13.2f}×",
            f"{'  GDN state per lane (MiB)':<34} ReplaySSM {s['gdn_state_bytes_per_lane']['replayssm'] / 2**20:.1f}, "
            f"{s['draft'] + 1} snapshots {s['gdn_state_bytes_per_lane']['snapshot_k_plus_1_copies'] / 2**20:.1f}"]
