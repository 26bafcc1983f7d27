"""cohort: which lane adapter runs a loaded Model's backend as a cohort — `cohort_lanes(model, lanes)`:
ReferenceLanes over the reference backend, the GPU adapter (lanes.gpu.GpuLanes) over the GPU
backend. One place for the bench, `run` with several prompts and the server to choose it; it computes
nothing and imports no CUDA itself."""
from __future__ import annotations


def cohort_lanes(model, lanes: int, *, accept_prob: float | None = None, warm: bool = True, **options):
    """A LaneBackend of at least `lanes` state slots over `model`'s backend. `accept_prob` (the bench's
    `--accept-prob`: a coin per draft replaces the acceptance) goes to the GPU adapter, whose backend must be
    loaded with `accept_coin=True`; `options` go to the adapter's `for_model` (ReferenceLanes: `batch_steps`).
    The GPU adapter is `warm`ed up before it is returned (below)."""
    from ninfer_gen.reference import ReferenceBackend

    if isinstance(model.backend, ReferenceBackend):
        if accept_prob is not None:
            raise ValueError("--accept-prob replaces the acceptance on the GPU lanes only: the reference lanes "
                             "compare every draft with the target")
        from ninfer_gen.lanes.reference import ReferenceLanes
        return ReferenceLanes.for_model(model, lanes, **options)
    from ninfer_gen.lanes.gpu import GpuLanes
    adapter = GpuLanes.for_model(model, lanes, accept_prob=accept_prob, **options)
    if warm:
        warm_up(adapter)
    return adapter


def warm_up(adapter) -> None:
    """Start-up's last step on the GPU: a short request of each kind the adapter serves (plain and speculative,
    greedy and sampled) through a one-lane engine, so that the first real request finds every host path
    taken — torch loads a kernel's module on its first use, a graph uploads on its first replay — and waits
    no longer than a repeated one (the 27B's first 20-token request: 31 ms cold, 20 ms repeated). The prefix
    cache forgets the warm-up's checkpoints."""
    from ninfer_gen.engine.engine import Engine
    from ninfer_gen.engine.requests import Request
    from ninfer_gen.sampling import SamplingParams

    engine = Engine(adapter, lanes=1, max_queue=4)
    for draft in sorted({0, adapter.k}):
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
            engine.submit(Request(list(range(1, 17)), 4, sampling, draft=draft))
    engine.run_until_idle()
    if adapter.reuse is not None:
        adapter.reuse.cache.clear()
