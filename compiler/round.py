"""round: the speculative round of B lanes as one launch list, which the runtime captures as one CUDA graph.

ninfer_gen.speculative states the round's math; this module orders it for the device:

  [commit B×(K+1)]       fused mode: the previous round's accepted records folded in (m = 0: nothing)
  spec_round begin       verify inputs from the round-state rows
  verify B×(K+1)         the target in record mode (fold_in_verify: record set `parity`, which first folds the
                         previous round's records of the other set: no commit step; rounds alternate parity)
  argmax | probs verify  the target's choice (greedy, coin) or distributions (sampled)
  spec_round accept      acceptance, truncation, the state update; the fold's and the MTP's inputs
  mtp B×(K+1)            the MTP over the committed slots (padded to K+1)
  per draft j < K:       argmax | probs draft j, spec_round draft j, then mtp B×1 for the next draft

Everything a round reads or writes between entries is a binding: another bucket's step inputs and
outputs (`BucketInput`, `BucketOutput`) and the round's own buffers (`RoundBuffer`, sized in `buffers`),
so the runtime binds a round like a plan and knows no kernel family. Eager mode leaves the commit out:
the runtime runs the fold bucket after the host has seen the round (its inputs are already written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kernels import argmax, module_of, spec_round
from .plan import NULL, BucketInput, BucketOutput, Call, RoundBuffer, Weight, check_args
from .spec import ModelSpec
from .targets import Target, supports_pdl
from .trace import RECORD_SETS

ACCEPTANCE = ("greedy", "sampled", "coin")
_INPUTS = ("tokens", "row_pos", "pos", "block_table", "slots", "seq_lens")


@dataclass
class RoundPlan:
    batch: int
    draft: int
    acceptance: str                     # greedy | sampled | coin (the bench's --accept-prob)
    fold: bool                          # fused mode: the previous round's records are folded inside the round
    parity: int = 0                     # fold_in_verify: the record set this round's verify writes (RECORD_SETS)
    steps: list = field(default_factory=list)       # bucket shapes (entry, B, T) and Calls, in launch order
    buffers: dict[str, tuple[tuple[int, ...], str, bool]] = field(default_factory=dict)  # name → shape, dtype, zeroed

    def calls(self) -> list[Call]:
        return [s for s in self.steps if isinstance(s, Call)]

    def buckets(self) -> list[tuple[str, int, int]]:
        return list(dict.fromkeys(s for s in self.steps if isinstance(s, tuple)))

    def keys(self) -> list:
        return list(dict.fromkeys(c.key for c in self.calls()))

    def describe(self) -> str:
        return "\n".join(f"  {i} " + (f"bucket {s[0]} {s[1]}x{s[2]}" if isinstance(s, tuple) else
                                      f"call {s.key.name} " + " ".join(f"{n}<-{b}" for n, b in s.args if b != NULL))
                         for i, s in enumerate(self.steps))


def record_buckets(batch: int, tokens: int, parity: int) -> tuple[tuple, tuple, tuple]:
    """fold_in_verify's buckets of a round of parity p: (its verify — writing set p, folding set 1 − p —, the
    next round's verify, the commit bucket of set p: what a flush runs when no next round folds them)."""
    verify = lambda p: (f"verify.{RECORD_SETS[p]}", batch, tokens)
    commit = ("commit", batch, tokens) if parity == 0 else (f"commit.{RECORD_SETS[1]}", batch, tokens)
    return verify(parity), verify(1 - parity), commit


