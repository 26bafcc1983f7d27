"""CPU tier for arch paths (issue 32, "Ampere on the H200"): another card's kernels run as compute_XX PTX
that the driver JIT-compiles. The sm_86 path of a tiny-spec profile plans without PDL or gemm_wg,
compiles to compute_86 PTX with NVRTC here, holds no sm_90-only instruction, and is cached in its own
`build/sm_86-ptx/` folders under its own hash; a path newer than the device is refused at load; the
kernel cache of a PTX path loads `.ptx` images, all of them as they are built.
The GPU tier runs the path: tests/gpu/test_arch_path_gpu.py. The path's PTX builds in the session's kernel cache
(tests/conftest.py)."""
import json
import re
from pathlib import Path

import pytest
import torch

from compiler import codegen
from compiler.buckets import plan_profile, plan_rounds, profile_keys, profile_of
from compiler.build_cache import build_kernels
from compiler.kernels import FAMILY_MODULES, gemm_wg, rmsnorm
from compiler.spec import load_spec
from compiler.targets import TargetError, arch_path_target, lookup

ROOT = Path(__file__).resolve().parent.parent
TINY = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")
# One lane, 3 drafts, a short context: every family the sm_86 path has (146 kernels, ~7 s of NVRTC on 2 cores).
PROFILE = profile_of(TINY, cohorts=(1,), draft=3, max_context=256, prefill_chunk=64)
# PTX a compute_86 JIT cannot take, or that would mean the sm_90 path leaked in: PDL, warpgroup MMA, register
# reallocation, TMA bulk copies, matrix stores, elections, cluster barriers and async-proxy fences.
SM90_ONLY = re.compile(r"griddepcontrol|wgmma|setmaxnreg|cp\.async\.bulk|stmatrix|elect\.sync|barrier\.cluster|"
                       r"fence\.proxy\.async|\.target\s+sm_9")
MAX_PTX_ISA = (9, 0)     # NVRTC 13.0's; CUDA.md: driver 580 refused PTX 9.5 (NVRTC 13.5), loaded 9.0


def _plans(arch: str):
    target = lookup(arch)
    return plan_profile(TINY, target, PROFILE), plan_rounds(TINY, target, PROFILE)


def test_arch_path_target_selection_and_refusal():
    assert arch_path_target("sm_90").name == "h200"
    card, arch = arch_path_target("sm_90", "rtx3090"), arch_path_target("sm_90", "sm_86")
    assert card == lookup("rtx3090")                                   # a card: its kernels exactly, 82 SMs
    assert (arch.arch, arch.sms, arch.smem_per_sm, arch.name) == ("sm_86", 132, card.smem_per_sm, "sm_86@132sm")
    assert arch_path_target("sm_90", "sm_86", 114).sms == 114          # the device's own SM count when given
    assert arch_path_target("sm_86", "sm_86", 82) == card               # on a 3090 the arch path is the card
    assert arch_path_target("sm_89", "sm_80").arch == "sm_80"
    assert arch_path_target("sm_86", "sm_86").arch == "sm_86"
    assert arch_path_target("sm_120", "sm_86").arch == "sm_86"        # a newer card than the table knows runs it too
    with pytest.raises(TargetError, match=r"arch path sm_90 .* cannot run on this 8\.6 device: compute_90 PTX "
                                          r"needs compute capability 9\.0 or newer"):
        arch_path_target("sm_86", "sm_90")
    with pytest.raises(TargetError, match="cannot run on this 8.6"):
        arch_path_target("sm_86", "sm_89")
    with pytest.raises(TargetError, match="unknown target"):
        arch_path_target("sm_90", "gtx1080")


def _props(sms: int):
    return type("Props", (), {"multi_processor_count": sms})


def test_backend_refuses_a_path_the_device_cannot_run_before_any_device_work(monkeypatch):
    """GpuBackend picks the target first: an sm_90 path on an sm_86 card fails with the reason, before the
    memory plan, the context or the weights are touched (weights=None would fail any of them)."""
    from ninfer_gen.executor import gpu_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(TargetError, match="cannot run on this 8.6 device"):
        gpu_backend.GpuBackend(TINY, None, arch_path="sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _props(82))
    assert gpu_backend.device_target(torch.device("cuda"), "sm_86").name == "rtx3090"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _props(132))
    assert gpu_backend.device_target(torch.device("cuda")).arch == "sm_90"
    assert gpu_backend.device_target(torch.device("cuda"), "rtx3090").name == "rtx3090"
    assert gpu_backend.device_target(torch.device("cuda"), "sm_86").name == "sm_86@132sm"


def test_sm86_path_plans_have_no_pdl_and_no_gemm_wg():
    """PDL and gemm_wg follow the target's arch (lower.py, round.py, gemm_wg.eligible): the sm_86 path
    plans neither, where the sm_90 plans of the same profile have both (so the check means something)."""
    for arch, expect in (("sm_86", False), ("sm_90", True)):
        plans, rounds = _plans(arch)
        calls = [c for p in plans.values() for c in p.calls] + [c for r in rounds.values() for c in r.calls()]
        families = {k.family for k in profile_keys(plans, rounds)}
        assert any(c.programmatic for c in calls) == expect, arch
        assert bool(families & {"gemm_wg", "xperm"}) == expect, arch
        if not expect:
            # images: test_vision_plans; joined GEMV launches (off by default): test_chains; the vision encoder's
            # own plans: test_vision_lower
            assert families == set(FAMILY_MODULES) - {"gemm_wg", "xperm", "embed_images", "gemv_chain", "layernorm",
                                                      "pos_embed", "attn_vision"}


def sm86_path_keys() -> list:
    return profile_keys(*_plans("sm_86"))


