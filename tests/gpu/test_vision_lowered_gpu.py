"""GPU tier for the vision encoder through the compiler (compiler.buckets_vision, executor.vision_plan): every kernel
of the tiny-vl and 27B encoder plans (the smallest and largest image-token bucket; two images per call in the small
one) against its torch reference on fresh random inputs with poisoned outputs — the bf16 GEMM's bias epilogues and
K tail, layernorm, pos_embed, attn_vision — then the whole lowered encoder against the eager torch tower (the
reference's own code in bf16) within the bf16 floor measured in the test (the eager bf16 tower's distance from the
fp32 one), two images of different sizes per request.
Run: pytest -m gpu tests/gpu/test_vision_lowered_gpu.py -q -s"""
from pathlib import Path

import pytest
import torch

from compiler.buckets_vision import plan_vision, vision_buckets
from compiler.spec import load_spec, vision_tensor_table
from harness import TARGET
from lab.cases import make_case

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SPECS = {name: load_spec(ROOT / f"model_specs/qwen3.8-{name}.yaml") for name in ("tiny-vl", "27b")}


def _keys() -> list:
    keys = []
    for spec in SPECS.values():
        buckets = vision_buckets(spec)
        for tokens, images in ((buckets[0], 2), (buckets[-1], 1), (buckets[-1], 2)):
            keys += plan_vision(spec, TARGET, tokens, images).keys()
    return list(dict.fromkeys(keys))


KEYS = _keys()


@pytest.fixture(scope="session")
def h():
    import harness
    harness.build(KEYS)
    return harness


@pytest.mark.parametrize("key", KEYS, ids=[k.name for k in KEYS])
def test_encoder_kernel(h, key):
    case = make_case(key, "cuda", 7)
    h.run(case)
    h.compare(case, key.name)


def _tower(spec, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = {t.name: torch.randn(t.shape, generator=g, device="cuda") * 0.05 for t in vision_tensor_table(spec)}
    for name in w:
        if "norm" in name and name.endswith("weight"):
            w[name] = 1 + 0.1 * torch.randn(w[name].shape, generator=g, device="cuda")
    return {n: t.bfloat16() for n, t in w.items()}


@pytest.mark.parametrize("name,grids", [("tiny-vl", [(1, 8, 12), (1, 16, 10)]), ("27b", [(1, 32, 32), (1, 64, 64)])])
def test_lowered_encoder_matches_the_torch_tower(h, name, grids):
    """max |lowered − eager bf16| ≤ 2 × max |eager bf16 − eager fp32| + 1e-2 (the bf16 floor), over all tokens."""
    from compiler.vision_model import encode
    from ninfer_gen.executor.vision_plan import CompiledVisionEncoder

    spec = SPECS[name]
    w = _tower(spec, 11)
    n = sum(t * hh * ww for t, hh, ww in grids)
    pixels = torch.randn(n, spec.vision.patch_dim, generator=torch.Generator(device="cuda").manual_seed(5),
                         device="cuda").bfloat16()
    enc = CompiledVisionEncoder(spec, w, "cuda", TARGET, h.KERNELS, max(t * hh * ww for t, hh, ww in grids))
    got = enc(pixels, grids).float()
    torch.cuda.synchronize()
    at, eager, fp32 = 0, [], []
    for t, hh, ww in grids:                 # the torch tower encodes one image per call, as the lowered one does
        rows = pixels[at:at + t * hh * ww]
        eager.append(encode(spec, w, rows, [(t, hh, ww)]).float())
        fp32.append(encode(spec, {k: v.float() for k, v in w.items()}, rows.float(), [(t, hh, ww)]))
        at += t * hh * ww
    eager, fp32 = torch.cat(eager), torch.cat(fp32)
    assert got.shape == eager.shape and torch.isfinite(got).all()
    floor, err = (eager - fp32).abs().max().item(), (got - eager).abs().max().item()
    print(f"\n{name} {grids}: lowered vs eager bf16 max |diff| {err:.4g}; bf16 floor (eager bf16 vs fp32) {floor:.4g}; "
          f"lowered vs fp32 {(got - fp32).abs().max().item():.4g}")
    assert err <= 2 * floor + 1e-2, f"lowered encoder off by {err:.4g}, beyond the bf16 floor {floor:.4g}"
