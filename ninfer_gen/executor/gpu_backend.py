"""gpu_backend: the GPU runtime behind `load(backend="gpu")`, `ninfer-gen run` and `ninfer-gen bench`.

Sets up, in order: the memory plan under one VRAM budget (enforced on torch's allocator too), the
weights on the device, the state pool (KV pages + GDN slots), and the `Executable`; then serves the
same calls as the reference backend — sequences with block tables and state slots, chunked prefill
and decode steps — each bucket replayed as a CUDA graph captured on first use (or all of them at start-up:
`capture_profile`), and the prefix cache's state copies (allocators.prefix: save/restore/free a slot's GDN
state, copy a KV page).

The backend runs one runtime profile (compiler.buckets.Profile: its cohort sizes, draft length, prefill
chunk, context and options); every kernel of the profile is built when the backend starts, so no
request waits for a compile. A prompt is cut by `Profile.prompt_pieces`: full chunks, prefill pieces
of decreasing powers of two, then steps for the last < 16 tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from compiler.buckets import cohort_sizes, profile_of
from compiler.options import CompileOptions
from compiler.spec import ModelSpec
from compiler.targets import Target, arch_path_target

from ninfer_gen.executor.cuda_module import KernelCache, primary_context
from ninfer_gen.executor.device_weights import DeviceWeights
from ninfer_gen.executor.draft_head import IDS as DRAFT_IDS, add_draft_head
from ninfer_gen.executor.device_state import DeviceState
from ninfer_gen.executor.executable import Executable
from ninfer_gen.executor.memory_plan import GiB, MemoryPlan, kv_pool_pages, plan_memory
from ninfer_gen.executor.vision_encoder import DEFAULT_PATCHES, VisionEncoder
from ninfer_gen.allocators.sequences import Sequence, SequencePool


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def device_target(device: torch.device, arch_path: str | None = None) -> Target:
    """The target card entry for the GPU we run on (by compute capability), or the arch path's: another
    card's kernels, or another arch's sized for this GPU's SMs, run as PTX (compiler.targets.arch_path_target
    refuses a path newer than the device)."""
    target = arch_path_target(device_arch(device), arch_path)            # a refusal comes before any device query
    if arch_path is None:
        return target
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return arch_path_target(device_arch(device), arch_path, sms)


@dataclass(eq=False)
class _Piece:
    """One call's share of one sequence: `t` tokens (padded past `used`) of `entry` at position `start`; an MTP
    piece's hidden rows [used, H]; a prompt piece's image tokens."""
    row: int                               # the sequence's index in the call
    entry: str
    t: int
    tokens: list[int]
    start: int
    used: int
    hidden: torch.Tensor | None = None
    images: torch.Tensor | None = None


class GpuBackend(SequencePool):
    def __init__(self, spec: ModelSpec, weights: DeviceWeights, *, max_context: int | None = None,
                 cohorts: int = 1, kv_dtype: str | None = None, vram_budget: int = 24 * GiB,
                 use_graphs: bool = True, build_root=None, jobs: int | None = None, device="cuda",
                 memory: MemoryPlan | None = None, progress: bool = False,
                 options: CompileOptions = CompileOptions(), all_logits: bool = False,
                 prefill_chunk: int | None = None, draft: int | None = None, round_mode: str = "fused",
                 accept_coin: bool = False, draft_vocab: list[int] | None = None, kv_pool_tokens: int | None = None,
                 prefix_states: int = 0, arch_path: str | None = None, vision=None,
                 vision_patches: int = DEFAULT_PATCHES, vision_kernels: bool = False):
        """`cohorts` lanes (the profile's step buckets: the spec's cohort sizes up to it); `all_logits`:
        prefill buckets keep every row's logits (evaluation: `Model.forward_logits`), else the last;
        `prefill_chunk`: the largest prefill bucket (default: the spec's, within the context); `draft`: the MTP
        drafts per speculative round the profile builds for (default: the spec's; 0: plain decode only);
        `round_mode`: `snapshot` builds the rounds in the snapshot design (K+1 state copies per lane instead
        of ReplaySSM records, for comparison), anything else the ReplaySSM design (how rounds run, fused or
        eager, is the lanes' choice: lanes.gpu); `accept_coin` (bench only) also builds the `--accept-prob` rounds;
        `draft_vocab`: token ids the MTP drafts from (a reduced head of those LM-head rows; None: all);
        `kv_pool_tokens`: one KV pool of that many tokens shared by the lanes (default: cohorts × context);
        `prefix_states`: GDN states the prefix cache may keep (device memory, in the plan; 0: no prefix cache);
        `arch_path`: run another, older card's code path as compute_XX PTX the driver JIT-compiles (`rtx3090`: that
        card's kernels exactly; `sm_86`: that arch's, no PDL, no gemm_wg, with grids sized for this device's SMs;
        None: the device's own arch, as cubins); `vision`: the
        tower's tensors (canonical `visual.*` names, float, host or device) of a spec with a vision section — the
        profile then takes prompts with images (M-RoPE buckets, image tokens in a prompt's pieces) and `encode`
        runs the tower (None: text only); `vision_patches`: the largest image (in patches) the memory plan
        holds the tower's activations for; `vision_kernels`: run the tower on the compiler's encoder plans
        (executor.vision_plan, opt-in: correct on the GPU tier, speed not yet measured) instead of torch; the memory
        plan then counts its packed weights and arena (0.92 GiB for the 27B's tower at 4,096 patches, torch's 1.10)."""
        self.spec, self.device, self.use_graphs = spec, torch.device(device), use_graphs
        self.target = device_target(self.device, arch_path)          # refuses a path this device cannot run
        rt = spec.runtime
        kv_dtype = kv_dtype or rt.kv_dtype
        ctx = max_context or rt.max_context
        snapshots = round_mode == "snapshot"
        if draft_vocab is not None and len(draft_vocab) >= spec.model.vocab_size:
            draft_vocab = None
        self.draft_ids = draft_vocab
        self.profile = profile_of(spec, cohorts=cohort_sizes(rt.cohorts, cohorts),
                                  max_context=ctx, kv_dtype=kv_dtype, all_logits=all_logits, options=options,
                                  prefill_chunk=prefill_chunk, draft=draft, accept_coin=accept_coin,
                                  draft_vocab=len(draft_vocab) if draft_vocab else 0, snapshots=snapshots,
                                  images=vision is not None)
        self.memory = memory or plan_memory(spec, cohorts, ctx, vram_budget, draft=draft, kv_dtype=kv_dtype,
                                            snapshots=snapshots, kv_pool_tokens=kv_pool_tokens,
                                            record_sets=self.profile.record_sets, prefix_states=prefix_states,
                                            vision_patches=vision_patches if vision is not None else 0,
                                            vision_target=self.target if vision_kernels else None)
        self.prefix_states = prefix_states
        per_seq = math.ceil(ctx / rt.page_size)
        pages = min(self.memory.kv_pages, kv_pool_pages(cohorts, ctx, rt.page_size, kv_pool_tokens))
        primary_context(self.device.index)
        if draft_vocab is not None:
            add_draft_head(weights, draft_vocab)
        self.kernels = KernelCache(build_root, jobs=jobs, progress=progress,
                                   jit_ptx=self.target.arch != device_arch(self.device))
        self.encoder = None
        if vision is not None and vision_kernels:      # before the KV pool: packing holds the tower twice a moment
            from ninfer_gen.executor.vision_plan import CompiledVisionEncoder
            self.encoder = CompiledVisionEncoder(spec, vision, self.device, self.target, self.kernels, vision_patches)
        elif vision is not None:
            self.encoder = VisionEncoder(spec, vision, self.device)
        rounds = (max(self.profile.cohorts), self.profile.tail_tokens) if self.profile.speculative else (0, 0)
        self.state = DeviceState(spec, pages, cohorts, kv_dtype, self.device, *rounds, snapshots=snapshots,
                                 record_sets=self.profile.record_sets)
        self.weights = weights
        self.exe = Executable(spec, self.target, weights, self.state, self.kernels, self.profile, self.device)
        self.exe.prepare()                  # every kernel and all memory of the profile, once, up front
        super().__init__(cohorts, pages, rt.page_size, ctx)          # pages round up, the limit not

    def capture_profile(self) -> None:
        """Every bucket of the profile bound and captured now (start-up), so that no request waits for a
        capture (the kernels are built by `prepare`)."""
        if self.use_graphs:
            for shape in self.profile.shapes():
                self.bucket(*shape)

    def _reset_slot(self, slot: int) -> None:
        self.state.reset_slot(slot)

    # ------------------------------------------------------------ entry points
    def bucket(self, entry: str, batch: int, tokens: int):
        b = self.exe.bucket(entry, batch, tokens)
        if self.use_graphs and b.graph is None:
            self.exe.capture(b)
        return b

    def run(self, entry: str, seqs: list[Sequence], tokens: list[list[int]], images: torch.Tensor | None = None):
        """One call for B rows of T tokens each → (logits, hidden) copies; advances the lengths. `images`: the
        image tokens of the placeholders in a prompt piece (B = 1)."""
        B, T = len(seqs), len(tokens[0])
        bucket = self.bucket(entry, B, T)
        starts = [s.length for s in seqs]
        for s, p in zip(seqs, starts):
            self.reserve(s, p + T)
        bucket.inputs.set(tokens, starts, [s.table.pages for s in seqs], [s.slot for s in seqs],
                          [s.positions for s in seqs])
        bucket.inputs.set_images(images)
        bucket.run(self.use_graphs)
        for s, p in zip(seqs, starts):
            s.table.length = p + T
        return bucket.logits.clone(), bucket.hidden.clone()

    # ------------------------------------------------------------ speculative rounds (ninfer_gen.speculative)
    @property
    def drafts(self) -> tuple[int, ...]:
        """The draft lengths this backend's profile has round buckets for."""
        return (self.profile.draft,) if self.profile.speculative else ()

    def verify(self, seq: Sequence, tokens: list[int]):
        """The target over T = K+1 tokens at the sequence's length in record mode → (logits [T, V], hidden
        [T, H]); the GDN state is not written and the length does not move until `commit`."""
        T, start = len(tokens), seq.length
        self._verified_tokens(seq, T)
        bucket = self.bucket("verify", 1, T)
        bucket.inputs.set([tokens], [start], [seq.table.pages], [seq.slot], [seq.positions])
        bucket.run(self.use_graphs)
        return bucket.logits.clone(), bucket.hidden.clone()

    def commit(self, seq: Sequence, m: int) -> None:
        """Fold the first m tokens the last verify logged into the state (ReplaySSM); the length moves by m."""
        T = self._committing(seq, m)
        bucket = self.bucket("commit", 1, T)
        bucket.inputs.set([[0] * T], [seq.length], [[]], [seq.slot])          # a fold reads slots and counts only
        bucket.inputs.set_commit([m])
        bucket.run(self.use_graphs)
        seq.table.length += m

    def mtp(self, seq: Sequence, hidden: torch.Tensor, next_ids: list[int], start: int):
        """The MTP head over slots start..start+n−1 (hidden rows, the token after each) → (logits of the
        last slot [1, V], its normed output [1, H]): `mtp_many` of one sequence."""
        return self.mtp_many([seq], [hidden], [next_ids], [start])[0]

    def mtp_many(self, seqs: list[Sequence], hiddens: list[torch.Tensor], next_ids: list[list[int]],
                 starts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The MTP head over several sequences' slots (each: hidden rows, the token after each, the first slot)
        → per sequence (logits of its last slot [1, V] over the full vocabulary, its normed output [1, H]). Up
        to K+1 slots run as one padded piece (the padded slots' KV is rewritten before anything reads it); a
        prompt's pass is cut like the prompt; the sequences' pieces of one shape run together (`_together`)."""
        tail, queues = self.profile.tail_tokens, []
        for row, (hidden, ids, start) in enumerate(zip(hiddens, next_ids, starts)):
            n = len(ids)
            sizes = [(tail, n)] if n <= tail else [(t, t) for _, t in self.profile.prompt_pieces(n)]
            queue, at = deque(), 0
            for t, used in sizes:
                queue.append(_Piece(row, "mtp", t, ids[at:at + used] + [ids[at + used - 1]] * (t - used),
                                    start + at, used, hidden[at:at + used]))
                at += used
            queues.append(queue)
        out: list = [None] * len(seqs)
        for bucket, pieces in self._together(queues):
            batch, t = bucket.inputs.batch, bucket.inputs.tokens
            rows = [seqs[p.row] for p in pieces]
            bucket.inputs.set([p.tokens for p in pieces], [p.start for p in pieces], [s.table.pages for s in rows],
                              [s.slot for s in rows], [s.positions for s in rows])
            inputs = bucket.inputs.tensors["hidden"].view(batch, t, -1)
            for r, p in enumerate(pieces):
                inputs[r, :p.used].copy_(p.hidden)
                inputs[r, p.used:].copy_(p.hidden[-1:].expand(t - p.used, -1))
            bucket.run(self.use_graphs)
            logits = bucket.logits.reshape(batch, -1, bucket.logits.shape[-1])
            normed = bucket.hidden.reshape(batch, t, -1)
            for r, p in enumerate(pieces):
                if not queues[p.row]:                    # the sequence's last piece: its last slot drafts
                    last = p.used - 1 if logits.shape[1] > 1 else 0
                    out[p.row] = (self._full_vocab(logits[r, last:last + 1]), normed[r, p.used - 1:p.used].clone())
        return out

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """A draft head's logits over the full vocabulary (−inf off the draft ids); a copy."""
        if self.draft_ids is None:
            return logits.clone()
        full = torch.full((logits.shape[0], self.spec.model.vocab_size), float("-inf"), device=logits.device)
        full[:, self.weights.tensors[DRAFT_IDS].long()] = logits
        return full

    def prefill(self, seq: Sequence, ids: list[int], chunk: int | None = None, all_logits: bool = False,
                all_hidden: bool = False, images: torch.Tensor | None = None):
        """Chunked prefill from the sequence's current length → (logits, hidden): the last row only,
        or every row with `all_logits` (tests; [n, vocab] fp32); `all_hidden` keeps every row's hidden
        (the MTP's pass over the prompt). `images`: the image tokens of the placeholders in `ids` (the
        sequence's `positions` set), each piece given its own. `prefill_many` of one sequence."""
        return self.prefill_many([seq], [ids], chunk=chunk, all_logits=all_logits, all_hidden=[all_hidden],
                                 images=[images])[0]

    def prefill_many(self, seqs: list[Sequence], ids: list[list[int]], *, chunk: int | None = None,
                     all_logits: bool = False, all_hidden: list[bool] | None = None,
                     images: list[torch.Tensor | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several sequences' prompt chunks, each from the sequence's length → per sequence (logits, hidden) as
        `prefill` gives them (`all_hidden[i]`: every row's hidden of sequence i). Each chunk is cut by
        `Profile.prompt_pieces`; the sequences' pieces of one shape run together (`_together`: a burst of short
        prompts runs its tail steps as (B, 4) and (B, 1) steps, not B of each). Pages for every chunk are
        reserved before any work. A piece with image tokens runs alone."""
        if all_logits and not self.profile.all_logits:
            raise ValueError("this GPU backend keeps the last row's logits of a prefill chunk; make it with "
                             "all_logits=True for every row's")
        for seq, chunk_ids in zip(seqs, ids):
            self.reserve(seq, seq.length + len(chunk_ids))      # fail before any work when one cannot fit
        token = self.spec.vision.image_token_id if self.spec.vision is not None else None
        queues = []
        for row, (seq, chunk_ids) in enumerate(zip(seqs, ids)):
            queue, at, used, start = deque(), 0, 0, seq.length
            rows_of = images[row] if images is not None else None
            for entry, t in self.profile.prompt_pieces(len(chunk_ids), chunk):
                piece, rows = chunk_ids[at:at + t], None
                if rows_of is not None:
                    n = sum(x == token for x in piece)
                    rows, used = (rows_of[used:used + n] if n else None), used + n
                queue.append(_Piece(row, entry, t, piece, start + at, t, images=rows))
                at += t
            queues.append(queue)
        keep = [all_logits or bool(all_hidden and all_hidden[i]) for i in range(len(seqs))]
        logits, hidden = [[] for _ in seqs], [[] for _ in seqs]
        for bucket, pieces in self._together(queues):
            batch, t = bucket.inputs.batch, bucket.inputs.tokens
            rows = [seqs[p.row] for p in pieces]
            bucket.inputs.set([p.tokens for p in pieces], [p.start for p in pieces], [s.table.pages for s in rows],
                              [s.slot for s in rows], [s.positions for s in rows])
            bucket.inputs.set_images(pieces[0].images)             # a piece with images runs alone
            bucket.run(self.use_graphs)
            lg = bucket.logits.reshape(batch, -1, bucket.logits.shape[-1])
            hd = bucket.hidden.reshape(batch, t, -1)
            for r, (p, seq) in enumerate(zip(pieces, rows)):
                seq.table.length = p.start + t
                logits[p.row].append(lg[r].clone() if all_logits else lg[r, -1:].clone())
                hidden[p.row].append(hd[r].clone() if keep[p.row] else hd[r, -1:].clone())
        return [(torch.cat(lg) if all_logits else lg[-1], torch.cat(hd) if keep[i] else hd[-1])
                for i, (lg, hd) in enumerate(zip(logits, hidden))]

    def _together(self, queues: list[deque]):
        """Runs the rows' pieces, each row's in its order: each pass takes every row's next piece, and the pieces
        of one (entry, tokens) run as one call of the smallest bucket of the profile that holds them (several
        calls when they are more than its largest); a shape with B = 1 buckets only (a prefill piece) and a piece
        with images run one by one. Yields (the bound bucket, its pieces in row order); the caller sets the
        inputs and runs it. A row's bits do not depend on the others (the kernels are batch-invariant)."""
        sizes: dict[tuple[str, int], list[int]] = {}
        for entry, b, t in self.profile.shapes():
            sizes.setdefault((entry, t), []).append(b)
        while any(queues):
            heads: dict[tuple[str, int], list[_Piece]] = {}
            for queue in queues:
                if queue:
                    piece = queue.popleft()
                    key = (piece.entry, piece.t) if piece.images is None else (piece.entry, piece.t, piece.row)
                    heads.setdefault(key, []).append(piece)
            for (entry, t, *_), pieces in heads.items():
                built = sorted(sizes.get((entry, t), [1]))
                most = built[-1] if pieces[0].images is None else 1
                for at in range(0, len(pieces), most):
                    group = pieces[at:at + most]
                    batch = next(b for b in built if b >= len(group))
                    yield self.bucket(entry, batch, t), group

    def encode(self, pixels, grids) -> torch.Tensor:
        """The vision tower over one request's images → image tokens [Σ tokens, hidden] bf16 on the device."""
        if self.encoder is None:
            raise ValueError("this GPU backend was loaded without the vision tower: it takes text only")
        return self.encoder(pixels, grids)

    # ------------------------------------------------------------ prefix checkpoints (allocators.prefix)
    def _gdn_tensors(self) -> list[torch.Tensor]:
        return [*self.state.conv.values(), *self.state.ssm.values()]

    @property
    def state_bytes(self) -> int:
        """Bytes of one slot's GDN state and conv history, every GDN layer: one saved state (device memory)."""
        return sum(t[0].numel() * t.element_size() for t in self._gdn_tensors())

    def save_state(self, seq: Sequence) -> list[torch.Tensor]:
        return [t[seq.slot].clone() for t in self._gdn_tensors()]

    def restore_state(self, handle: list[torch.Tensor], seq: Sequence) -> None:
        for t, saved in zip(self._gdn_tensors(), handle):
            t[seq.slot].copy_(saved)

    def free_state(self, handle: list[torch.Tensor]) -> None:
        handle.clear()                 # the copies are the handle's own: they go back to torch's allocator

    def copy_page(self, src: int, dst: int) -> None:
        """KV page `src` to `dst` in every attention layer and the MTP layer: codes and scales."""
        for layer in self.state.kv.values():
            for t in layer.values():
                t[dst].copy_(t[src])