@pytest.mark.prebuild(keys=sm86_path_keys, ptx_only=True)
def test_sm86_path_compiles_to_compute86_ptx_without_sm90_instructions(kernel_cache):
    root, keys = kernel_cache, sm86_path_keys()
    summary = build_kernels(keys, jobs=2, root=root, ptx_only=True, progress=False)
    # every key built once (none twice), compiled here or earlier in the session from the same source
    assert len(summary.built) == len(keys) == summary.kernels and len(keys) > 100
    for b in summary.built:
        assert b.dir.parent.parent == root / "sm_86-ptx", b.dir
        assert {p.name for p in b.dir.iterdir()} == {"kernel.cu", "kernel.ptx", "meta.json", "nvrtc.log"}
        ptx = b.ptx.read_text()
        assert re.search(r"^\.target sm_86\s*$", ptx, re.M), f"{b.key.name}: not compute_86 PTX"
        isa = tuple(map(int, re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M).groups()))
        assert isa <= MAX_PTX_ISA, f"{b.key.name}: PTX ISA {isa} is newer than driver 580 takes"
        assert f".entry {b.key.name}(" in ptx
        bad = SM90_ONLY.search(ptx)
        assert bad is None, f"{b.key.name}: sm_90-only PTX {bad.group(0)!r} in the sm_86 path"
        meta = json.loads((b.dir / "meta.json").read_text())
        assert (meta["image"], meta["gpu_architecture"], meta["arch"]) == ("ptx", "compute_86", "sm_86")
        assert meta["hash"] == b.dir.name[-12:] and f"// hash: {meta['hash']}" in (b.dir / "kernel.cu").read_text()
    warm = build_kernels(keys, jobs=2, root=root, ptx_only=True, no_jit=True, progress=False)
    assert warm.compiled == 0 and warm.cached == len(keys)          # a warm load does no NVRTC work


def test_the_sm90_grep_catches_what_it_must(tmp_path):
    """Negative control for the check above: the same source family as sm_90 PTX has `griddepcontrol`;
    gemm_wg (compute_90a) has `wgmma`. Their PTX-only folders are `sm_90-ptx`."""
    norm = rmsnorm.Key(128, 2, True, "bf16", 1e-6, "sm_90")
    wg = gemm_wg.make_key("q4g64", 512, 128, 64, lookup("h200"), "silu_mul")
    built = build_kernels([norm, wg], jobs=1, root=tmp_path, ptx_only=True, progress=False).by_name()
    assert "griddepcontrol.wait" in built[norm.name].ptx.read_text()
    assert "wgmma" in built[wg.name].ptx.read_text()
    assert built[wg.name].meta["gpu_architecture"] == "compute_90a"
    assert {b.dir.parent.parent.name for b in built.values()} == {"sm_90-ptx"}


def test_ptx_cache_apart_from_the_cubin_cache(tmp_path):
    """One key, built both ways: separate folders (`sm_86/` vs `sm_86-ptx/`) and hashes, neither holding the
    other's image; the PTX-only hash covers the compute_86 target, the cubin hash stays what it was."""
    key = rmsnorm.Key(128, 2, True, "bf16", 1e-6, "sm_86")
    cubin = build_kernels([key], jobs=1, root=tmp_path, progress=False).built[0]
    ptx = build_kernels([key], jobs=1, root=tmp_path, ptx_only=True, progress=False).built[0]
    assert cubin.dir.parent == tmp_path / "sm_86" / "rmsnorm" and ptx.dir.parent == tmp_path / "sm_86-ptx" / "rmsnorm"
    assert cubin.dir.name[-12:] != ptx.dir.name[-12:]
    assert (cubin.dir / "kernel.cubin").is_file() and not (cubin.dir / "kernel.ptx").exists()
    assert (ptx.dir / "kernel.ptx").is_file() and not (ptx.dir / "kernel.cubin").exists()
    v = cubin.meta["nvrtc_version"]
    opts = codegen.nvrtc_options()
    assert codegen.render(key, v).hash == codegen.kernel_hash(key, opts, v) == cubin.dir.name[-12:]
    assert codegen.render(key, v, ptx_only=True).hash == ptx.dir.name[-12:]
    assert (cubin.meta["image"], ptx.meta["image"]) == ("cubin", "ptx")


def test_kernel_cache_of_a_ptx_path_loads_ptx_as_it_builds(tmp_path, monkeypatch):
    """KernelCache(jit_ptx=True), with the driver's load replaced: every built key is loaded from its
    `sm_86-ptx/.../kernel.ptx` once, during build (so no request waits for the JIT); the JIT's local memory
    is reported (`loaded()`), not taken for spills (a stack frame is local memory too)."""
    from ninfer_gen.executor import cuda_module

    loads = []
    keys = [rmsnorm.Key(128, 2, True, "bf16", 1e-6, "sm_86"), *profile_keys(*_plans("sm_86"))[:3]]

    def fake_load(image, entry, dynamic_smem=0):
        loads.append((Path(image), entry))
        return cuda_module.Kernel(entry, None, None, 40, 16 if entry == keys[0].name else 0)

    monkeypatch.setattr(cuda_module.Kernel, "load", staticmethod(fake_load))
    cache = cuda_module.KernelCache(tmp_path, jobs=1, jit_ptx=True)
    cache.build(keys)
    assert [e for _, e in loads] == [k.name for k in keys]
    assert all(p.name == "kernel.ptx" and p.parents[2] == tmp_path / "sm_86-ptx" for p, _ in loads)
    cache.build(keys)
    cache.get(keys[0])
    assert len(loads) == len(keys)                                   # loaded once each
    assert cache.spilled() == [] and [k.name for k in cache.loaded() if k.local_bytes] == [keys[0].name]
