"""plan: the contract between compiler and runtime — one bucket's kernel calls, each with its key, its
launch and a binding for every kernel parameter, plus the arena, workspace lanes, graph branches and
outputs they address. Bindings are checked against the families' parameter lists when a plan is made,
and a plan prints as stable text (`ninfer-gen inspect --plan`, golden-tested). The runtime resolves each
binding kind to a pointer and knows no kernel family.

Names the runtime's buffers must provide: step inputs (`STEP_INPUTS`, `STEP_TENSORS`), state buffers
(`kv.<layer>.k|v|k_scales|v_scales`, `gdn.<layer>.state|conv`, ReplaySSM `rec.<layer>.conv|k|v|g`), weight planes (`<matrix>:lo|hi|scales` of the packed
matrices, `embed_tokens.weight:rows|row_scales` of the gather table, `<name>:tensor` of small weights).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, ClassVar

from .kernels import KernelKey, Launch, module_of
from .options import CompileOptions


class PlanError(ValueError):
    """A call whose bindings do not match its family's parameters (names the key and the parameter)."""


# ---------------------------------------------------------------------------------------------- bindings
@dataclass(frozen=True)
class Arena:
    """Bytes at `offset` of the activation arena; `value` names the graph value (as the graph prints it)."""
    offset: int
    value: str = ""

    def __str__(self) -> str:
        return f"arena[{self.offset}] {self.value}".rstrip()


@dataclass(frozen=True)
class _Named:
    """A binding to one runtime buffer by name; prints as `<kind>:<name>`."""
    name: str
    kind: ClassVar[str] = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


class Input(_Named):
    """A per-run step-input buffer (STEP_INPUTS), filled by the host before each run."""
    kind = "input"


class State(_Named):
    """A state buffer of one layer, read and written across runs (KV pages, GDN state, conv history)."""
    kind = "state"


@dataclass(frozen=True)
class Weight:
    """One plane of a device weight: `lo`/`hi`/`scales` of a packed matrix, `rows`/`row_scales` of the
    embedding's gather table, `tensor` of a small weight."""
    name: str
    plane: str

    def __str__(self) -> str:
        return f"weight:{self.name}:{self.plane}"


@dataclass(frozen=True)
class Workspace:
    """Scratch bytes of one workspace lane: `scratch` (any contents) or `zeroed` (zero before the first
    launch; the kernels leave it zero). Calls that may run at once use different lanes."""
    pool: str
    offset: int
    lane: int = 0

    def __str__(self) -> str:
        return f"{self.pool}[lane {self.lane}]+{self.offset}"


@dataclass(frozen=True)
class Const:
    """A constant table the runtime makes once (`CONSTANTS[name](*args)`, a torch tensor)."""
    name: str
    args: tuple = ()

    def tensor(self):
        return CONSTANTS[self.name](*self.args)

    def __str__(self) -> str:
        return f"const:{self.name}({','.join(map(repr, self.args))})"


@dataclass(frozen=True)
class Null:
    """An unused pointer parameter: 0."""

    def __str__(self) -> str:
        return "null"


NULL = Null()


@dataclass(frozen=True)
class BucketInput:
    """A step input of another bucket (entry, batch, tokens): what a round's calls write between entries."""
    shape: tuple[str, int, int]
    name: str

    def __str__(self) -> str:
        return f"{self.shape[0]} {self.shape[1]}x{self.shape[2]}:input:{self.name}"


@dataclass(frozen=True)
class BucketOutput:
    """An output (`logits`, `hidden`) of another bucket, read by a round's calls before the next entry runs."""
    shape: tuple[str, int, int]
    name: str

    def __str__(self) -> str:
        return f"{self.shape[0]} {self.shape[1]}x{self.shape[2]}:output:{self.name}"


class RoundBuffer(_Named):
    """A buffer the speculative round keeps across replays (its state rows, block tables, distributions)."""
    kind = "round"


Binding = Arena | Input | Weight | State | Workspace | Const | Null | BucketInput | BucketOutput | RoundBuffer


def _rope_inv_freq(theta: float, rotary_dim: int):
    from .kernels.qk_rope_kv import inv_freq
    return inv_freq(theta, rotary_dim)


def _rope2d_inv_freq(theta: float, d: int):
    from .kernels.attn_vision import inv_freq
    return inv_freq(theta, d)


