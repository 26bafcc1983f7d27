"""harness: run Cases on the GPU for tests/gpu and compare them with their references.

Kernels come from one ninfer_gen.executor.cuda_module.KernelCache over NINFER_BUILD_DIR (default build/),
compiled for the device's own arch with all cores.
"""
from __future__ import annotations

import os

import torch

from compiler.targets import lookup
from lab.cases import TOLERANCES, Case
from ninfer_gen.executor.cuda_module import KernelCache
from ninfer_gen.cli.env import build_root

KERNELS = KernelCache(build_root(), jobs=os.cpu_count())


def _target():
    if not torch.cuda.is_available():
        return lookup("h200")                   # collection only: these tests are skipped without a GPU
    major, minor = torch.cuda.get_device_capability()
    return lookup(f"sm_{major}{minor}")


TARGET = _target()


def build(keys, ptx: bool = False) -> None:
    KERNELS.build(keys, ptx)
    assert not KERNELS.spilled(), f"spills in {KERNELS.spilled()}"


def kernel_for(key, ptx: bool = False):
    return KERNELS.get(key, ptx)


def launch_key(key, mod, args) -> None:
    """One launch of `key` with its family module's parameters and launch config."""
    kernel_for(key).bind(mod.params(key), args, mod.launch(key)).launch()


def launchers(case: Case, ptx: bool = False) -> list:
    return [KERNELS.bind(key, args, ptx) for key, args in case.launches]


def run(case: Case, ptx: bool = False) -> None:
    case.poison()
    for launcher in launchers(case, ptx):
        launcher.launch()
    torch.cuda.synchronize()


def _rows(t: torch.Tensor, mask):
    return t if mask is None else t[mask.to(t.device)]


def _check_close(where, a, e, tol_name):
    if tol_name == "kv" and a.dtype == torch.int8:
        diff = (a.int() - e.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, \
            f"{where}: int8 KV codes differ by up to {diff.max()} in {(diff > 0).float().mean():.2%} of values"
        return
    tol = TOLERANCES["bf16" if tol_name == "kv" else tol_name]
    if tol.atol == 0 and tol.rtol == 0:
        assert torch.equal(a, e), f"{where}: not bit-exact ({(a != e).sum()} of {a.numel()} differ)"
        return
    af, ef = a.double(), e.double()
    assert not torch.isnan(af).any(), f"{where}: NaN (poison left?) at {torch.isnan(af).nonzero()[:4].tolist()}"
    scale = max(1.0, ef.pow(2).mean().sqrt().item())
    err = (af - ef).abs() - (tol.atol * scale + tol.rtol * ef.abs())
    worst = err.argmax()
    assert err.max() <= 0, (f"{where}: tolerance '{tol_name}' exceeded, worst at flat index {worst.item()}: "
                            f"{af.flatten()[worst].item():.6g} vs {ef.flatten()[worst].item():.6g}")


def compare(case: Case, label: str) -> None:
    """Every output and in-place tensor against the reference, with its named tolerance."""
    expected = case.reference()
    for name, actual in {**case.outputs, **case.inplace}.items():
        if name not in expected:
            continue
        mask = case.row_mask.get(name)
        a, e = _rows(actual, mask), _rows(expected[name].to(actual.device), mask)
        where = f"{label}: output '{name}' {tuple(actual.shape)} {actual.dtype}"
        assert a.shape == e.shape, f"{where}: shape {a.shape} vs reference {e.shape}"
        _check_close(where, a, e, case.tol[name])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
