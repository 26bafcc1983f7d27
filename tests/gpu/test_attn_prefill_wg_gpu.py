"""GPU tier for the lab's wgmma prefill attention (lab/templates/attn_prefill_wg.cu.j2, `lab.attn_prefill_long
--variant wg`, sm_90 only): on the shipped kernel's case inputs it matches the family's fp32 reference within the
bf16 tolerance (not bit-equal to the shipped kernel: it sums in another order) — 256 query tokens at 1,000 and
5,000 keys (ragged last tiles) and 48 tokens at 300 keys (288 rows: a block reaching past the last row).
Run: pytest -m gpu tests/gpu/test_attn_prefill_wg_gpu.py -q"""
import pytest
import torch

from compiler.kernels import attn_prefill, gemm_wg
from harness import TARGET
from lab import attn_prefill_long as lab
from lab.cases import make_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gemm_wg.arch_supported(TARGET.arch), reason="the wg variant needs sm_90 (wgmma)")]


@pytest.fixture(scope="module")
def h():
    import harness
    return harness


@pytest.mark.parametrize("t,ctx", [(256, 1000), (256, 5000), (48, 300)])
def test_wg_variant_matches_the_reference(h, t, ctx):
    from compiler.build_cache import build_kernels

    key = attn_prefill.make_key(24, 4, 256, t, "int8", 128, TARGET)
    wg = lab.wg_of(key)
    built = build_kernels([wg], root=h.KERNELS.root, jobs=1, progress=False).by_name()[wg.name]
    assert built.meta["spill_stores"] == built.meta["spill_loads"] == 0
    _, bind = lab._load(built, wg, lab.wg_launch(wg))
    case = make_case(key, "cuda", ctx % 89, ctx=ctx)           # the shipped key's inputs and reference
    (_, args), = case.launches
    case.poison()
    bind(args).launch()
    torch.cuda.synchronize()
    h.compare(case, f"{wg.name} at {ctx} keys")
