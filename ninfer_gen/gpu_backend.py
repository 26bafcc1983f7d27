"""gpu_backend: the GPU runtime behind `load(backend="gpu")`, `ninfer-gen run` and `ninfer-gen bench`.

Sets up, in order: the memory plan under one VRAM budget (enforced on torch's allocator too), the
weights on the device, the state pool (KV pages + GDN slots), and the `Executable`; then serves the
same calls as the reference backend — sequences with block tables and state slots, chunked prefill
and decode steps — each bucket replayed as a CUDA graph captured on first use.

A prompt of L tokens runs as prefill chunks of `chunk` tokens, one smaller prefill bucket for the
remainder rounded down to 16 (the prefill attention tiles 16 queries), then 4- and 1-token steps.
"""
from __future__ import annotations

import math
import os

import torch

from compiler.spec import ModelSpec
from compiler.targets import Target, resolve

from .cuda_module import KernelCache, primary_context
from .device_weights import DeviceWeights
from .device_state import DeviceState
from .executable import Executable, ExecutableError
from .memory_plan import GiB, MemoryPlan, plan_memory
from .sequences import Sequence, SequencePool


def prompt_pieces(n: int, chunk: int, step4: bool = True) -> list[tuple[str, int]]:
    """How a prompt of n tokens is cut, in order: (entry, tokens) — full chunks, one prefill of the
    remainder rounded down to 16, then 4-token steps (when that bucket exists) and 1-token steps."""
    out = [("prefill", chunk)] * (n // chunk)
    r = n % chunk
    if r >= 16:
        out.append(("prefill", r - r % 16))
        r %= 16
    if step4:
        out += [("step", 4)] * (r // 4)
        r %= 4
    return out + [("step", 1)] * r


def device_target(device: torch.device) -> Target:
    """The target card entry for the GPU we run on (by compute capability)."""
    major, minor = torch.cuda.get_device_capability(device)
    return resolve(arch=f"sm_{major}{minor}")


class GpuBackend(SequencePool):
    def __init__(self, spec: ModelSpec, weights: DeviceWeights, *, max_context: int | None = None,
                 cohorts: int = 1, kv_dtype: str | None = None, vram_budget: int = 24 * GiB,
                 use_graphs: bool = True, build_root=None, jobs: int | None = None, device="cuda",
                 memory: MemoryPlan | None = None, progress: bool = False):
        self.spec, self.device, self.use_graphs = spec, torch.device(device), use_graphs
        rt = spec.runtime
        kv_dtype = kv_dtype or rt.kv_dtype
        ctx = max_context or rt.max_context
        self.memory = memory or plan_memory(spec, cohorts, ctx, vram_budget, kv_dtype=kv_dtype)
        per_seq = math.ceil(ctx / rt.page_size)
        pages = min(self.memory.kv_pages, cohorts * per_seq)
        primary_context(self.device.index)
        self.target = device_target(self.device)
        self.state = DeviceState(spec, pages, cohorts, kv_dtype, self.device)
        self.weights = weights
        self.kernels = KernelCache(build_root or os.environ.get("NINFER_BUILD_DIR"), jobs=jobs, progress=progress)
        concurrency = int(os.environ.get("NINFER_CONCURRENCY", "4"))
        self.exe = Executable(spec, self.target, weights, self.state, self.kernels, per_seq, self.device,
                              concurrency=max(1, concurrency))
        super().__init__(cohorts, pages, rt.page_size, per_seq * rt.page_size)
        self._step4: bool | None = None
        self._greedy_out: torch.Tensor | None = None       # greedy(): tokens chosen on the device
        self._greedy_index: torch.Tensor | None = None
        self._advance: torch.cuda.CUDAGraph | None = None

    def _reset_slot(self, slot: int) -> None:
        self.state.reset_slot(slot)

    # ------------------------------------------------------------ entry points
    def bucket(self, entry: str, batch: int, tokens: int, all_logits: bool = False):
        b = self.exe.bucket(entry, batch, tokens, all_logits)
        if self.use_graphs and b.graph is None:
            self.exe.capture(b)
        return b

    def run(self, entry: str, seqs: list[Sequence], tokens: list[list[int]], all_logits: bool = False):
        """One call for B rows of T tokens each → (logits, hidden) copies; advances the lengths."""
        B, T = len(seqs), len(tokens[0])
        bucket = self.bucket(entry, B, T, all_logits)
        starts = [s.length for s in seqs]
        for s, p in zip(seqs, starts):
            self._reserve(s, p + T)
        bucket.inputs.set(tokens, starts, [s.table.pages for s in seqs], [s.slot for s in seqs])
        bucket.run(self.use_graphs)
        for s, p in zip(seqs, starts):
            s.table.length = p + T
        return bucket.logits.clone(), bucket.hidden.clone()

    def greedy(self, seq: Sequence, token: int, n: int) -> list[int]:
        """n greedy decode steps for one sequence with no host round trip between them: feeds `token`
        (the last one chosen) and returns the n tokens chosen after it; the sequence advances by n.
        Each step replays the (1, 1) step graph and then a captured 'advance' graph that takes the
        argmax of the logits as the next step's input token and moves the positions on by one, all
        in device buffers; the host queues the n pairs and reads the tokens back once. The pages for
        all n tokens are reserved first. Tokens equal those of n host-driven steps with argmax."""
        if n <= 0:
            return []
        bucket = self.bucket("step", 1, 1)
        start = seq.length
        self._reserve(seq, start + n)
        bucket.inputs.set([[token]], [start], [seq.table.pages], [seq.slot])
        advance = self._advance_graph(bucket, n)
        self._greedy_index.zero_()
        for _ in range(n):
            bucket.run(self.use_graphs)
            advance.replay()
        seq.table.length = start + n
        return self._greedy_out[:n].tolist()

    def _advance_graph(self, bucket, n: int) -> torch.cuda.CUDAGraph:
        """The captured 'advance' of `greedy` for the (1, 1) step bucket: next token = argmax of the
        logits, appended to the output buffer; row_pos, pos and seq_lens + 1."""
        if self._greedy_out is None or self._greedy_out.numel() < n:
            size = max(n, 1024)
            self._greedy_out = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._greedy_index = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._advance = None
        if self._advance is None:
            views = bucket.inputs.views

            def advance():                      # only tensors that outlive the graph (or made inside it)
                nxt = torch.argmax(bucket.logits[-1]).reshape(1)
                views["tokens"].copy_(nxt)
                for name in ("row_pos", "pos", "seq_lens"):
                    views[name].add_(1)
                self._greedy_out.index_copy_(0, self._greedy_index, nxt)
                self._greedy_index.add_(1)

            side = torch.cuda.Stream(self.device)          # torch's recipe: warm up off the capture stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            saved = bucket.inputs.device.clone()
            with torch.cuda.stream(side):
                advance()
            torch.cuda.current_stream(self.device).wait_stream(side)
            bucket.inputs.device.copy_(saved)
            self._greedy_index.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                advance()
            self._advance = graph
        return self._advance

    def pieces(self, n: int, chunk: int) -> list[tuple[str, int]]:
        if self._step4 is None:
            try:
                self.exe.bucket("step", 1, 4)
                self._step4 = True
            except (ValueError, ExecutableError):        # e.g. attention tiles too big for 4 queries per row
                self._step4 = False
        return prompt_pieces(n, chunk, self._step4)

    def prefill(self, seq: Sequence, ids: list[int], chunk: int | None = None, all_logits: bool = False):
        """Chunked prefill from the sequence's current length → (logits, hidden): the last row only,
        or every row with `all_logits` (tests; [n, vocab] fp32)."""
        chunk = chunk or self.spec.runtime.prefill_chunk
        if chunk % 16:
            raise ValueError(f"prefill chunk {chunk} is not a multiple of 16")
        self._reserve(seq, seq.length + len(ids))       # fail before any work when it cannot fit
        logits, hidden, at = [], [], 0
        for entry, t in self.pieces(len(ids), chunk):
            lg, hd = self.run(entry, [seq], [ids[at:at + t]], all_logits)
            at += t
            logits.append(lg if all_logits else lg[-1:])
            hidden.append(hd if all_logits else hd[-1:])
        if not all_logits:
            return logits[-1], hidden[-1]
        return torch.cat(logits), torch.cat(hidden)
