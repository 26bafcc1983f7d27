"""GPU tier for the wgmma prefill attention (templates/attn_prefill_wg.cu.j2, sm_90's INT8 attn_prefill tiling): on
the case inputs it matches the family's fp32 reference within the bf16 tolerance (not bit-equal to the mma.sync
kernel, `lab.attn_prefill_long --variant mma`: it sums in another order) — at the 27B's shape 256 query tokens at
1,000 and 5,000 keys (ragged last tiles) and 48 tokens at 300 keys (288 rows: a block reaching past the last row),
and at the tiny spec's (4 / 2 heads × 64: one column block, GROUP 2) 64 tokens at 100 keys.
Run: pytest -m gpu tests/gpu/test_attn_prefill_wg_gpu.py -q"""
import pytest

from compiler.kernels import attn_prefill, gemm_wg
from harness import TARGET
from lab.cases import make_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gemm_wg.arch_supported(TARGET.arch), reason="the wgmma kernel needs sm_90")]


@pytest.fixture(scope="module")
def h():
    import harness
    return harness


@pytest.mark.parametrize("shape,t,ctx", [((24, 4, 256), 256, 1000), ((24, 4, 256), 256, 5000),
                                         ((24, 4, 256), 48, 300), ((4, 2, 64), 64, 100)])
def test_wgmma_prefill_attention_matches_the_reference(h, shape, t, ctx):
    key = attn_prefill.make_key(*shape, t, "int8", 128, TARGET)
    assert key.wg, key.name
    h.build([key])                                              # (asserts no spills)
    case = make_case(key, "cuda", ctx % 89, ctx=ctx)
    h.run(case)
    h.compare(case, f"{key.name} at {ctx} keys")
