"""buckets: the runtime profile — the static shapes (entry, batch, tokens) a runtime runs — and their
Plans, traced, fused and lowered. The one source of kernel keys: `ninfer-gen build` compiles the keys
of a profile's plans, and the executable launches exactly those plans (asking it for a shape outside
its profile is an error).

Shapes: `step` with T = 1 (decode) and T = draft + 1 (a prompt's tail) for every cohort size with
B·T ≤ 32 rows, and `prefill` (one sequence) at the chunk and every 16·2^i below it, so a prompt is cut
into full chunks, then prefill pieces of decreasing powers of two, then steps for the last < 16 tokens.
With drafts and an MTP layer, speculative rounds add per cohort size `verify` and `commit` of T = draft
+ 1, `mtp` of T = draft + 1 (the committed slots, padded) and T = 1 (chained drafts), and `mtp` at the
prefill sizes (the teacher-forced pass over a prompt, cut like the prompt). With the fold_in_verify option the
rounds' verifies are `verify.rec` and `verify.rec1` (each writes its record set and first folds the other's), and
`commit.rec1` folds the second set when no next round will.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kernels import KernelKey
from .lower import lower
from .options import CompileOptions
from .passes import run_pipeline
from .plan import Plan
from .spec import ModelSpec
from .targets import Target
from .trace import RECORD_SETS, StatePools, trace

if TYPE_CHECKING:
    from .round import RoundPlan

MAX_ROWS = 32          # B·T of a step bucket: the skinny GEMV's limit
MIN_PREFILL = 16       # the prefill attention tiles 16 queries
PLAIN_TAIL = 4         # without drafts a prompt's tail runs in 4-token steps (each costs about one step's reads)


@dataclass(frozen=True)
class Profile:
    cohorts: tuple[int, ...] = (1,)
    draft: int = 0                      # MTP draft tokens: verify buckets have T = draft + 1
    prefill_chunk: int = 256
    max_context: int = 4096             # tokens per sequence (the block table's width × page size)
    page_size: int = 64
    kv_dtype: str = "int8"
    all_logits: bool = False            # prefill buckets keep every row's logits (evaluation), else the last
    options: CompileOptions = field(default_factory=CompileOptions)
    mtp: bool = False                   # the model has an MTP layer: drafts > 0 make speculative buckets
    draft_vocab: int = 0                # rows of a reduced draft head (the most frequent tokens); 0: the full head
    accept_coin: bool = False           # bench only (`--accept-prob`): rounds whose acceptance is a coin per draft
    snapshots: bool = False             # verify/commit in the snapshot design (K+1 state copies), for comparison
    images: bool = False                # prompts with images (a spec with a vision section): every entry but the
                                        # fold takes M-RoPE positions, and a prompt's pieces (prefill, the B = 1
                                        # steps) take the image tokens of their placeholders

    def __post_init__(self):
        if not self.cohorts or any(not isinstance(b, int) or b < 1 for b in self.cohorts):
            raise ValueError(f"cohorts {self.cohorts!r}: expected positive integers")
        if not 0 <= self.draft < MAX_ROWS:
            raise ValueError(f"draft {self.draft}: expected 0..{MAX_ROWS - 1} tokens")
        if self.prefill_chunk < MIN_PREFILL or self.prefill_chunk % MIN_PREFILL:
            raise ValueError(f"prefill chunk {self.prefill_chunk}: expected a multiple of {MIN_PREFILL}")
        if self.max_context < self.prefill_chunk:
            raise ValueError(f"max context {self.max_context} is shorter than the prefill chunk {self.prefill_chunk}")
        if self.kv_dtype not in ("int8", "bf16"):
            raise ValueError(f"KV dtype {self.kv_dtype!r}: expected int8 or bf16")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def tail_tokens(self) -> int:
        """Tokens of the multi-token step: the verify shape K + 1 with drafts, else PLAIN_TAIL; it also runs
        a prompt's last < 16 tokens."""
        return self.draft + 1 if self.draft else PLAIN_TAIL

    def prefill_sizes(self) -> list[int]:
        """The chunk, then 16·2^i below it, largest first."""
        sizes, s = [self.prefill_chunk], MIN_PREFILL
        while s < self.prefill_chunk:
            sizes.append(s)
            s *= 2
        return sorted(set(sizes), reverse=True)

    @property
    def speculative(self) -> bool:
        return self.mtp and self.draft > 0

    @property
    def record_sets(self) -> int:
        return self.options.record_sets(self.snapshots)

    def draft_rows(self, spec: ModelSpec) -> int:
        """Rows of the MTP head's vocabulary projection: the reduced draft vocabulary's, else the vocabulary's."""
        return self.draft_vocab or spec.model.vocab_size

    def rounds(self) -> list[tuple[int, str]]:
        """(lanes, acceptance) of every one-graph speculative round the profile runs (compiler.round)."""
        if not self.speculative:
            return []
        lanes = [b for b in sorted(set(self.cohorts)) if b * self.tail_tokens <= MAX_ROWS]
        kinds = ("greedy", "sampled") + (("coin",) if self.accept_coin else ())
        return [(b, a) for b in lanes for a in kinds]

    def shapes(self) -> list[tuple[str, int, int]]:
        ts = sorted({1, self.tail_tokens})
        cohorts = sorted(set(self.cohorts))
        steps = [("step", b, t) for b in cohorts for t in ts if b * t <= MAX_ROWS]
        out = steps + [("prefill", 1, t) for t in self.prefill_sizes()]
        if self.speculative:
            rounds = [b for b in cohorts if b * self.tail_tokens <= MAX_ROWS]
            out += [(e, b, self.tail_tokens) for b in rounds for e in ("verify", "commit", "mtp")]
            if self.record_sets == 2:
                kinds = [f"verify.{x}" for x in RECORD_SETS] + [f"commit.{RECORD_SETS[1]}"]
                out += [(e, b, self.tail_tokens) for b in rounds for e in kinds]
            out += [("mtp", b, 1) for b in rounds] + [("mtp", 1, t) for t in self.prefill_sizes()]
        return list(dict.fromkeys(out))

    def prompt_pieces(self, n: int, chunk: int | None = None) -> list[tuple[str, int]]:
        """How a prompt of n tokens is cut, in order: (entry, tokens) — prefill pieces of `chunk` (one of
        the prefill sizes; default the profile's chunk) while they fit, then smaller prefill sizes, then
        steps of `tail_tokens` and of 1 token for the rest (< 16)."""
        chunk = chunk or self.prefill_chunk
        sizes = self.prefill_sizes()
        if chunk not in sizes:
            raise ValueError(f"prefill chunk {chunk} is not a bucket of this profile ({', '.join(map(str, sizes))})")
        out = []
        for size in (s for s in sizes if s <= chunk):
            out += [("prefill", size)] * (n // size)
            n %= size
        tail = self.tail_tokens
        return out + [("step", tail)] * (n // tail) + [("step", 1)] * (n % tail)

    def describe(self) -> str:
        return (f"cohorts {','.join(map(str, self.cohorts))}, draft {self.draft}"
                + ("" if self.speculative or not self.draft else " (no MTP layer: plain decode)")
                + f", prefill chunk {self.prefill_chunk}, "
                f"max context {self.max_context}, {self.kv_dtype} KV"
                + (", all prefill logits" if self.all_logits else "")
                + (f", draft vocabulary {self.draft_vocab}" if self.draft_vocab else "")
                + (", snapshot state mode" if self.snapshots else "") + (", images (M-RoPE)" if self.images else "")
                + f", options {self.options.describe()}")


def cohort_sizes(spec_sizes, lanes: int) -> tuple[int, ...]:
    """The cohort buckets a runtime of `lanes` lanes builds: the spec's sizes up to it and `lanes` itself, so
    any n ≤ lanes has a bucket of at least n (6 lanes: 1, 2, 4, 6)."""
    if lanes < 1:
        raise ValueError(f"lanes must be ≥ 1, got {lanes}")
    return tuple(sorted({b for b in spec_sizes if b <= lanes} | {lanes}))


def profile_of(spec: ModelSpec, *, cohorts=None, draft: int | None = None, max_context: int | None = None,
               kv_dtype: str | None = None, prefill_chunk: int | None = None, all_logits: bool = False,
               options: CompileOptions | None = None, draft_vocab: int = 0, accept_coin: bool = False,
               snapshots: bool = False, images: bool = False) -> Profile:
    """The spec's runtime section, with the caller's choices where given; a context shorter than the
    spec's chunk takes the largest multiple of 16 that fits as its chunk."""
    rt = spec.runtime
    context = max_context or rt.max_context
    chunk = prefill_chunk or min(rt.prefill_chunk, context - context % MIN_PREFILL)
    return Profile(tuple(cohorts or rt.cohorts), rt.draft_tokens if draft is None else draft, chunk, context,
                   rt.page_size, kv_dtype or rt.kv_dtype, all_logits, options or CompileOptions(),
                   mtp=spec.model.mtp.num_layers > 0, draft_vocab=draft_vocab, accept_coin=accept_coin,
                   snapshots=snapshots, images=images)


def plan_bucket(spec: ModelSpec, target: Target, entry: str, batch: int, tokens: int,
                profile: Profile | None = None) -> Plan:
    """One shape's plan. Prefill buckets of more than 32 tokens keep the last row's logits unless the
    profile keeps them all."""
    profile = profile or profile_of(spec)
    per_seq = profile.pages_per_seq
    pools = StatePools(per_seq * batch, batch, per_seq, profile.page_size, profile.kv_dtype)
    last = entry in ("prefill", "mtp") and batch == 1 and tokens > MAX_ROWS and not profile.all_logits
    entry, _, records = entry.partition(".")            # verify.<set>: folds the other set first; commit.<set>
    fold_from = next(x for x in RECORD_SETS if x != records) if entry == "verify" and records else None
    mrope = profile.images and entry != "commit"
    images = tokens if mrope and entry in ("prefill", "step") and batch == 1 else 0
    graph = trace(spec, entry, batch, tokens, pools, "bf16", last_logits=last,
                  draft_rows=profile.draft_vocab if entry == "mtp" else 0, snapshots=profile.snapshots,
                  mrope=mrope, image_tokens=images, records=records or "rec", fold_from=fold_from)
    return lower(run_pipeline(graph, profile.options), spec, target, profile.options)


def plan_profile(spec: ModelSpec, target: Target, profile: Profile) -> dict[tuple[str, int, int], Plan]:
    """Every shape's plan. The cyclic garbage collector is paused meanwhile: the graphs hold ~10^5 live
    objects that it would rescan at every generation-2 pass (27B, 17 buckets: 5.4 → 3.0 s), and
    planning makes no cycles that need it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return {shape: plan_bucket(spec, target, *shape, profile) for shape in profile.shapes()}
    finally:
        if enabled:
            gc.enable()


def plan_rounds(spec: ModelSpec, target: Target, profile: Profile) -> dict[tuple[int, str], "RoundPlan"]:
    """The profile's speculative rounds, fused (the eager variant launches the same keys)."""
    from .round import plan_round
    return {(b, a): plan_round(spec, target, profile, b, a) for b, a in profile.rounds()}


def profile_keys(plans: dict[tuple[str, int, int], Plan], rounds: dict | None = None) -> list[KernelKey]:
    """Every kernel key the plans (and the rounds between their buckets) launch, once, in order of first launch."""
    return list(dict.fromkeys([k for p in plans.values() for k in p.keys()] +
                              [k for r in (rounds or {}).values() for k in r.keys()]))
