"""buckets: the static shapes a runtime profile needs (decode and verify per cohort size, MTP drafting,
the prefill chunk) traced, fused and lowered into Plans — and the kernel set `ninfer-gen build` compiles.

Kernels the graphs do not express yet (ReplaySSM record/fold/commit modes, on-device argmax) come
from `kernels.catalog`, which lists what the runtime will launch beside the graphs."""
from __future__ import annotations

from .kernels import catalog
from .lower import Plan, lower
from .passes import run_pipeline
from .spec import ModelSpec
from .targets import Target
from .trace import StatePools, trace


def bucket_shapes(spec: ModelSpec, cohorts, draft: int) -> list[tuple[str, int, int]]:
    """(entry, B, T): step at T = 1 (decode) and T = draft + 1 (verify), MTP drafting at T = 1, for
    every cohort size with B·T ≤ 32 rows; one prefill chunk and its teacher-forced MTP pass."""
    shapes = [("step", b, t) for b, t in catalog.buckets(cohorts, draft)]
    if spec.model.mtp.num_layers and draft:
        shapes += [("mtp", b, 1) for b in sorted(set(cohorts))]
        shapes.append(("mtp", 1, spec.runtime.prefill_chunk))
    return shapes + [("prefill", 1, spec.runtime.prefill_chunk)]


def plan_bucket(spec: ModelSpec, target: Target, entry: str, batch: int, tokens: int,
                last_logits: bool | None = None) -> Plan:
    """`last_logits` (default: more than 32 tokens) keeps only the last row's logits."""
    rt = spec.runtime
    per_seq = -(-rt.max_context // rt.page_size)
    pools = StatePools(per_seq * batch, batch, per_seq, rt.page_size, rt.kv_dtype)
    last = tokens > 32 if last_logits is None else last_logits
    graph = trace(spec, entry, batch, tokens, pools, "bf16", last_logits=last)
    return lower(run_pipeline(graph), spec, target)


def plan_all(spec: ModelSpec, target: Target, cohorts=None, draft: int | None = None) -> dict:
    cohorts = cohorts or spec.runtime.cohorts
    draft = spec.runtime.draft_tokens if draft is None else draft
    return {shape: plan_bucket(spec, target, *shape) for shape in bucket_shapes(spec, cohorts, draft)}


def kernel_set(spec: ModelSpec, target: Target, plans: dict, cohorts=None, draft: int | None = None):
    """(keys from the lowered graphs, extra keys from the catalog), de-duplicated, in order."""
    from_graphs = list(dict.fromkeys(k for p in plans.values() for k in p.keys()))
    seen = set(from_graphs)
    extra = [k for k in catalog.spec_keys(spec, target, cohorts, draft) if k not in seen]
    return from_graphs, extra
