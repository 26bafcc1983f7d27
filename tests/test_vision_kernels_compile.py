"""CPU tier for the vision encoder's kernels: every key of the tiny-vl and 27B encoder plans (the smallest and the
largest image-token bucket, two images per call in the small one) renders and compiles with NVRTC for sm_86 and
sm_90 with zero spills — the bf16 GEMM's bias epilogues and K tail, layernorm, pos_embed and attn_vision. Built in the
session's kernel cache, which the background build of tests/conftest.py fills ahead (`prebuild`)."""
from pathlib import Path

import pytest

from compiler.build_cache import build_kernels
from compiler.buckets_vision import plan_vision, vision_buckets
from compiler.spec import load_spec
from compiler.targets import lookup

ROOT = Path(__file__).resolve().parent.parent
SPECS = [load_spec(ROOT / f"model_specs/qwen3.8-{name}.yaml") for name in ("tiny-vl", "27b")]


def encoder_keys(arch: str) -> list:
    target, keys = lookup(arch), []
    for spec in SPECS:
        buckets = vision_buckets(spec)
        for tokens, images in ((buckets[0], 2), (buckets[-1], 1)):
            keys += plan_vision(spec, target, tokens, images).keys()
    return list(dict.fromkeys(keys))


@pytest.mark.slow
@pytest.mark.prebuild(keys=encoder_keys)
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_encoder_kernels_compile_without_spills(kernel_cache, arch):
    keys = encoder_keys(arch)
    assert {k.family for k in keys} == {"gemm", "layernorm", "pos_embed", "attn_vision"}
    assert {k.epilogue for k in keys if k.family == "gemm"} == {"bias", "bias_residual", "bias_gelu", "bias_gelu_tanh"}
    assert any(k.k % 64 for k in keys if k.family == "gemm")          # the 27B's fc2 reads a K tail
    built = build_kernels(keys, jobs=4, root=kernel_cache, progress=False)
    spilled = [b.key.name for b in built.built if b.meta["spill_stores"] or b.meta["spill_loads"]]
    assert not spilled and built.spills == 0, f"spills in {spilled}"
    assert len(built.built) == len(keys)
