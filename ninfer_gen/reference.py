"""reference: the reference backend — traced graphs run by the reference interpreter over real
paged KV and GDN state slots (torch, CPU or GPU, fp32 or bf16).

Owns sequences (a state slot + KV pages), chunked prefill, decode steps, the MTP entry and the
speculative round's verify (record mode) and commit (fold) entries, with ReplaySSM records per verify
shape, and the prefix cache's copies (allocators.prefix's protocol: save, restore and free a GDN state,
copy a KV page). It is the numerical oracle of the GPU backend and the backend of machines with no GPU.
"""
from __future__ import annotations

import math

import torch

from compiler.interpret import Program
from compiler.reference_ops import torch_dtype
from compiler.spec import ModelSpec
from compiler.trace import StatePools, record_avals, state_avals, trace

from ninfer_gen.allocators.sequences import Sequence, SequencePool

ACT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "f32": "f32", "bf16": "bf16"}
# Calls of fewer tokens per sequence than this (decode steps, verify, drafting, folds) run on one intra-op
# thread on the CPU; prompt chunks on all of torch's threads. A decode call is ~60 ops of a few µs each,
# and with 2 threads each is a parallel region whose wake-up costs more than the op: the small model on the
# 2-core box decoded at 57 tok/s on 2 sleeping (OMP_WAIT_POLICY=PASSIVE) threads, 93 on one thread, 128 on
# 2 spinning ones — which fall to 25 each when two processes share the cores. The count depends only on
# the tokens per row, never on the rows, so a lane's numbers stay the same in any cohort.
ONE_THREAD_BELOW = 16
IMAGE_PROGRAMS = 32     # programs of shapes only images make (chunks with image tokens, encoder calls) kept at once


