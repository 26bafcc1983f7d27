"""GPU tier for prompts with images (tiny-vl spec, random weights): the tower on the device vs the reference
encoder, an image prompt's logits vs the reference interpreter within the bf16 floor the same prompt without its
images shows, greedy tokens of an image prompt equal with and without drafts (K = 3) and alone vs in a cohort of
4, and text-only prompts bit-identical between a text profile and an images (M-RoPE) profile.
Run: pytest -m gpu tests/gpu/test_vision_gpu.py -q -s"""
from pathlib import Path

import numpy as np
import pytest

from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TINY_VL = ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml"
CONTEXT = 1024
NEW = 24


@pytest.fixture(scope="module")
def gpu():
    from ninfer_gen.api import load

    return load(TINY_VL, backend="gpu", cohorts=4, draft=3, max_context=CONTEXT, build_root=build_root())


@pytest.fixture(scope="module")
def text_gpu():
    from ninfer_gen.api import load

    return load(TINY_VL, backend="gpu", cohorts=4, draft=3, max_context=CONTEXT, build_root=build_root(),
                vision=False)


@pytest.fixture(scope="module")
def ref():
    from ninfer_gen.api import load

    return load(TINY_VL, device="cpu")


def _images(model, seed, sizes=((40, 56), (30, 30))):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return model.prepare_images([Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes])


def _prompt(model, images, seed=0):
    rng = np.random.default_rng(seed + 100)
    v = model.spec.vision
    ids = rng.integers(1, 500, 5).tolist()
    for _ in images.grids:
        ids += [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + rng.integers(1, 500, 7).tolist()
    return model.expand_images(ids, images)


def _last_logits(model, ids, images):
    """The prompt's last-row logits through the lane path (positions, the tower, image tokens per piece)."""
    import torch
    from compiler.multimodal import RopePositions

    be = model.backend
    seq = be.new_sequence()
    try:
        if images is not None:
            seq.positions = RopePositions.of(ids, images.grids, model.spec.vision)
            rows = be.encode(images.pixels, images.grids)
        else:
            rows = None
        logits, _ = be.prefill(seq, ids, images=rows)
        return logits[-1].float().cpu()
    finally:
        be.release(seq)
        torch.cuda.synchronize()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_tower_on_the_gpu_is_the_reference_encoder(gpu, ref):
    images = _images(ref, 0)
    ours = gpu.backend.encode(images.pixels, images.grids).float().cpu()
    theirs = ref.backend.encode(images.pixels, images.grids).float()
    rel = _rel(ours, theirs)
    print(f"tower on the GPU (bf16) vs the reference (fp32): rel-L2 {rel:.2e}")
    assert ours.shape == theirs.shape and rel < 2e-2


def test_image_prompt_logits_within_the_bf16_floor(gpu, ref):
    images = _images(ref, 0)
    ids = _prompt(ref, images)
    with_images = _rel(_last_logits(gpu, ids, images), _last_logits(ref, ids, images))
    v = ref.spec.vision
    text = [t if t != v.image_token_id else 7 for t in ids]                     # the same length, text only
    floor = _rel(_last_logits(gpu, text, None), _last_logits(ref, text, None))
    print(f"last-row logits vs the reference: image prompt rel-L2 {with_images:.2e}, text prompt {floor:.2e}")
    assert with_images < max(3 * floor, 2e-2)


def test_greedy_image_prompt_equal_with_drafts_and_in_a_cohort(gpu):
    from ninfer_gen.engine import Engine, Request

    reqs = [Request(_prompt(gpu, _images(gpu, s), s), NEW, draft=d, images=_images(gpu, s))
            for s, d in ((0, 0), (1, 3), (2, 0), (3, 3))]
    lanes = gpu.lanes(4, prefix_cache=0)

    def run(batch, n_lanes):
        engine = Engine(lanes, lanes=n_lanes, prefill_budget=48)        # chunks that end inside images
        handles = [engine.submit(r) for r in batch]
        finals = [h.result() for h in handles]
        assert all(f.finish == "length" for f in finals), [f.error for f in finals]
        return [h.tokens for h in handles]

    alone = [run([r], 1)[0] for r in reqs]
    assert run(reqs, 4) == alone
    plain = run([Request(r.prompt, NEW, draft=0, images=r.images) for r in reqs], 4)
    assert plain == alone                                     # drafts are lossless with M-RoPE positions
    assert lanes.usage()["slots_in_use"] == 0 and lanes.usage()["pages_in_use"] == 0


def test_text_prompts_are_bit_identical_with_the_images_profile(gpu, text_gpu):
    import torch

    ids = np.random.default_rng(9).integers(1, 500, 77).tolist()
    assert torch.equal(_last_logits(gpu, ids, None), _last_logits(text_gpu, ids, None))
    assert gpu.generate(ids, NEW, draft=3) == text_gpu.generate(ids, NEW, draft=3)
    assert gpu.generate(ids, NEW) == text_gpu.generate(ids, NEW)