def plan_round(spec: ModelSpec, target: Target, profile, batch: int, acceptance: str = "greedy",
               fold: bool = True, parity: int = 0) -> RoundPlan:
    """The round of `batch` lanes with the profile's K drafts (profile: compiler.buckets.Profile); with the
    profile's fold_in_verify (fused mode) the round of record set `parity`."""
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance {acceptance!r}: expected one of {', '.join(ACCEPTANCE)}")
    if not profile.speculative:
        raise ValueError(f"profile ({profile.describe()}) has no speculative rounds")
    k, a = profile.draft, spec.model
    t, v, vd, h, p = k + 1, a.vocab_size, profile.draft_rows(spec), a.hidden_size, profile.pages_per_seq
    pdl = profile.options.pdl and supports_pdl(target.arch)
    verify, mtp_all, mtp_one, commit = ("verify", batch, t), ("mtp", batch, t), ("mtp", batch, 1), ("commit", batch, t)
    in_verify = fold and profile.record_sets == 2        # fold_in_verify, not in snapshot mode
    following = commit                                   # whose `commit` input takes this round's counts
    if in_verify:
        verify, following, commit = record_buckets(batch, t, parity)
    ids = NULL if vd == v else Weight("mtp.draft_ids", "tensor")         # draft row → token id
    rp = RoundPlan(batch, k, acceptance, fold, parity if in_verify else 0)
    rows = batch * t
    rp.buffers = {"round": ((batch, spec_round.ROW_WORDS), "i32", False), "tables": ((batch, p), "i32", False),
                  "best_verify": ((rows,), "i32", False), "best_mtp": ((rows,), "i32", False),
                  "argmax_partial": ((rows * argmax.slices(argmax.Key(v, rows, target.arch)) * 2,), "f32", False),
                  "argmax_counters": ((rows,), "i32", True)}
    sampled = acceptance == "sampled"
    if sampled:
        rp.buffers |= {"p_dist": ((rows, v), "f32", False), "q_dist": ((batch, k, v), "f32", False),
                       "drawn": ((batch,), "i32", False)}

    def call(key, **args):
        rp.steps.append(Call(key, module_of(key).launch(key, target), -1, check_args(key, args), programmatic=pdl))

    def inputs(shape, with_hidden: bool = False):
        out = {f"in_{n}": BucketInput(shape, n) for n in _INPUTS}
        out["in_mrope"] = BucketInput(shape, "mrope") if profile.images else NULL
        if with_hidden:
            out["in_hidden"] = BucketInput(shape, "hidden")
        return out

    def pick(logits, out, m, width):
        call(argmax.Key(width, m, target.arch), out=RoundBuffer(out), logits=logits,
             partial=RoundBuffer("argmax_partial"), counters=RoundBuffer("argmax_counters"))

    state = {"round": RoundBuffer("round"), "tables": RoundBuffer("tables")}
    key = lambda stage, mode, **kw: spec_round.make_key(stage, mode, batch, k, target, v=v, vd=vd, h=h, p=p, **kw)
    if fold and not in_verify:
        rp.steps.append(commit)
    call(key("begin", "fold" if in_verify else ""), **state, **inputs(verify))
    rp.steps.append(verify)
    if sampled:
        call(key("probs", "verify"), round=RoundBuffer("round"), logits=BucketOutput(verify, "logits"), ids=NULL,
             dist=RoundBuffer("p_dist"), drawn=NULL)
    else:
        pick(BucketOutput(verify, "logits"), "best_verify", rows, v)
    call(key("accept", acceptance), **state, best=NULL if sampled else RoundBuffer("best_verify"),
         p_dist=RoundBuffer("p_dist") if sampled else NULL, q_dist=RoundBuffer("q_dist") if sampled else NULL,
         hidden=BucketOutput(verify, "hidden"), fold_slots=BucketInput(commit, "slots"),
         fold_commit=BucketInput(following, "commit"), **inputs(mtp_all, True))
    rp.steps.append(mtp_all)
    mode = "sampled" if sampled else "greedy"
    for j in range(k):
        src = mtp_all if j == 0 else mtp_one
        if sampled:
            call(key("probs", "draft", j=j), round=RoundBuffer("round"), logits=BucketOutput(src, "logits"), ids=ids,
                 dist=RoundBuffer("q_dist"), drawn=RoundBuffer("drawn"))
        else:
            pick(BucketOutput(src, "logits"), "best_mtp", src[1] * src[2], vd)
        nxt = inputs(mtp_one, True) if j + 1 < k else {f"in_{n}": NULL for n in (*_INPUTS, "mrope", "hidden")}
        call(key("draft", mode, j=j), **state, best=NULL if sampled else RoundBuffer("best_mtp"),
             drawn=RoundBuffer("drawn") if sampled else NULL, ids=ids, hidden=BucketOutput(src, "hidden"), **nxt)
        if j + 1 < k:
            rp.steps.append(mtp_one)
    return rp
