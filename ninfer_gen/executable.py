"""executable: lowered Plans bound to device memory, run eagerly or replayed as one CUDA graph per bucket.

Owns the argument binding of every kernel call (to weights, the `device_state` buffers and the bucket's
`StepInputs`), one activation arena shared by every bucket (buckets run one after another on one
stream), workspaces for split attention and split-K GEMV partials (one lane per call that runs
concurrently), and the graph branches of independent GEMVs. Kernel arguments are packed once per call
(`cuda_module.Launcher`); a bucket's graph is captured once and replayed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from compiler.buckets import plan_bucket
from compiler.ir import Graph, Var
from compiler.kernels import MATMUL_FAMILIES, module_of
from compiler.kernels.qk_rope_kv import inv_freq
from compiler.lower import DTYPE_BYTES, VIEWS, Plan
from compiler.spec import ModelSpec
from compiler.targets import Target

from .cuda_module import KernelCache
from .device_state import DeviceState, ExecutableError, StepInputs
from .device_weights import DeviceWeights, fused_gate_up

TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32, "i8": torch.int8}
ZEROED_WORKSPACE = ("tickets", "counters")    # workspace the kernels expect zero and leave zero


# ---------------------------------------------------------------------------------------------- binding
@dataclass
class _Values:
    """Where each graph value lives: (kind, name or arena offset)."""
    graph: Graph
    plan: Plan
    base: dict[int, tuple[int, int]] = field(default_factory=dict)   # uid → (base uid, byte offset)
    producer: dict[int, object] = field(default_factory=dict)
    names: dict[int, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self):
        g = self.graph
        self.names = {v.uid: ("in", k) for k, v in g.inputs.items()}
        self.names.update({v.uid: ("w", k) for k, v in g.weights.items()})
        self.names.update({v.uid: ("s", k) for k, v in g.state.items()})
        for e in g.eqns:
            for o in e.outputs:
                self.producer[o.uid] = e
            if e.prim in VIEWS:
                src = e.inputs[0]
                b, off = self.base.get(src.uid, (src.uid, 0))
                if e.prim == "slice" and e.params["axis"] == 0:
                    dtype = self.plan.dtypes.get(f"a:{b}", src.dtype)
                    off += e.params["start"] * math.prod(src.shape[1:]) * DTYPE_BYTES[dtype]
                self.base[e.outputs[0].uid] = (b, off)

    def resolve(self, v: Var) -> tuple[str, object]:
        b, off = self.base.get(v.uid, (v.uid, 0))
        if b in self.names:
            if off:
                raise ExecutableError(f"offset view of a non-arena value {self.names[b]}")
            return self.names[b]
        return ("a", self.plan.arena[f"a:{b}"][0] + off)

    def through_views(self, v: Var):
        """The equation producing v's base value (skipping reshapes and slices)."""
        b, _ = self.base.get(v.uid, (v.uid, 0))
        return self.producer.get(b)


def concurrent_groups(plan: Plan, has_workspace=lambda key: False, width: int = 4) -> list[list[int]]:
    """The plan's calls in order, cut into groups that may run at once: runs of consecutive GEMVs (a
    layer's input projections all read the same normed activations) where no call reads or writes
    bytes another writes, and at most `width` per group. Every other call is a group of one. The
    executable gives each call of a group its own workspace lane; `has_workspace` marks calls that
    must not share one (for a caller with a single workspace)."""
    def spans(names):
        return [plan.arena[n] for n in names if n in plan.arena]

    def overlap(xs, ys):
        return any(a < b + m and b < a + n for a, n in xs for b, m in ys)

    def independent(c, d) -> bool:
        if set(c.inputs) & set(d.outputs) or set(d.inputs) & set(c.outputs) or set(c.outputs) & set(d.outputs):
            return False
        if overlap(spans(c.outputs), spans(d.inputs) + spans(d.outputs)) or overlap(spans(d.outputs), spans(c.inputs)):
            return False
        return not (has_workspace(c.key) and has_workspace(d.key))

    groups: list[list[int]] = []
    for i, c in enumerate(plan.calls):
        cur = groups[-1] if groups else None
        if (cur and c.key.family == "gemv" and len(cur) < width and all(plan.calls[j].key.family == "gemv"
                                                                         for j in cur)
                and all(independent(c, plan.calls[j]) for j in cur)):
            cur.append(i)
        else:
            groups.append([i])
    return groups


