"""spec_round: the speculative round's device-side steps between the model's entries (ninfer_gen.speculative
states the math; this family runs it on the device so a round is one CUDA graph):

  begin   verify inputs of each row from its round state: [anchor, drafts], positions L..L+K, table; mode `fold`
          (the verify folds the previous round's records first, CompileOptions.fold_in_verify): a DONE row keeps
          its slot, so the round that finished it still has its accepted records folded;
  probs   sampling distributions (temperature, top-k, top-p; greedy rows one-hot) of logits rows into a
          full-vocabulary fp32 buffer: `verify` every row of the verify, `draft` draft j's row of the MTP
          output (also draws the draft);
  accept  greedy (the target's argmax), `sampled` (speculative rejection sampling) or `coin` (bench only:
          `--accept-prob`) acceptance, truncation at stop tokens and the token budget, the round state's
          update, the fold's inputs (slots, commit counts) and the MTP pass's inputs (committed slots
          padded to K+1, hidden rows of the verify);
  draft   draft j from the MTP output (argmax, or the `probs` draw), mapped through the draft vocabulary,
          and the next chained MTP step's inputs.

Round state: one row of ROW_WORDS int32 per lane (`ROUND_FIELDS`; float fields hold fp32 bits). A row's `k`
(0..K) is how many of the round's K drafts its acceptance may keep: a lane asking fewer drafts than the
bucket's K (or an adaptive policy's choice) runs in the same graph, its later drafts never accepted. A row's
`rope_delta` is what a lane's RoPE positions add to its cache positions (a prompt with images: the 3-axis
M-RoPE positions of its later tokens, all three equal; 0 otherwise). A row's
`state` is RUNNING, DONE (a stop token or the budget ended it) or IDLE (no request): rows that are not
RUNNING when a round starts are padded rows everywhere (slot −1, no keys, trash-page KV writes).
Random numbers: a counter-based hash of (seed, round counter, stream), so replays need no RNG state
beyond the row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import Target
from . import KernelKey, Launch, Param

# must match templates/spec_round.cu.j2
ROUND_FIELDS = ("length", "budget", "anchor", "emitted", "state", "slot", "trash", "counter", "seed_lo",
                "seed_hi", "top_k", "temperature", "top_p", "n_stop", "accept_prob", "stop_hit", "accepted", "k",
                "rope_delta")
DRAFTS_AT, OUT_AT, STOPS_AT, MAX_STOPS, ROW_WORDS = 20, 52, 84, 8, 92
RUNNING, DONE, IDLE = 0, 1, 2
STAGES = ("begin", "probs", "accept", "draft")
MODES = {"begin": ("", "fold"), "probs": ("verify", "draft"), "accept": ("greedy", "sampled", "coin"),
         "draft": ("greedy", "sampled")}
THREADS = 512


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "spec_round"
    stage: str
    mode: str
    b: int            # rows (lanes) of the round
    k: int            # drafts per round (the verify has k + 1 tokens)
    v: int            # the target's vocabulary
    vd: int           # the draft head's rows (v without a reduced draft vocabulary)
    h: int            # hidden size (rows copied into the MTP's inputs)
    p: int            # block-table width (pages per row)
    j: int            # draft index (draft / probs draft), else 0
    arch: str

    def __post_init__(self):
        if self.stage not in STAGES or self.mode not in MODES[self.stage]:
            raise ValueError(f"spec_round: stage {self.stage!r} mode {self.mode!r} (expected {MODES})")
        if not 1 <= self.k < OUT_AT - DRAFTS_AT or not 0 <= self.j < self.k:
            raise ValueError(f"spec_round: drafts k = {self.k} (1..31) and j = {self.j} (0..k−1) expected")
        if self.h % 8 or self.vd > self.v or self.b < 1 or self.p < 1:
            raise ValueError(f"spec_round: hidden size a multiple of 8, draft rows ≤ vocabulary expected: {self}")

    def _name_parts(self):
        parts = [self.stage] + ([self.mode] if self.mode else []) + [f"b{self.b}", f"k{self.k}"]
        if self.stage in ("probs", "accept", "draft"):
            parts += [f"v{self.v}"] + ([f"vd{self.vd}"] if self.vd != self.v else [])
        if self.stage in ("accept", "draft"):
            parts += [f"h{self.h}"]
        if self.stage != "probs":
            parts += [f"p{self.p}"]
        if self.stage == "draft" or self.mode == "draft":
            parts += [f"j{self.j}"]
        return parts


def make_key(stage: str, mode: str, b: int, k: int, target: Target, *, v: int = 0, vd: int = 0, h: int = 8,
             p: int = 1, j: int = 0) -> Key:
    """The key with the fields a stage does not use normalised (one key per distinct kernel)."""
    uses_v = stage != "begin"
    return Key(stage, mode, b, k, v if uses_v else 0, (vd or v) if stage in ("probs", "draft") else (v if uses_v else 0),
               h if stage in ("accept", "draft") else 8, p if stage != "probs" else 1,
               j if stage == "draft" or mode == "draft" else 0, target.arch)


def launch(key: Key, target: Target | None = None) -> Launch:
    rows = key.b * (key.k + 1) if key.stage == "probs" and key.mode == "verify" else key.b
    return Launch((rows, 1, 1), (THREADS, 1, 1), 0)


_INPUTS = ("tokens", "row_pos", "pos", "block_table", "slots", "seq_lens", "mrope")     # mrope: null unless images


def params(key: Key) -> list[Param]:
    """Every stage's parameters, in order (unused ones of a mode are bound to null)."""
    rnd = [Param("round", "ptr", f"[b, {ROW_WORDS}] int32 round state (ROUND_FIELDS)")]
    table = [Param("tables", "ptr", "[b, p] int32 block tables of the rows")]
    nxt = [Param(f"in_{n}", "ptr", f"the next entry's step input {n}") for n in _INPUTS]
    if key.stage == "begin":
        return rnd + table + nxt
    if key.stage == "probs":
        return rnd + [Param("logits", "ptr", "[rows, vd] f32"), Param("ids", "ptr", "[vd] int32 draft ids or null"),
                      Param("dist", "ptr", "out [rows, v] (verify) or [b, k, v] (draft) f32"),
                      Param("drawn", "ptr", "out [b] int32 draft drawn (draft)")]
    if key.stage == "accept":
        return rnd + table + [Param("best", "ptr", "[b·(k+1)] int32 target argmax (greedy, coin)"),
                              Param("p_dist", "ptr", "[b·(k+1), v] f32 target distributions (sampled)"),
                              Param("q_dist", "ptr", "[b, k, v] f32 draft distributions (sampled)"),
                              Param("hidden", "ptr", "[b·(k+1), h] bf16 the verify's hidden rows"),
                              Param("fold_slots", "ptr", "the fold's step input slots"),
                              Param("fold_commit", "ptr", "the fold's step input commit")] + nxt + \
            [Param("in_hidden", "ptr", "the MTP's step input hidden [b·(k+1), h] bf16")]
    return rnd + table + [Param("best", "ptr", "[rows, ] int32 argmax of the MTP logits (greedy)"),
                          Param("drawn", "ptr", "[b] int32 (sampled)"),
                          Param("ids", "ptr", "[vd] int32 draft ids or null"),
                          Param("hidden", "ptr", "[rows, h] bf16 the MTP's normed output")] + nxt + \
        [Param("in_hidden", "ptr", "the next MTP step's input hidden [b, h] bf16 (null after the last draft)")]
