"""kernels: one small module per kernel family (frozen key, launch config, parameter list, torch reference).

A key is a frozen dataclass whose fields are exactly the template's variables; `key.name` is the
`extern "C"` entry and the build folder name. `FAMILIES` maps a family name to its module.
"""
from __future__ import annotations

import dataclasses
import importlib
from functools import lru_cache
from dataclasses import dataclass
from typing import ClassVar

from ..targets import parse_arch


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0                  # dynamic shared memory bytes


@dataclass(frozen=True)
class Param:
    """One kernel argument in order: `ptr` (device address, uint64), `i32` or `f32`."""
    name: str
    kind: str
    doc: str = ""


class KernelKey:
    """Mixin for a family's frozen key dataclass: needs `family`, an `arch` field and `_name_parts()`."""
    family: ClassVar[str]

    @property
    def name(self) -> str:
        return "_".join([self.family, *self._name_parts(), self.arch.replace("_", "")])

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check_arch(self) -> None:
        parse_arch(self.arch)

    @property
    def compile_arch(self) -> str:
        """The arch NVRTC compiles for: `arch`, unless the family needs an arch-specific target (sm_90a)."""
        return self.arch


FAMILY_MODULES = ("gemv", "gemm", "gemm_wg", "xperm", "rmsnorm", "gated_rmsnorm", "embed", "argmax", "gdn_conv",
                  "gdn_step", "gdn_chunk", "qk_rope_kv", "attn_decode", "attn_combine", "attn_prefill", "concat",
                  "spec_round", "embed_images", "gemv_chain", "layernorm", "pos_embed", "attn_vision")


# The matrix-multiply families: same arguments (gemv.MATMUL_PARAMS, + gemv's split-K workspace), same
# epilogues, weights in the weight_layout planes.
MATMUL_FAMILIES = ("gemv", "gemm", "gemm_wg")


def matmul_keys(key) -> list:
    """The matrix multiplies a launch does: the key of a matmul family, a launch chain's members, else none."""
    if key.family in MATMUL_FAMILIES:
        return [key]
    return list(key.members) if key.family == "gemv_chain" else []


@lru_cache(maxsize=None)
def family(name: str):
    """The module of one family (imported lazily so compile workers stay light)."""
    if name not in FAMILY_MODULES:
        raise KeyError(f"unknown kernel family {name!r}: expected one of {', '.join(FAMILY_MODULES)}")
    return importlib.import_module(f"{__name__}.{name}")


def module_of(key: KernelKey):
    return family(key.family)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
