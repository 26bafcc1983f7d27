"""round_costs: what a speculative round costs in plain steps on the GPU, per cohort bucket — measured once at
start-up by replaying each round graph and its bucket's step graph (Capabilities.round_cost; the engine's
adaptive draft length, engine.draft_policy, reads it). Every row is padded meanwhile: no state is touched,
and the weights stream as in a real round. What this leaves out (session 31, 27B, H100): padded rows (slot −1) move
no GDN state and no fold, and a plain step's host read of its token is not timed, so a C8 round reads 1.81 plain
steps where the cohort bench's decode rates give 1.58–1.66 (C1: 1.21 against 1.23); the policy's wait for evidence
(engine.draft_policy) absorbs it at the accept rates the issue names. A measurement on throwaway lanes through the
adapter (branch `round-costs-lanes`) waits for a GPU run."""
from __future__ import annotations

import torch

from ninfer_gen.lanes.round_rows import idle_rows


def _replay_ms(run, n: int) -> float:
    """Median device time (ms) of `run()` (a graph replay), n times back to back after one warm-up."""
    run()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for e in events[1:]:
        run()
        e.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))
    return times[len(times) // 2]

def measure_round_costs(lanes, replays: int = 12) -> tuple[tuple[int, float], ...]:
    """(bucket, a round's device time / a plain step's) for every round bucket of the GPU lanes `lanes`
    (lanes.gpu.GpuLanes) that has a step bucket of the same size."""
    be, costs = lanes.be, []
    acceptance = "coin" if lanes.accept_prob is not None else "greedy"
    for b in lanes.round_sizes:
        if b not in lanes.step_sizes:
            continue
        rnd, step = lanes.round_graph(b, acceptance), be.bucket("step", b, 1)
        step.inputs.set([], [], [], [])
        restore = idle_rows(be, lanes.rows.device, b)
        try:
            times = [_replay_ms(lambda: rnd.run(True), replays), _replay_ms(lambda: step.run(True), replays)]
        finally:
            restore()
        costs.append((b, times[0] / times[1]))
    return tuple(costs)
