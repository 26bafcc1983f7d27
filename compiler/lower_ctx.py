"""lower_ctx: what every lowering rule works with — `Ctx` (the spec, target, graph and options of the graph being
lowered, and the names of its weights and state), `Val` (a graph value bound where it lives once the arena is laid
out), `Lowered` (a rule's answer: calls with their bindings, or an alias) and `LoweringError`. The rules are
lower_rules' (and lower_gdn's, the GDN layers'); compiler.lower runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .ir import Graph, Var
from .kernels import KernelKey, module_of
from .options import CompileOptions
from .plan import NULL, Binding, State, Weight, Workspace
from .spec import ModelSpec
from .targets import Target
from .weights import planes_of

ZEROED_WORKSPACE = ("tickets", "counters")    # workspace the kernels expect zero and leave zero


class LoweringError(ValueError):
    pass


@dataclass(frozen=True)
class Val:
    """A graph value bound by where it lives, resolved after the arena is laid out: arena bytes (through
    views), a step input (graph inputs, `positions`), or a small weight's tensor."""
    var: Var


Arg = Binding | Val


@dataclass
class Lowered:
    calls: list[tuple[KernelKey, dict[str, Arg]]] = field(default_factory=list)
    out_dtype: str | None = None        # the dtype the kernels write to output 0, where wider than the graph's
    alias: Binding | None = None        # launches nothing: output 0 is this binding
    scratch: tuple | None = None        # what lane 0's scratch holds afterwards (a permuted input), if known
    in_place: int | None = None         # output 0 overwrites this input's bytes (its last reader)


@dataclass
class Ctx:
    spec: ModelSpec
    target: Target
    graph: Graph
    options: CompileOptions
    weight_format: dict[int, str]
    weight_name: dict[int, str]
    state_name: dict[int, str]
    scratch: tuple | None = None        # Lowered.scratch of the previous equation that launched anything
    wide: dict[int, str] = field(default_factory=dict)   # value → the dtype its kernel writes, where wider

    @property
    def b(self) -> int:
        return self.graph.params["batch"]

    @property
    def t(self) -> int:
        return self.graph.params["tokens"]

    @property
    def m(self) -> int:
        return self.b * self.t

    @property
    def prefill(self) -> bool:
        """Prefill attention: a prompt chunk (of the model, or of the MTP's teacher-forced pass over a
        prompt: one row of ≥ 16 tokens), or more rows than the decode kernels take."""
        entry = self.graph.params["entry"]
        return entry == "prefill" or self.m > 32 or (entry == "mtp" and self.b == 1 and self.t >= 16)

    @property
    def max_pages(self) -> int:
        return self.graph.inputs["block_table"].shape[1]

    @property
    def kv_dtype(self) -> str:
        return "int8" if self.graph.params["kv"] == "int8" else "bf16"

    def state(self, var: Var) -> State:
        """A state value's binding, by the graph's name for it (`gdn.3.state`, `rec1.3.k`, ...)."""
        return State(self.state_name[var.uid])

    def layer(self, state: Var) -> str:
        """The layer a state value belongs to: `gdn.3.conv` → 3, `kv.mtp.codes` → mtp."""
        return self.state_name[state.uid].split(".")[1]

    def pages(self, cache_first: Var) -> dict[str, Binding]:
        """The attention layer's K/V pages (and INT8 scales; null for bf16 pages) as kernel parameters."""
        layer, int8 = self.layer(cache_first), self.kv_dtype == "int8"
        return {"k_pages": State(f"kv.{layer}.k"), "v_pages": State(f"kv.{layer}.v"),
                "k_scales": State(f"kv.{layer}.k_scales") if int8 else NULL,
                "v_scales": State(f"kv.{layer}.v_scales") if int8 else NULL}

    def planes(self, name: str, fmt: str) -> dict[str, Binding]:
        """A packed matrix's planes as the matmul parameters; the planes its format lacks are null."""
        have = planes_of(fmt)
        return {f"w_{p}": Weight(name, p) if p in have else NULL for p in ("lo", "hi", "scales")}

    def workspace(self, key: KernelKey) -> dict[str, Workspace]:
        """The call's workspace regions (`workspace(key)` of its family) in its lane, 256-byte aligned."""
        fn = getattr(module_of(key), "workspace", None)
        out, at = {}, {"scratch": 0, "zeroed": 0}
        for name, size in (fn(key) if fn else {}).items():
            pool = "zeroed" if name in ZEROED_WORKSPACE else "scratch"
            out[name], at[pool] = Workspace(pool, at[pool]), at[pool] + align(size)
        return out


def align(n: int, a: int = 256) -> int:
    return -(-n // a) * a

