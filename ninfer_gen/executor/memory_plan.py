"""memory_plan: one VRAM budget (default 24 GiB, the RTX 3090) split into weights, activation arena,
graph pools, GDN state slots, ReplaySSM records, headroom and — from what is left — the KV pool.

Pure arithmetic on the spec; runs on any machine. Does not fit → `MemoryPlanError` naming the overflow.
The vision tower, when images are on, is a part of its own (`vision_bytes`: its bf16 weights and one image's
activations, executor.vision_encoder); the weights part is the text model's tensor table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from compiler.options import CompileOptions
from compiler.sizes import record_bytes_per_token, snapshot_bytes_per_token, summary
from compiler.spec import ModelSpec

GiB = 1024 ** 3
MiB = 1024 ** 2
CONTEXT_HEADROOM = 512 * MiB   # CUDA context, module images, allocator slack (outside our buffers)
GRAPH_POOLS = 64 * MiB         # captured CUDA graphs' private pools, all buckets


class MemoryPlanError(ValueError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    cohort: int
    draft_tokens: int
    max_context: int
    kv_dtype: str
    weights: int
    activations: int
    graph_pools: int
    state_slots: int
    records: int
    rounds: int
    headroom: int
    kv_pool: int
    kv_bytes_per_token: int
    page_size: int
    prefix_states: int = 0             # prefix-cache checkpoints' saved GDN states (lanes.reuse)
    prefix_bytes: int = 0
    kv_pool_tokens: int | None = None  # a KV pool shared by the lanes (None: each lane its whole context)
    vision: int = 0                    # the vision tower's bf16 weights and one image's activations (images on)
    vision_patches: int = 0            # the most patches of one image the tower's activations are planned for

    @property
    def kv_pages(self) -> int:
        """Pages the pool holds for sequences: what its bytes hold less the trash page padded rows write to
        (executor.device_state), so a pool the lanes fill still keeps the device within the budget."""
        return max(0, self.kv_pool // (self.kv_bytes_per_token * self.page_size) - 1)

    @property
    def used_kv_pages(self) -> int:
        """Pages the GPU backend allocates: the lanes' contexts (or the shared pool), at most the pool, plus
        the trash page padded rows write to (executor.device_state)."""
        need = kv_pool_pages(self.cohort, self.max_context, self.page_size, self.kv_pool_tokens)
        return min(self.kv_pages, need) + 1

    @property
    def peak(self) -> int:
        """The planned device peak: every fixed part (the context headroom included) and the KV pages the
        backend allocates — not the whole leftover `kv_pool` could take."""
        return self.total - self.kv_pool + self.used_kv_pages * self.page_size * self.kv_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def total(self) -> int:
        return (self.weights + self.activations + self.graph_pools + self.state_slots + self.records
                + self.rounds + self.prefix_bytes + self.vision + self.headroom + self.kv_pool)

    def rows(self) -> list[tuple[str, int]]:
        return [("weights", self.weights), ("activation arena", self.activations), ("graph pools", self.graph_pools),
                (f"GDN state slots ({self.cohort})", self.state_slots),
                (f"ReplaySSM records ({self.cohort} × {self.draft_tokens + 1} tokens)", self.records),
                ("round buffers (sampling distributions)", self.rounds),
                (f"prefix checkpoints ({self.prefix_states} GDN states)", self.prefix_bytes),
                (f"vision tower (+ an image ≤ {self.vision_patches} patches)" if self.vision else "vision tower (none)",
                 self.vision),
                ("context headroom", self.headroom),
                (f"KV pool ({self.kv_pages} pages = {self.kv_tokens} tokens)", self.kv_pool)]

    def to_json(self) -> dict:
        return {**asdict(self), "kv_pages": self.kv_pages, "kv_tokens": self.kv_tokens, "total": self.total,
                "used_kv_pages": self.used_kv_pages, "peak": self.peak}


def activation_bytes(spec: ModelSpec, cohort: int, draft: int) -> int:
    """Largest live activations: a prefill chunk's widest intermediates (bf16), the permuted copy of
    the widest GEMM input (the down projection's; sm_90's gemm_wg reads it, compiler/kernels/xperm.py),
    plus the logits of the largest decode/verify bucket (fp32, target and draft)."""
    a, g = spec.model, spec.model.linear_attention
    q_rows = a.attention.num_heads * a.attention.head_dim * 2
    per_token = 3 * a.intermediate_size + 2 * g.conv_dim + 4 * a.hidden_size + q_rows
    rows = cohort * (draft + 1)
    return spec.runtime.prefill_chunk * per_token * 2 + 2 * rows * a.vocab_size * 4


def vision_bytes(spec: ModelSpec, patches: int, target=None) -> int:
    """The vision tower on the device (executor.vision_encoder): its bf16 weights, and the live activations
    of one image of `patches` patches run eagerly in torch — per patch the bf16 input row, the residual, norm,
    qkv, attention output and the MLP's two intermediates, and the fp32 rotary temporaries of q and k — with
    the merger's rows on top (a bound, not a count: torch's allocator keeps freed blocks for reuse). With a
    `target`, the compiled encoder's instead (executor.vision_plan.encoder_bytes: a count)."""
    if spec.vision is None or patches <= 0:
        return 0
    if target is not None:
        from ninfer_gen.executor.vision_plan import encoder_bytes
        return encoder_bytes(spec, target, patches)
    from compiler.spec import vision_tensor_table

    v = spec.vision
    weights = sum(2 * t.numel for t in vision_tensor_table(spec))
    per_patch = 2 * (v.patch_dim + 8 * v.hidden_size + 2 * v.intermediate_size) + 4 * 4 * v.hidden_size
    merged = patches // v.merge_unit * (2 * v.merge_unit * v.hidden_size + v.out_hidden_size) * 2
    return weights + patches * per_patch + merged


