"""executable: a runtime profile's Plans bound to device memory, run eagerly or replayed as one CUDA
graph per bucket.

A plan says everything: each call's key, launch and a binding per kernel parameter. This module
resolves bindings to pointers by their kind (arena bytes, step input, weight plane, state buffer,
workspace lane, constant table, null) and knows no kernel family. It owns one activation arena shared
by every bucket (buckets run one after another on one stream), the workspace lanes, the constants, and
the graph branches of each plan's concurrent groups. Kernel arguments are packed once per call
(`cuda_module.Launcher`); a bucket's graph is captured once and replayed.
"""
from __future__ import annotations

import math
from itertools import zip_longest
from typing import Callable

import torch

from compiler.buckets import Profile, plan_bucket, plan_profile, plan_rounds, profile_keys
from compiler.plan import (Arena, BucketInput, BucketOutput, Const, Input, Null, Plan, RoundBuffer, State, Weight,
                           Workspace)
from compiler.round import RoundPlan, plan_round
from compiler.spec import ModelSpec
from compiler.targets import Target

from ninfer_gen.executor.cuda_module import KernelCache
from ninfer_gen.executor.device_state import TORCH_DTYPES, DeviceState, ExecutableError, StepInputs
from ninfer_gen.executor.device_weights import DeviceWeights

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1}


class Bucket:
    """One (entry, B, T) shape: its plan, its input buffers, its packed launchers, its CUDA graph.
    Groups of concurrent calls run on side streams (forked from and joined back into the current
    stream with events), so a captured graph has parallel branches there."""

    def __init__(self, shape: tuple[str, int, int], plan: Plan, inputs: StepInputs):
        self.shape, self.plan, self.inputs = shape, plan, inputs
        self.launchers: list = []
        self.side_streams: list = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def run(self, use_graph: bool = True) -> None:
        if use_graph and self.graph is not None:
            self.graph.replay()
            return
        main = torch.cuda.current_stream() if self.side_streams else None
        for group in self.plan.groups:
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


class Round:
    """One bound RoundPlan (compiler.round): its steps as bucket runs and launchers, replayed as one CUDA graph."""

    def __init__(self, plan: RoundPlan, steps: list):
        self.plan, self.steps = plan, steps
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def launches(self) -> int:
        return sum(len(s.launchers) if isinstance(s, Bucket) else 1 for s in self.steps)

    def run(self, use_graph: bool = True) -> None:
        if use_graph and self.graph is not None:
            self.graph.replay()
            return
        for s in self.steps:
            if isinstance(s, Bucket):
                s.run(use_graph=False)
            else:
                s.launch()


