"""round_costs: what a speculative round costs in plain steps on the GPU, per cohort bucket — measured once at
start-up (Capabilities.round_cost; the engine's adaptive draft length, engine.draft_policy, reads it) by running
throwaway lanes through the adapter's own calls: b lanes of a one-token prompt opened and prefilled, `iters` rounds
of them timed back to back (rounds in flight, as the engine runs them), then `iters` plain steps of the same lanes
(the host's read of each step's token between them), then released. So each figure holds what the engine's rounds
and steps really move and wait for: the GDN states and records of real slots, the fold, the host's gaps — a graph
replay of padded rows (slot −1: the GDN kernels skip them), timed before session 31, left the states out and put a
C8 round at 1.81 plain steps where the cohort bench measured 1.58–1.66 (27B, H100). The engine's own work between
calls is not in it."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ninfer_gen.lanes.contract import LaneState
from ninfer_gen.sampling import SamplingParams


def period_s(call, n: int, device) -> float:
    """Seconds per call of `call()`, n calls back to back after two warm-up calls, the device drained around them."""
    call()
    call()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n


def raise_failed(results: dict) -> None:
    """A throwaway lane's failure (an adapter call's per-lane exception) fails the measurement."""
    for out in results.values():
        if isinstance(out, BaseException):
            raise out


@contextmanager
def throwaway_lanes(lanes, b: int, k: int):
    """b lanes of a one-token prompt with K = k, opened and prefilled on the GPU lanes `lanes`, their budget the
    whole context; cancelled and released on exit, leaving every slot and page free."""
    probe = [LaneState(lane=i, prompt=[0], sampling=SamplingParams(), stop=frozenset(), k=k,
                       max_context=lanes.caps.max_context) for i in range(b)]
    try:
        for lane in probe:
            lanes.open(lane)
        raise_failed(lanes.prefill_many([(lane, [0], True) for lane in probe]))
        for lane in probe:
            lane.budget = lane.room
        yield probe
    finally:
        for lane in probe:
            if lane.seq is not None:
                lane.finish = "cancelled"
                lanes.release(lane)


def measure_round_costs(lanes, iters: int = 12) -> tuple[tuple[int, float], ...]:
    """(bucket, a round's time / a plain step's) for every round bucket of the GPU lanes `lanes` (lanes.gpu.GpuLanes,
    nothing open yet) that has a step bucket of the same size and fits its slots. No prefix checkpoint is taken.
    A context too short for the throwaway lanes' iterations (rounds reserve 2·T positions ahead) measures nothing:
    no costs, so the engine keeps every lane's K (engine.draft_policy has no opinion without them)."""
    be, costs = lanes.be, []
    if 1 + (iters + 2) * (2 * lanes.T + 1) > lanes.caps.max_context:
        return ()
    reuse, lanes.reuse = lanes.reuse, None
    try:
        for b in lanes.round_sizes:
            if b not in lanes.step_sizes or b > lanes.caps.lanes:
                continue
            with throwaway_lanes(lanes, b, lanes.k) as probe:
                def run():
                    raise_failed(lanes.round(probe))
                rnd = period_s(run, iters, be.device)
                for lane in probe:
                    lane.k = 0
                plain = period_s(run, iters, be.device)
            costs.append((b, rnd / plain))
    finally:
        lanes.reuse = reuse
    return tuple(costs)
