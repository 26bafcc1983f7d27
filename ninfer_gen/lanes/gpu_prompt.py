"""gpu_prompt: the prompt side of the GPU lanes (lanes.gpu) — one engine step's prompt chunks, every lane's at
once: the target over the chunks (GpuBackend.prefill_many: the pieces of one shape across lanes in one call), a
last chunk's first token, the MTP over each chunk and a prompt's first drafts (speculative.draft_together, batched
the same way), then each lane's round row and prefix checkpoint. A lane whose chunk fails fails alone; a call
that fails fails the lanes in it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer_gen.lanes.contract import LaneState, choose
from ninfer_gen.lanes.images import chunk_images
from ninfer_gen.lanes.reuse import MtpTail
from ninfer_gen.lanes.round_rows import round_row
from ninfer_gen.speculative import Drafter, draft_together


@dataclass(eq=False)
class _Chunk:
    """One lane's chunk on its way through the call."""
    lane: LaneState
    ids: list[int]
    last: bool                          # the chunk ends the prompt
    start: int                          # the lane's committed length before it
    images: Any                         # the image tokens of its placeholders (lanes.images), or None
    mtp_start: int = 0                  # the MTP's first slot (a restored prefix's pending rows come first)
    hidden: torch.Tensor | None = None  # the MTP's hidden rows from mtp_start
    token: int | None = None            # a last chunk's first token
    drafting: bool = False              # a last chunk's lane drafts its first round


def run_chunks(adapter, chunks: list[tuple[LaneState, list[int], bool]]) -> dict[int, int | None | BaseException]:
    """`adapter` (a GpuLanes) runs `chunks` [(lane, ids, last)]: each lane's `prefill` result or its exception."""
    be, out, runs = adapter.be, {}, []
    for lane, ids, last in chunks:                   # a lane whose chunk cannot start fails alone
        try:
            images = chunk_images(lane, lane.length, ids, be.spec.vision, be.encode)
            be.reserve(lane.seq, lane.length + len(ids))
            runs.append(_Chunk(lane, list(ids), last, lane.length, images))
        except Exception as err:
            out[lane.lane] = err
    if not runs:
        return out
    try:
        results = be.prefill_many([c.lane.seq for c in runs], [c.ids for c in runs],
                                  all_hidden=[bool(c.lane.k) for c in runs], images=[c.images for c in runs])
    except Exception as err:                         # the call failed: every lane of it fails
        return {**out, **{c.lane.lane: err for c in runs}}
    jobs = []
    for c, (logits, hidden) in zip(runs, results):
        try:
            job = _after_target(adapter, c, logits, hidden)
        except Exception as err:
            out[c.lane.lane] = err
            continue
        if job is not None:
            jobs.append((c, job))
    drafted = {}
    if jobs:
        try:
            drafted = {c.lane.lane: d for (c, _), d in zip(jobs, draft_together(be.mtp_many, [j for _, j in jobs]))}
        except Exception as err:
            out.update({c.lane.lane: err for c, _ in jobs})
    for c in runs:
        if c.lane.lane not in out:
            try:
                out[c.lane.lane] = _finish(adapter, c, *drafted.get(c.lane.lane, ([], None)))
            except Exception as err:
                out[c.lane.lane] = err
    return out


def _after_target(adapter, c: _Chunk, logits, hidden):
    """The target has run the chunk: a last chunk's first token, and the chunk's MTP job for draft_together —
    a middle chunk's pass (its next tokens are known; K = 0), a drafting last chunk's pass and K drafts — or None."""
    be, lane = adapter.be, c.lane
    priv, seq = lane.private, lane.seq
    tail, priv.tail = priv.tail, None
    c.mtp_start, c.hidden = c.start, hidden
    if tail is not None and lane.k:      # a restored prefix's pending MTP rows come first
        c.mtp_start, c.hidden = tail.start, torch.cat([tail.hidden.to(hidden.device), hidden])
    gen = priv.sampler.gen
    if not c.last:
        return ((Drafter(be, lane.sampling, 0, gen), seq, c.hidden,
                 lane.prompt[c.mtp_start + 1:c.start + len(c.ids) + 1], c.mtp_start) if lane.k else None)
    c.token = lane.anchor = choose(lane, logits[-1])
    c.drafting = bool(lane.k) and adapter._room_for_round(seq.length)
    if not c.drafting:
        return None
    be.reserve(seq, min(seq.length + 2 * adapter.T, adapter.max_context))     # the chained drafts' MTP slots
    return (Drafter(be, lane.sampling, adapter.k, gen), seq, c.hidden, lane.prompt[c.mtp_start + 1:] + [c.token],
            c.mtp_start)


def _finish(adapter, c: _Chunk, drafts: list[int], q) -> int | None:
    """The chunk's end: a drafting lane's first drafts and round row, the prefix checkpoint; the prefill's result."""
    lane, priv = c.lane, c.lane.private
    if not c.last:
        # the MTP's last slot used the next prompt token, which a prompt restoring this one may not share
        adapter._checkpoint(lane, c.start, False, lambda: MtpTail.of(lane.length - 1, c.hidden[-1:]))
        return None
    if c.drafting:
        lane.drafts, priv.q = drafts, q
        if priv.matcher is not None:
            priv.host = True
        else:
            priv.row = round_row(lane.seq, c.token, drafts, lane.k, lane.sampling, lane.stop, adapter.accept_prob,
                                 priv.seed, adapter.be.state.trash_page)
    # drafting ran the MTP over the chunk, its last slot with this request's first token: only that slot is left
    # for a restoring lane; without drafting the whole chunk is
    adapter._checkpoint(lane, c.start, True, lambda: MtpTail.of(lane.length - 1, c.hidden[-1:]) if c.drafting
                        else MtpTail.of(c.mtp_start, c.hidden))
    return c.token