def round_bytes(spec: ModelSpec, cohort: int, draft: int) -> int:
    """The one-graph round's own buffers (compiler.round): the sampled rounds' fp32 distributions of every
    verify row and every draft over the vocabulary, plus small state rows, tables and argmax partials."""
    if not draft or not spec.model.mtp.num_layers:
        return 0
    return (cohort * (2 * draft + 1) * spec.model.vocab_size * 4) + MiB


def plan_memory(spec: ModelSpec, cohort: int, max_context: int, budget: int, draft: int | None = None,
                kv_dtype: str | None = None, snapshots: bool = False, kv_pool_tokens: int | None = None,
                prefix_states: int = 0, vision_patches: int = 0, record_sets: int | None = None,
                vision_target=None) -> MemoryPlan:
    """`snapshots`: verify keeps K+1 state copies per lane (snapshot mode) instead of ReplaySSM records;
    `kv_pool_tokens`: the KV pool every lane shares must hold that many tokens (default: each lane its
    whole context, cohort × max_context); a lane's own limit stays `max_context`; `prefix_states`: saved
    GDN states of the prefix cache's checkpoints (their KV pages come out of the KV pool); `vision_patches`
    (images on): the tower and one image of that many patches (`vision_bytes`; with `vision_target`, the Target
    of a load with `vision_kernels`: the compiled encoder's packed weights and arena, executor.vision_plan.
    encoder_bytes); `record_sets`: ReplaySSM record sets per lane (CompileOptions.record_sets; None: the default
    options', two since the rounds fold inside the next verify)."""
    if cohort <= 0 or max_context <= 0 or budget <= 0:
        raise MemoryPlanError("cohort, max context and budget must be positive")
    draft = spec.runtime.draft_tokens if draft is None else draft
    kv_dtype = kv_dtype or spec.runtime.kv_dtype
    record_sets = CompileOptions().record_sets(snapshots) if record_sets is None else record_sets
    s = summary(spec)
    per_token = s["kv_bytes_per_token_int8" if kv_dtype == "int8" else "kv_bytes_per_token_bf16"]
    fixed = dict(weights=s["weight_bytes"], activations=activation_bytes(spec, cohort, draft),
                 graph_pools=GRAPH_POOLS,
                 state_slots=cohort * (s["gdn_state_bytes_per_sequence"] + s["conv_history_bytes_per_sequence"]),
                 records=cohort * (draft + 1) * (snapshot_bytes_per_token(spec) if snapshots else
                                                record_sets * record_bytes_per_token(spec)) if draft else 0,
                rounds=round_bytes(spec, cohort, draft),
                 prefix_bytes=prefix_states * (s["gdn_state_bytes_per_sequence"] + s["conv_history_bytes_per_sequence"]),
                 vision=vision_bytes(spec, vision_patches, vision_target), headroom=CONTEXT_HEADROOM)
    left = budget - sum(fixed.values())
    plan = MemoryPlan(budget, cohort, draft, max_context, kv_dtype, kv_pool=max(0, left),
                      kv_bytes_per_token=per_token, page_size=spec.runtime.page_size, prefix_states=prefix_states,
                      kv_pool_tokens=kv_pool_tokens, vision_patches=vision_patches if fixed["vision"] else 0,
                      **fixed)
    need_pages = kv_pool_pages(cohort, max_context, plan.page_size, kv_pool_tokens)
    if left <= 0 or plan.kv_pages < need_pages:
        parts = ", ".join(f"{name} {size / GiB:.2f} GiB" for name, size in plan.rows()[:-1])
        need = need_pages * plan.page_size * per_token
        what = (f"a shared pool of {kv_pool_tokens} tokens" if kv_pool_tokens else
                f"{cohort} lane(s) × {max_context} tokens")
        raise MemoryPlanError(
            f"does not fit in {budget / GiB:.2f} GiB: {parts} leave {max(left, 0) / GiB:.2f} GiB for the KV "
            f"cache, but {what} need {need / GiB:.2f} GiB "
            f"({kv_dtype} KV, {per_token / 1024:.1f} KiB per token). Lower --max-context or --cohorts, "
            + (f"keep fewer than {prefix_states} prefix checkpoints (--prefix-cache), " if prefix_states else "")
            + "or raise --vram-budget.")
    return plan


def kv_pool_pages(cohort: int, max_context: int, page_size: int, kv_pool_tokens: int | None = None) -> int:
    """Pages of the KV pool: a shared pool of `kv_pool_tokens`, else every lane's whole context."""
    if kv_pool_tokens is not None:
        if kv_pool_tokens < max_context:
            raise MemoryPlanError(f"a KV pool of {kv_pool_tokens} tokens cannot hold one lane's context of "
                                  f"{max_context} tokens")
        return -(-kv_pool_tokens // page_size)
    return cohort * -(-max_context // page_size)


def parse_bytes(text: str) -> int:
    """'24GiB', '22 GB', '512MiB' or a plain number of bytes."""
    t = text.strip().replace(" ", "")
    units = {"GiB": GiB, "MiB": MiB, "GB": 10 ** 9, "MB": 10 ** 6, "G": GiB, "M": MiB, "": 1}
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit) and unit:
            number = t[: -len(unit)]
            break
    else:
        unit, number = "", t
    try:
        return int(float(number) * units[unit])
    except ValueError:
        raise MemoryPlanError(f"cannot read a size from {text!r} (e.g. 24GiB, 22GB, 512MiB)") from None