CONSTANTS: dict[str, Callable[..., Any]] = {"rope_inv_freq": _rope_inv_freq, "rope2d_inv_freq": _rope2d_inv_freq}

# name → int32 elements for (batch, tokens, max_pages): the one buffer of per-run values a bucket owns
STEP_INPUTS: dict[str, Callable[[int, int, int], int]] = {
    "tokens": lambda b, t, p: b * t, "row_pos": lambda b, t, p: b * t, "pos": lambda b, t, p: b,
    "block_table": lambda b, t, p: b * p, "slots": lambda b, t, p: b, "seq_lens": lambda b, t, p: b,
    "commit": lambda b, t, p: b,
    "mrope": lambda b, t, p: 3 * b * t, "image_count": lambda b, t, p: 1,     # the M-RoPE plans' (images)
    # the vision encoder's plans, shape ("vision", images, patches): patch geometry and segment bounds
    "coords": lambda b, t, p: 4 * t, "cu_seqlens": lambda b, t, p: b + 1}
# graph inputs of other dtypes, one device tensor each in the graph input's shape (filled by device copies)
STEP_TENSORS = ("hidden", "images", "pixels")


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Collective:
    """A step of a tensor-parallel plan (compiler.shard) that is no kernel of ours: the collective library's
    sum `all_reduce` of `elements` values of `dtype` over the `tp` ranks, or its `all_gather` of each rank's
    `elements` side by side (rank 0 first); `x` in, `y` out. A Call with this key has no launch; the runtime
    calls the library on the bucket's stream."""
    op: str
    elements: int
    dtype: str
    tp: int
    family: ClassVar[str] = "collective"
    PARAMS: ClassVar[tuple[str, ...]] = ("x", "y")

    @property
    def name(self) -> str:
        return f"{self.op}_n{self.elements}_{self.dtype}_tp{self.tp}"


@dataclass(frozen=True)
class Call:
    key: KernelKey | Collective
    launch: Launch | None                      # None: a Collective
    eqn: int                                   # index of the graph equation it implements
    args: tuple[tuple[str, Binding], ...]      # (parameter, binding) in the family's parameter order
    inputs: tuple[str, ...] = ()               # arena values read, by allocation name (concurrency checks)
    outputs: tuple[str, ...] = ()              # arena values written
    programmatic: bool = False                 # may start before its predecessor ends (sm_90+)
    lane: int = 0                              # its workspace lane

    def binding(self, param: str) -> Binding:
        return dict(self.args)[param]