class ReferenceBackend(SequencePool):
    def __init__(self, spec: ModelSpec, weights: dict, device: str = "cpu", dtype: str = "float32",
                 kv_dtype: str | None = None, max_sequences: int = 2, max_context: int | None = None,
                 bf16_matmul_inputs: bool = False):
        """`bf16_matmul_inputs` (precision studies): round only what enters a linear to bf16."""
        if dtype not in ACT_DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        self.spec, self.device, self.act = spec, torch.device(device), ACT_DTYPES[dtype]
        rt = spec.runtime
        ctx = max_context or rt.max_context
        per_seq = math.ceil(ctx / rt.page_size)
        self.pools = StatePools(num_pages=per_seq * max_sequences, num_slots=max_sequences,
                                pages_per_seq=per_seq, page_size=rt.page_size, kv_dtype=kv_dtype or self.act)
        super().__init__(max_sequences, self.pools.num_pages, rt.page_size, ctx)   # pages round up, the limit not
        self.weights = {k: self._place(k, v) for k, v in weights.items()}
        self.state = {name: torch.zeros(shape, dtype=torch_dtype(dt), device=self.device)
                      for name, (shape, dt) in state_avals(spec, self.pools).items()}
        self._programs: dict = {}                              # (entry, B, T) → the traced graph, prepared
        self._records: dict[tuple[int, int], dict] = {}        # (B, T) of a verify → its ReplaySSM records
        self.bf16_matmul_inputs = bf16_matmul_inputs
        self.profile = None         # (seconds, calls) dicts: every equation timed (lab.reference_speed)

    def _place(self, name: str, w: torch.Tensor) -> torch.Tensor:
        keep_fp32 = self.act == "f32" or name.endswith(("A_log", "dt_bias"))
        return w.to(self.device, torch.float32 if keep_fp32 else torch.bfloat16)

    def graph(self, entry: str, batch: int, tokens: int):
        return self.program(entry, batch, tokens).graph

    def program(self, entry: str, batch: int, tokens: int, mrope: bool = False, image_tokens: int = 0) -> Program:
        """The entry's graph at this shape, traced and prepared on first use (`mrope`, `image_tokens`: the
        graph of a sequence with images, compiler.trace)."""
        key = (entry, batch, tokens, mrope, image_tokens)
        return self._program(key, lambda: trace(self.spec, entry, batch, tokens, self.pools, self.act, mrope=mrope,
                                                image_tokens=image_tokens))

    def _program(self, key: tuple, make) -> Program:
        """A prepared program by its shape key, made on first use. The shapes only images make (a chunk's image
        token count, an encoder call's patches) are open-ended: the most recent IMAGE_PROGRAMS of them are kept."""
        imaged = key[0] == "vision" or bool(key[-1])
        if key in self._programs:
            if imaged:                                             # most recently used last
                self._programs[key] = self._programs.pop(key)
            return self._programs[key]
        program = self._programs[key] = Program(make(), bf16_matmul_inputs=self.bf16_matmul_inputs)
        imaged = [k for k in self._programs if k[0] == "vision" or k[-1]]
        for old in imaged[:max(0, len(imaged) - IMAGE_PROGRAMS)]:
            del self._programs[old]
        return program

    def _run(self, entry: str, batch: int, tokens: int, inputs: dict, state: dict) -> dict:
        images = inputs.get("images")
        program = self.program(entry, batch, tokens, "mrope" in inputs, images.shape[0] if images is not None else 0)
        threads = torch.get_num_threads()
        if tokens >= ONE_THREAD_BELOW or threads == 1 or self.device.type != "cpu":
            return program.run(inputs, self.weights, state, self.profile)
        torch.set_num_threads(1)
        try:
            return program.run(inputs, self.weights, state, self.profile)
        finally:
            torch.set_num_threads(threads)

    # ------------------------------------------------------------ sequences
    def _reset_slot(self, slot: int) -> None:
        for name, t in self.state.items():
            if name.startswith("gdn."):
                t[slot].zero_()

    def _block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        rows = [s.table.pages + [0] * (self.pools.pages_per_seq - len(s.table.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _i32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _positions(self, inputs: dict, seqs: list[Sequence], starts: list[int], T: int) -> dict:
        """`inputs` with the call's 3-axis RoPE positions when a sequence has images (compiler.multimodal): its
        own, and three equal axes for the others (the same rotation as 1-D RoPE, bit for bit)."""
        if all(s.positions is None for s in seqs):
            return inputs
        rows = [s.positions.rows(p, T) if s.positions is not None
                else torch.arange(p, p + T, dtype=torch.int32)[:, None].expand(-1, 3) for s, p in zip(seqs, starts)]
        return inputs | {"mrope": torch.cat(rows).to(self.device)}

    def encode(self, pixels, grids) -> torch.Tensor:
        """The vision encoder over one request's images (ninfer_gen.vision.preprocess.Processed's pixels and
        grids): image tokens [Σ tokens, hidden] in the activation dtype, by the traced encoder."""
        from compiler.trace import trace_vision
        from compiler.vision_model import encoder_inputs

        x = torch.as_tensor(pixels).to(self.device, torch_dtype(self.act))
        program = self._program(("vision", x.shape[0], len(grids)),
                                lambda: trace_vision(self.spec, x.shape[0], len(grids), self.act))
        coords, cu_seqlens = encoder_inputs(grids, self.spec.vision.spatial_merge_size)
        inputs = {"pixels": x, "coords": coords.to(self.device), "cu_seqlens": cu_seqlens.to(self.device)}
        return program.run(inputs, self.weights, {}, self.profile)["embeds"]

    # ------------------------------------------------------------ entry points
    def run(self, entry: str, seqs: list[Sequence], tokens: list[list[int]], hidden=None, starts=None, images=None):
        """One call of an entry point for B rows of T tokens each; advances main-model lengths. `images`
        (prefill): the image tokens of the chunk's placeholders, in order."""
        B, T = len(seqs), len(tokens[0])
        starts = starts if starts is not None else [s.length for s in seqs]
        for s, p in zip(seqs, starts):
            self.reserve(s, p + T)
        inputs = {"tokens": self._i32(tokens), "pos": self._i32(starts), "block_table": self._block_table(seqs)}
        inputs = self._positions(inputs, seqs, starts, T)
        if images is not None and images.shape[0]:
            inputs["images"] = images
        if entry == "mtp":
            inputs["hidden"] = hidden
        else:
            inputs["slots"] = self._i32([s.slot for s in seqs])
        out = self._run(entry, B, T, inputs, self.state)
        if entry != "mtp":
            for s, p in zip(seqs, starts):
                s.table.length = p + T
        return out["logits"], out["hidden"]

    def records(self, batch: int, tokens: int) -> dict:
        if (batch, tokens) not in self._records:
            self._records[batch, tokens] = {
                name: torch.zeros(shape, dtype=torch_dtype(dt), device=self.device)
                for name, (shape, dt) in record_avals(self.spec, batch, tokens, self.act).items()}
        return self._records[batch, tokens]

    def verify(self, seq: Sequence, tokens: list[int]):
        """The target over T tokens at the sequence's length in record mode: (logits [T, V], hidden [T, H]);
        the GDN state is not written and the length does not move until `commit`."""
        start, T = seq.length, len(tokens)
        self._verified_tokens(seq, T)
        inputs = {"tokens": self._i32([tokens]), "pos": self._i32([start]), "block_table": self._block_table([seq]),
                  "slots": self._i32([seq.slot])}
        out = self._run("verify", 1, T, self._positions(inputs, [seq], [start], T), self.state | self.records(1, T))
        return out["logits"], out["hidden"]

    def commit(self, seq: Sequence, m: int) -> None:
        """Fold the first m tokens the last verify logged into the state; the length moves by m."""
        T = self._committing(seq, m)
        self._run("commit", 1, T, {"slots": self._i32([seq.slot]), "commit": self._i32([m])},
                  self.state | self.records(1, T))
        seq.table.length += m

    def prefill(self, seq: Sequence, ids: list[int], chunk: int | None = None, all_logits: bool = True,
                all_hidden: bool = True, images: torch.Tensor | None = None):
        """Chunked prefill from the sequence's current length; returns logits [T, V] and hidden [T, H]
        (always every row; `all_logits` and `all_hidden` are accepted for the GPU backend's interface).
        `images` (a sequence with images, `seq.positions` set): the image tokens of the placeholders in `ids`."""
        chunk = chunk or self.spec.runtime.prefill_chunk
        self.reserve(seq, seq.length + len(ids))  # fail before any work when it cannot fit
        logits, hidden = [], []
        used = 0
        for i in range(0, len(ids), chunk):
            part, rows = ids[i:i + chunk], None
            if images is not None:
                n = sum(t == self.spec.vision.image_token_id for t in part)
                rows, used = images[used:used + n], used + n
            lg, hd = self.run("prefill", [seq], [part], images=rows)
            logits.append(lg)
            hidden.append(hd)
        return torch.cat(logits), torch.cat(hidden)

    def mtp(self, seq: Sequence, hidden: torch.Tensor, next_ids: list[int], start: int, chunk: int | None = None):
        """MTP head over slots start.. (teacher-forced); fills the MTP layer's KV cache."""
        chunk = chunk or self.spec.runtime.prefill_chunk
        logits, normed = [], []
        for i in range(0, len(next_ids), chunk):
            lg, hd = self.run("mtp", [seq], [next_ids[i:i + chunk]], hidden[i:i + chunk], starts=[start + i])
            logits.append(lg)
            normed.append(hd)
        return torch.cat(logits), torch.cat(normed)

    # ------------------------------------------------------------ prefix checkpoints (allocators.prefix)
    @property
    def state_bytes(self) -> int:
        """Bytes of one slot's GDN state and conv history, every GDN layer: one saved state."""
        return sum(t[0].numel() * t.element_size() for name, t in self.state.items() if name.startswith("gdn."))

    def save_state(self, seq: Sequence) -> dict[str, torch.Tensor]:
        return {name: t[seq.slot].clone() for name, t in self.state.items() if name.startswith("gdn.")}

    def restore_state(self, handle: dict[str, torch.Tensor], seq: Sequence) -> None:
        for name, saved in handle.items():
            self.state[name][seq.slot].copy_(saved)

    def free_state(self, handle: dict[str, torch.Tensor]) -> None:
        handle.clear()                 # the copies are the handle's own: they go with it

    def copy_page(self, src: int, dst: int) -> None:
        for name, t in self.state.items():
            if name.startswith("kv."):
                t[dst].copy_(t[src])
