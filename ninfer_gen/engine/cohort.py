"""cohort: which lane adapter runs a loaded Model's backend as a cohort — `cohort_lanes(model, lanes)`:
ReferenceLanes over the reference backend, the GPU adapter (executor.gpu_lanes.GpuLanes) over the GPU
backend. One place for the bench, `run` with several prompts and the server to choose it; it computes
nothing and imports no CUDA itself."""
from __future__ import annotations


def cohort_lanes(model, lanes: int, *, accept_prob: float | None = None, **options):
    """A LaneBackend of at least `lanes` state slots over `model`'s backend. `accept_prob` (the bench's
    `--accept-prob`: a coin per draft replaces the acceptance) goes to the GPU adapter, whose backend must be
    loaded with `accept_coin=True`; `options` go to the adapter's `for_model` (ReferenceLanes: `batch_steps`)."""
    from ninfer_gen.reference import ReferenceBackend

    if isinstance(model.backend, ReferenceBackend):
        if accept_prob is not None:
            raise ValueError("--accept-prob replaces the acceptance on the GPU lanes only: the reference lanes "
                             "compare every draft with the target")
        from ninfer_gen.engine.lanes import ReferenceLanes
        return ReferenceLanes.for_model(model, lanes, **options)
    from ninfer_gen.executor.gpu_lanes import GpuLanes
    return GpuLanes.for_model(model, lanes, accept_prob=accept_prob, **options)