class Executable:
    """The plans of one runtime profile for one spec and target, bound to one weight set, one state pool
    and one arena."""

    def __init__(self, spec: ModelSpec, target: Target, weights: DeviceWeights, state: DeviceState,
                 kernels: KernelCache, profile: Profile, device="cuda"):
        if profile.kv_dtype != state.kv_dtype:
            raise ExecutableError(f"the profile's KV dtype {profile.kv_dtype} differs from the state's {state.kv_dtype}")
        self.spec, self.target, self.weights, self.state, self.kernels = spec, target, weights, state, kernels
        self.profile, self.device = profile, torch.device(device)
        self.buckets: dict[tuple, Bucket] = {}
        self._plans: dict[tuple, Plan] = {}
        self._round_plans: dict | None = None
        self.arena = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self.pools = {p: torch.zeros(0, dtype=torch.uint8, device=self.device) for p in ("scratch", "zeroed")}
        self.lane_bytes: dict[str, tuple[int, ...]] = {"scratch": (), "zeroed": ()}
        self.constants: dict[Const, torch.Tensor] = {}
        self.side_streams: list = []
        self.rounds: dict[tuple, Round] = {}
        self.round_buffers: dict[str, torch.Tensor] = {}
        self._resolvers = {Arena: self._arena, Input: self._input, Weight: self._weight, State: self._state,
                           Workspace: self._workspace, Const: self._const, Null: lambda b, inputs: 0,
                           BucketInput: self._bucket_input, BucketOutput: self._bucket_output,
                           RoundBuffer: self._round_buffer}

    @property
    def shapes(self) -> list[tuple[str, int, int]]:
        return self.profile.shapes()

    def keys(self) -> list:
        """Every kernel key of the profile's plans (what `ninfer-gen build` compiles for this profile)."""
        missing = [s for s in self.shapes if s not in self._plans]
        if missing:
            self._plans |= plan_profile(self.spec, self.target, self.profile)
        if self._round_plans is None:
            self._round_plans = plan_rounds(self.spec, self.target, self.profile)
        return profile_keys({s: self._plans[s] for s in self.shapes}, self._round_plans)

    def plan(self, shape: tuple[str, int, int]) -> Plan:
        if shape not in self.shapes:
            raise ExecutableError(f"bucket {shape[0]} B={shape[1]} T={shape[2]} is not in the runtime profile "
                                  f"({self.profile.describe()}): its shapes are " +
                                  ", ".join(f"{e} {b}x{t}" for e, b, t in self.shapes))
        if shape not in self._plans:
            self._plans[shape] = plan_bucket(self.spec, self.target, *shape, self.profile)
        return self._plans[shape]

    # ------------------------------------------------------------ buckets
    def bucket(self, entry: str, batch: int, tokens: int) -> Bucket:
        """The profile's bucket for B rows × T tokens (planned, built and bound on first use)."""
        shape = (entry, batch, tokens)
        if shape not in self.buckets:
            self.buckets[shape] = self.bind_plan(self.plan(shape))
        return self.buckets[shape]

    def bind_plan(self, plan: Plan, inputs: StepInputs | None = None) -> Bucket:
        """A bucket for `plan` on this executable's memory (the profile's buckets come through `bucket`;
        lab A/B measurements bind plans of other options here, sharing a bucket's `inputs`)."""
        if plan.collectives():
            raise ExecutableError(f"{plan.name} is one rank's plan of a tensor-parallel model: the runtime that calls "
                                  "its collectives (NCCL in the bucket's graph) is not built yet")
        self.kernels.build(plan.keys())
        spills = [n for n in self.kernels.spilled() if n in {k.name for k in plan.keys()}]
        if spills:
            raise ExecutableError(f"kernels spill registers: {', '.join(spills)}")
        _, batch, tokens = plan.shape
        inputs = inputs or StepInputs(batch, tokens, plan.max_pages, self.state.trash_page, self.device,
                                      plan.step_tensors(), plan.step_inputs())
        bucket = Bucket(plan.shape, plan, inputs)
        self._fit(plan, bucket)
        self._bind(bucket)
        return bucket

    def prepare(self) -> None:
        """Plan every bucket of the profile, build its kernels and size the arena, workspace lanes and
        graph branches for all of them at once, so binding a bucket later never moves memory."""
        self.kernels.build(self.keys())
        for shape in self.shapes:
            self._fit(self._plans[shape])
        sizes: dict[str, tuple[int, str, bool]] = {}
        for r in self._round_plans.values():
            for name, (shape, dtype, zeroed) in r.buffers.items():
                n = math.prod(shape)
                sizes[name] = (max(n, sizes.get(name, (0,))[0]), dtype, zeroed)
        self.round_buffers = {name: torch.zeros(n, dtype=TORCH_DTYPES[dt], device=self.device)
                              for name, (n, dt, _) in sizes.items()}

    def _fit(self, plan: Plan, new: Bucket | None = None) -> None:
        """Grow the arena and the workspace lanes for a plan; growing moves them, so every other bucket is
        rebound (never after `prepare` for the profile's own plans)."""
        grow = plan.arena_bytes > self.arena.numel()
        if grow:
            self.arena = torch.zeros(plan.arena_bytes, dtype=torch.uint8, device=self.device)
        for pool, lanes in plan.workspace.items():
            have = self.lane_bytes[pool]
            want = tuple(max(a, b) for a, b in zip_longest(have, lanes, fillvalue=0))
            if want != have:
                self.pools[pool] = torch.zeros(sum(want), dtype=torch.uint8, device=self.device)
                self.lane_bytes[pool], grow = want, True
        if self.device.type == "cuda":
            self.side_streams += [torch.cuda.Stream(self.device) for _ in range(plan.lanes - 1 - len(self.side_streams))]
        if grow:
            for b in self.buckets.values():
                if b is not new:
                    self._bind(b)

    # ------------------------------------------------------------ binding
    def _bind(self, bucket: Bucket) -> None:
        """Resolve every call's bindings to pointers and pack them into launchers."""
        plan = bucket.plan
        bucket.graph = None
        bucket.side_streams = self.side_streams
        bucket.launchers = [self.kernels.bind(c.key, [self.resolve(b, bucket.inputs) for _, b in c.args],
                                              programmatic=c.programmatic) for c in plan.calls]
        bucket.logits, bucket.hidden = (self._output(plan, name) for name in ("logits", "hidden"))

    def resolve(self, binding, inputs: StepInputs) -> int:
        """The device address a binding names."""
        return self._resolvers[type(binding)](binding, inputs)

    def _arena(self, b: Arena, inputs) -> int:
        return self.arena.data_ptr() + b.offset

    def _input(self, b: Input, inputs: StepInputs) -> int:
        return inputs.ptr(b.name)

    def _weight(self, b: Weight, inputs) -> int:
        return self.weights.plane(b.name, b.plane).data_ptr()

    def _state(self, b: State, inputs) -> int:
        return self.state.buffer(b.name).data_ptr()

    def _workspace(self, b: Workspace, inputs) -> int:
        lanes = self.lane_bytes[b.pool]
        if b.lane >= len(lanes) or b.offset >= lanes[b.lane]:
            raise ExecutableError(f"{b} lies outside the {b.pool} workspace lanes {lanes}")
        return self.pools[b.pool].data_ptr() + sum(lanes[:b.lane]) + b.offset

    def _const(self, b: Const, inputs) -> int:
        if b not in self.constants:
            self.constants[b] = b.tensor().to(self.device).contiguous()
        return self.constants[b].data_ptr()

    def _bucket_input(self, b: BucketInput, inputs) -> int:
        return self.bucket(*b.shape).inputs.ptr(b.name)

    def _bucket_output(self, b: BucketOutput, inputs) -> int:
        out = getattr(self.bucket(*b.shape), b.name)
        if out is None:
            raise ExecutableError(f"bucket {b.shape} has no output {b.name!r}")
        return out.data_ptr()

    def _round_buffer(self, b: RoundBuffer, inputs) -> int:
        if b.name not in self.round_buffers:
            raise ExecutableError(f"no round buffer {b.name!r} (the profile's rounds have "
                                  f"{', '.join(self.round_buffers) or 'none'})")
        return self.round_buffers[b.name].data_ptr()

    def _output(self, plan: Plan, name: str) -> torch.Tensor | None:
        out = plan.outputs.get(name)
        if out is None:                   # e.g. the commit entry: state writes only
            return None
        size = math.prod(out.shape) * DTYPE_BYTES[out.dtype]
        return self.arena[out.offset:out.offset + size].view(TORCH_DTYPES[out.dtype]).view(*out.shape)

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

    # ------------------------------------------------------------ speculative rounds
    def round(self, batch: int, acceptance: str, fold: bool = True, parity: int = 0) -> Round:
        """The profile's round of `batch` lanes (compiler.round), bound on first use; `fold` False: the eager
        variant, without the commit bucket (the caller runs it after reading the round); `parity`: with the
        profile's fold_in_verify, the round writing record set `parity` (rounds alternate)."""
        key = (batch, acceptance, fold, parity)
        if key not in self.rounds:
            self.keys()
            if (batch, acceptance) not in self._round_plans:
                raise ExecutableError(f"no {acceptance} round of {batch} lanes in the runtime profile "
                                      f"({self.profile.describe()}): it has {sorted(self._round_plans) or 'none'}")
            plan = self._round_plans[(batch, acceptance)] if fold and not parity else \
                plan_round(self.spec, self.target, self.profile, batch, acceptance, fold=fold, parity=parity)
            self.kernels.build(plan.keys())
            steps = [self.bucket(*s) if isinstance(s, tuple) else
                     self.kernels.bind(s.key, [self.resolve(b, None) for _, b in s.args], programmatic=s.programmatic)
                     for s in plan.steps]
            self.rounds[key] = Round(plan, steps)
        return self.rounds[key]

    def capture_round(self, rnd: Round, idle: Callable[[], Callable[[], None]]) -> None:
        """Record a round as one CUDA graph after one eager warm-up; `idle()` makes every lane idle (padded
        rows only, so nothing changes) and returns the function that restores them."""
        rnd.graph = None
        restore = idle()
        rnd.run(use_graph=False)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rnd.run(use_graph=False)
        torch.cuda.synchronize(self.device)
        restore()
        rnd.graph = graph

    @property
    def launches(self) -> dict[tuple, int]:
        return {shape: len(b.launchers) for shape, b in self.buckets.items()}