class Bucket:
    """One (entry, B, T) shape: its plan, its input buffers, its packed launchers, its CUDA graph.
    Groups of independent calls run on side streams (forked from and joined back into the current
    stream with events), so a captured graph has parallel branches there."""

    def __init__(self, shape: tuple[str, int, int], plan: Plan, inputs: StepInputs):
        self.shape, self.plan, self.inputs = shape, plan, inputs
        self.launchers: list = []
        self.groups: list[list[int]] = []
        self.side_streams: list = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def run(self, use_graph: bool = True) -> None:
        if use_graph and self.graph is not None:
            self.graph.replay()
            return
        main = torch.cuda.current_stream()
        for group in self.groups or [[i] for i in range(len(self.launchers))]:
            if len(group) == 1 or not self.side_streams:
                for i in group:
                    self.launchers[i].launch()
                continue
            fork = torch.cuda.Event()
            fork.record(main)
            sides = self.side_streams[:len(group) - 1]
            for side, i in zip(sides, group[1:]):
                side.wait_event(fork)
                self.launchers[i].launch(side.cuda_stream)
            self.launchers[group[0]].launch(main.cuda_stream)
            for side in sides:
                join = torch.cuda.Event()
                join.record(side)
                main.wait_event(join)


class Executable:
    """Plans for one spec and target bound to one weight set, one state pool and one arena."""

    def __init__(self, spec: ModelSpec, target: Target, weights: DeviceWeights, state: DeviceState,
                 kernels: KernelCache, max_pages: int, device="cuda", concurrency: int = 4):
        """`concurrency`: how many independent GEMVs may run at once (1 = strictly one after another)."""
        self.spec, self.target, self.weights, self.state, self.kernels = spec, target, weights, state, kernels
        self.max_pages, self.device = max_pages, torch.device(device)
        self.rt_spec = replace(spec, runtime=replace(spec.runtime, max_context=max_pages * spec.runtime.page_size,
                                                     kv_dtype=state.kv_dtype))
        at = spec.model.attention
        self.inv_freq = inv_freq(at.rope_theta, at.rotary_dim).to(self.device)
        self.buckets: dict[tuple, Bucket] = {}
        self.arena = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self.workspace = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self.zeroed = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self.concurrency = concurrency if self.device.type == "cuda" else 1
        self.side_streams = [torch.cuda.Stream(self.device) for _ in range(self.concurrency - 1)]

    # ------------------------------------------------------------ buckets
    def bucket(self, entry: str, batch: int, tokens: int, all_logits: bool = False) -> Bucket:
        """The bucket for B rows × T tokens (planned, compiled and bound on first use). Prefill
        buckets over 32 tokens keep the last row's logits unless `all_logits`."""
        all_logits = all_logits and entry == "prefill" and tokens > 32
        shape = (entry, batch, tokens, all_logits)
        if shape not in self.buckets:
            if entry == "mtp":
                raise ExecutableError("the MTP entry is not bound by the GPU executable yet (speculative decoding "
                                      "is a later step); use the reference backend for MTP logits")
            if entry == "prefill" and batch != 1:
                raise ExecutableError("prefill runs one sequence at a time (batch 1)")
            plan = plan_bucket(self.rt_spec, self.target, entry, batch, tokens,
                               last_logits=False if all_logits else None)
            self.kernels.build(plan.keys())
            spills = [n for n in self.kernels.spilled() if n in {k.name for k in plan.keys()}]
            if spills:
                raise ExecutableError(f"kernels spill registers: {', '.join(spills)}")
            inputs = StepInputs(batch, tokens, self.max_pages, self.state.trash_page, self.device)
            bucket = Bucket(shape, plan, inputs)
            self.buckets[shape] = bucket
            self._fit(plan)
            self._bind(bucket)
        return self.buckets[shape]

    def _fit(self, plan: Plan) -> None:
        """Grow the arena / workspaces for a new plan; growing moves them, so every bucket is rebound."""
        ws, zeroed = self._workspace_bytes(plan)
        grow = False
        if plan.arena_bytes > self.arena.numel():
            self.arena, grow = torch.zeros(plan.arena_bytes, dtype=torch.uint8, device=self.device), True
        if ws > self.workspace.numel():
            self.workspace, grow = torch.zeros(ws, dtype=torch.uint8, device=self.device), True
        if zeroed > self.zeroed.numel():
            self.zeroed, grow = torch.zeros(zeroed, dtype=torch.uint8, device=self.device), True
        if grow:
            for b in self.buckets.values():
                if b.plan is not plan:
                    self._bind(b)

    @staticmethod
    def _call_workspace(key) -> dict[str, int]:
        fn = getattr(module_of(key), "workspace", None)
        return fn(key) if fn else {}

    def _workspace_bytes(self, plan: Plan) -> tuple[int, int]:
        """(scratch, zeroed) bytes for all lanes: each of the `concurrency` lanes has its own region."""
        ws = zeroed = 0
        for c in plan.calls:
            need = self._call_workspace(c.key)
            ws = max(ws, sum(_align(v) for k, v in need.items() if k not in ZEROED_WORKSPACE))
            zeroed = max(zeroed, sum(_align(v) for k, v in need.items() if k in ZEROED_WORKSPACE))
        return ws * self.concurrency, zeroed * self.concurrency

    # ------------------------------------------------------------ binding
    def _bind(self, bucket: Bucket) -> None:
        plan, g = bucket.plan, bucket.plan.graph
        values = _Values(g, plan)
        bucket.graph = None
        bucket.launchers = []
        bucket.groups = concurrent_groups(plan, width=self.concurrency) if self.concurrency > 1 else []
        bucket.side_streams = self.side_streams
        lane = {i: n for group in bucket.groups for n, i in enumerate(group)}
        for i, call in enumerate(plan.calls):
            args = self._args(call, g.eqns[call.eqn], values, bucket.inputs, lane.get(i, 0))
            params = module_of(call.key).params(call.key)
            missing = [p.name for p in params if p.name not in args]
            if missing:
                raise ExecutableError(f"{call.key.name}: no binding for parameter(s) {', '.join(missing)}")
            # The first kernel waits for everything before the run (common/ptx.cuh: kernels trigger their
            # successors before their own wait, so without this a run could start on a state slot that the
            # previous run's kernels are still writing).
            bucket.launchers.append(self.kernels.bind(call.key, [args[p.name] for p in params], programmatic=i > 0))
        bucket.logits = self._view(values, g.outputs["logits"], plan)
        bucket.hidden = self._view(values, g.outputs["hidden"], plan)

    def _view(self, values: _Values, v: Var, plan: Plan) -> torch.Tensor:
        kind, where = values.resolve(v)
        b, _ = values.base.get(v.uid, (v.uid, 0))
        dtype = plan.dtypes.get(f"a:{b}", v.dtype)
        size = math.prod(v.shape) * DTYPE_BYTES[dtype]
        return self.arena[where:where + size].view(TORCH[dtype]).view(*v.shape)

    def _ptr(self, values: _Values, v: Var, inputs: StepInputs) -> int:
        kind, where = values.resolve(v)
        if kind == "a":
            return self.arena.data_ptr() + where
        if kind == "in":
            return inputs.ptr(where)
        if kind == "w":
            return self._small_weight(where).data_ptr()
        raise ExecutableError(f"state value {where} is bound by its kernel family, not as a plain pointer")

    def _small_weight(self, name: str) -> torch.Tensor:
        try:
            return self.weights.tensors[name]
        except KeyError:
            raise ExecutableError(f"weight {name!r} is not a plain device tensor") from None

    def _planes(self, name: str) -> dict[str, int]:
        p = self.weights.matrix(name)
        return {"w_lo": p["lo"].data_ptr(), "w_hi": p["hi"].data_ptr() if p["hi"].numel() else 0,
                "w_scales": p["scales"].data_ptr() if p["scales"].numel() else 0}

    def _pages(self, state_name: str) -> dict[str, int]:
        layer = state_name.split(".")[1]
        kv = self.state.kv[layer]
        return {"k_pages": kv["k"].data_ptr(), "v_pages": kv["v"].data_ptr(),
                "k_scales": kv["k_scales"].data_ptr() if "k_scales" in kv else 0,
                "v_scales": kv["v_scales"].data_ptr() if "v_scales" in kv else 0}

    def _workspace_args(self, key, lane: int = 0) -> dict[str, int]:
        """Pointers into lane `lane`'s region of the workspaces (calls that run at once use different lanes)."""
        out = {}
        at, at_zero = lane * (self.workspace.numel() // self.concurrency), lane * (self.zeroed.numel() // self.concurrency)
        for name, size in self._call_workspace(key).items():
            if name in ZEROED_WORKSPACE:
                out[name], at_zero = self.zeroed.data_ptr() + at_zero, at_zero + _align(size)
            else:
                out[name], at = self.workspace.data_ptr() + at, at + _align(size)
        return out

    def _args(self, call, e, values: _Values, inputs: StepInputs, lane: int = 0) -> dict[str, int]:
        fam, key = call.key.family, call.key
        ptr = lambda v: self._ptr(values, v, inputs)                       # noqa: E731
        state = lambda v: values.resolve(v)[1]                             # noqa: E731
        out = ptr(e.outputs[0]) if e.outputs else 0
        args = self._workspace_args(key, lane)
        if fam in MATMUL_FAMILIES:
            scaled = e.prim in ("scaled_linear", "scaled_linear_silu_mul", "scaled_linear_conv")  # xn, ssq, W…
            wname = values.resolve(e.inputs[2 if scaled else 1])[1]
            if e.prim in ("linear_silu_mul", "scaled_linear_silu_mul"):
                wname = fused_gate_up(wname)
            res = ptr(e.inputs[2]) if e.prim in ("linear_residual", "linear_residual_norm") else 0
            args = {"ws": 0, "tickets": 0} | args                         # split-K workspace, when split
            x = args["xp"] if fam == "gemm_wg" else ptr(e.inputs[0])        # gemm_wg: xperm's output
            if e.prim == "linear_residual_norm":                           # → h, xn, ssq
                args |= {"xn": ptr(e.outputs[1]), "ssq_out": ptr(e.outputs[2]), "norm_w": ptr(e.inputs[3])}
            if scaled:
                args["ssq_in"] = ptr(e.inputs[1])
            if e.prim in ("linear_conv", "scaled_linear_conv"):              # …, conv taps, history, slots
                layer = state(e.inputs[-2]).split(".")[1]
                args |= {"conv_w": ptr(e.inputs[-3]), "hist": self.state.conv[layer].data_ptr(),
                         "slots": inputs.ptr("slots")}
            return args | {"y": out, "x": x, "res": res} | self._planes(wname)
        if fam == "xperm":                     # into the workspace the gemm_wg call after it reads
            return args | {"x": ptr(e.inputs[0])}
        if fam == "embed":
            w = self.weights
            return args | {"y": out, "ids": ptr(e.inputs[0]), "table": w.embed_codes.data_ptr(),
                           "scales": 0 if w.embed_scales is None else w.embed_scales.data_ptr()}
        if fam == "rmsnorm":
            if e.prim != "rmsnorm":
                raise ExecutableError(f"{e.prim}: the executable binds plain rmsnorm only")
            return args | {"y": out, "x": ptr(e.inputs[0]), "delta": 0, "w": ptr(e.inputs[1])}
        if fam == "gated_rmsnorm":
            return args | {"y": out, "o": ptr(e.inputs[0]), "z": ptr(e.inputs[1]), "w": ptr(e.inputs[2])}
        if fam == "gdn_conv":
            layer = state(e.inputs[2]).split(".")[1]
            return args | {"y": out, "x": ptr(e.inputs[0]), "w": ptr(e.inputs[1]),
                           "hist": self.state.conv[layer].data_ptr(), "slots": inputs.ptr("slots"),
                           "rec": 0, "commit": 0, "prev_rec": 0}
        if fam in ("gdn_step", "gdn_chunk"):            # gdn_chunk: the chunked prefill, same arguments
            layer = state(e.inputs[7]).split(".")[1]
            return args | {"o": out, "qkv": ptr(e.inputs[0]), "a": ptr(e.inputs[3]), "b": ptr(e.inputs[4]),
                           "a_log": ptr(e.inputs[5]), "dt_bias": ptr(e.inputs[6]),
                           "state": self.state.ssm[layer].data_ptr(), "slots": inputs.ptr("slots"),
                           "rec_k": 0, "rec_v": 0, "rec_g": 0, "commit": 0, "prev_k": 0, "prev_v": 0, "prev_g": 0}
        if fam == "qk_rope_kv":
            k_rope = values.through_views(e.inputs[0])                     # norm_rope(k, k_norm, positions)
            attn = next(a for a in values.graph.eqns if a.prim in ("gated_paged_attention", "paged_attention")
                        and a.inputs[4].uid == e.inputs[4].uid)
            q_rope = values.through_views(attn.inputs[0])
            return args | {"q_out": ptr(q_rope.outputs[0]), "q": ptr(q_rope.inputs[0]), "k": ptr(k_rope.inputs[0]),
                           "v": ptr(e.inputs[1]), "q_norm": ptr(q_rope.inputs[1]), "k_norm": ptr(k_rope.inputs[1]),
                           "inv_freq": self.inv_freq.data_ptr(), "pos": inputs.ptr("row_pos"),
                           "block_table": inputs.ptr("block_table")} | self._pages(state(e.inputs[4]))
        if fam in ("attn_decode", "attn_combine", "attn_prefill"):
            if e.prim != "gated_paged_attention":
                raise ExecutableError("the executable binds gated attention only (output_gate: true)")
            common = {"q": ptr(e.inputs[0]), "gate_src": ptr(e.inputs[1]), "block_table": inputs.ptr("block_table"),
                      "seq_lens": inputs.ptr("seq_lens"), "seq_len": inputs.ptr("seq_lens")}
            common |= self._pages(state(e.inputs[4]))
            if fam == "attn_decode":
                split = key.splits > 1
                ws = self._attn_partials(key, lane) if split else {"part_o": 0, "part_ml": 0}
                return args | common | ws | {"out": 0 if split else out}
            if fam == "attn_combine":
                dec = next(c.key for c in values.plan.calls if c.eqn == call.eqn and c.key.family == "attn_decode")
                return args | common | self._attn_partials(dec, lane) | {"out": out}
            return args | common | {"out": out}
        raise ExecutableError(f"no argument binding for kernel family {fam!r}")

    def _attn_partials(self, dec_key, lane: int = 0) -> dict[str, int]:
        got = self._workspace_args(dec_key, lane)
        if "part_o" not in got:
            raise ExecutableError(f"{dec_key.name}: attention splits need a workspace (attn_decode.workspace)")
        return {"part_o": got["part_o"], "part_ml": got["part_ml"]}

    # ------------------------------------------------------------ graphs
    def capture(self, bucket: Bucket) -> None:
        """Record the bucket's launches as one CUDA graph, after one eager warm-up run on padded rows
        only (no state slot, KV writes to the trash page), so no sequence's state changes."""
        bucket.graph = None
        bucket.inputs.set([], [], [], [])
        bucket.run(use_graph=False)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bucket.run(use_graph=False)
        bucket.graph = graph

    @property
    def launches(self) -> dict[tuple, int]:
        return {shape: len(b.launchers) for shape, b in self.buckets.items()}


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a