@dataclass(frozen=True)
class Output:
    """A graph output as the runtime reads it: arena bytes at `offset`, `shape`, the dtype its kernel wrote."""
    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Plan:
    name: str
    target: str
    calls: list[Call]
    arena: dict[str, tuple[int, int]]                 # arena value → (offset, bytes)
    arena_bytes: int
    live: dict[str, tuple[int, int]] = field(default_factory=dict)   # arena value → (first, last) equation
    absorbed: Counter = field(default_factory=Counter)
    dtypes: dict[str, str] = field(default_factory=dict)    # arena value → dtype its kernel writes (if wider)
    outputs: dict[str, Output] = field(default_factory=dict)
    groups: list[list[int]] = field(default_factory=list)   # call indices that may run at once (graph branches)
    workspace: dict[str, tuple[int, ...]] = field(default_factory=dict)  # pool → bytes of each lane
    shape: tuple[str, int, int] = ("step", 1, 1)            # (entry, batch, tokens)
    max_pages: int = 0                                       # block-table width of a row
    options: CompileOptions = CompileOptions()
    graph: Any = None                                        # the fused graph the calls implement

    @property
    def launches(self) -> int:
        return len(self.calls)

    @property
    def lanes(self) -> int:
        return max((len(g) for g in self.groups), default=1)

    def keys(self) -> list[KernelKey]:
        """The kernels the plan launches (not its collectives)."""
        return list(dict.fromkeys(c.key for c in self.calls if not isinstance(c.key, Collective)))

    def collectives(self) -> list[Call]:
        return [c for c in self.calls if isinstance(c.key, Collective)]

    def family_counts(self) -> Counter:
        return Counter(c.key.family for c in self.calls)

    def _used_inputs(self) -> set[str]:
        return {b.name for c in self.calls for _, b in c.args if isinstance(b, Input)}

    def step_inputs(self) -> dict[str, int]:
        """The step-input buffers the calls read, in STEP_INPUTS order, with their int32 element counts."""
        used, (_, batch, tokens) = self._used_inputs(), self.shape
        return {n: size(batch, tokens, self.max_pages) for n, size in STEP_INPUTS.items() if n in used}

    def step_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The other step inputs the calls read (STEP_TENSORS): name → (shape, dtype) of the graph input."""
        used = self._used_inputs()
        return {n: (v.shape, v.dtype) for n, v in self.graph.inputs.items() if n in STEP_TENSORS and n in used}


@lru_cache(maxsize=8192)
def _params(key: KernelKey) -> tuple:
    return tuple(module_of(key).params(key))


def check_args(key: KernelKey, args: dict[str, Binding]) -> tuple[tuple[str, Binding], ...]:
    """`args` in the family's parameter order; a missing, unknown or mistyped binding is a PlanError."""
    if isinstance(key, Collective):
        if set(args) != set(key.PARAMS) or not all(isinstance(args[n], Arena) for n in key.PARAMS):
            raise PlanError(f"{key.name}: x and y must be arena values, got {args}")
        return tuple((n, args[n]) for n in key.PARAMS)
    params = _params(key)
    names = [p.name for p in params]
    missing = [n for n in names if n not in args]
    unknown = [n for n in args if n not in names]
    if missing or unknown:
        what = ([f"no binding for {', '.join(missing)}"] if missing else []) + \
            ([f"bindings for unknown parameter(s) {', '.join(unknown)}"] if unknown else [])
        raise PlanError(f"{key.name}: {'; '.join(what)}")
    for p in params:
        b = args[p.name]
        if p.kind == "ptr" and not isinstance(b, Binding):
            raise PlanError(f"{key.name}: parameter {p.name} is a pointer, bound to {b!r}")
        if p.kind == "ptr" and isinstance(b, Input) and b.name not in STEP_INPUTS and b.name not in STEP_TENSORS:
            raise PlanError(f"{key.name}: parameter {p.name} bound to unknown step input {b.name!r}")
    return tuple((n, args[n]) for n in names)


def format_plan(plan: Plan) -> str:
    """Stable text: a header, then each call with its launch, one line per bound parameter and one line
    naming the null ones."""
    entry, batch, tokens = plan.shape
    lane_of = {i: n for g in plan.groups if len(g) > 1 for n, i in enumerate(g)}
    rows, cols = ("images", "patches") if entry == "vision" else ("batch", "tokens")
    lines = [f"plan {plan.name} entry={entry} {rows}={batch} {cols}={tokens} target={plan.target} "
             f"options={plan.options.describe()}",
             f"  arena {plan.arena_bytes} B; workspace lanes " +
             (", ".join(f"{k} {'+'.join(map(str, v))} B" for k, v in plan.workspace.items()) or "none"),
             "  inputs " + " ".join([f"{k}[{n}]" for k, n in plan.step_inputs().items()] +
                                    [f"{k}:{dt}{list(sh)}" for k, (sh, dt) in plan.step_tensors().items()]),
             "  outputs " + " ".join(f"{k}=arena[{o.offset}] {o.dtype}{list(o.shape)}" for k, o in plan.outputs.items())]
    for i, c in enumerate(plan.calls):
        if c.launch is None:
            lines.append(f"  call {i} {c.key.name} collective eqn={c.eqn}")
            lines += [f"    {name} <- {binding}" for name, binding in c.args]
            continue
        g, b = c.launch.grid, c.launch.block
        branch = f" branch {lane_of[i]}" if i in lane_of else ""
        lines.append(f"  call {i} {c.key.name} grid={g[0]},{g[1]},{g[2]} block={b[0]},{b[1]},{b[2]} "
                     f"smem={c.launch.smem} eqn={c.eqn}{' programmatic' if c.programmatic else ''}{branch}")
        lines += [f"    {name} <- {binding}" for name, binding in c.args if binding != NULL]
        nulls = [name for name, binding in c.args if binding == NULL]
        lines += [f"    null: {' '.join(nulls)}"] if nulls else []
    return "\n".join(lines)
