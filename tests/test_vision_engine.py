"""test_vision_engine: prompts with images through the one engine on the reference lanes — greedy tokens equal to
the eager full-recompute reference (compiler.multimodal.multimodal_forward: encoder, image tokens, M-RoPE) with and
without drafts, alone and in a cohort with chunked prefill cutting an image, prefix reuse keyed by the images'
content, and the refusals (placeholders without images, images on a text model, a count that does not match).
"""
import numpy as np
import pytest
import torch
from PIL import Image

from compiler.multimodal import RopePositions, mrope_positions, multimodal_forward
from ninfer_gen.api import load
from ninfer_gen.engine import Engine, Request
from ninfer_gen.lanes.images import prefix_key
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.sampling import SamplingParams

NEW = 10
pytestmark = pytest.mark.usefixtures("one_thread_module")     # tiny ops: one torch thread (conftest)


@pytest.fixture(scope="module")
def model():
    return load("model_specs/qwen3.8-tiny-vl.yaml")


def _images(model, seed: int, sizes=((40, 56), (30, 30))):
    rng = np.random.default_rng(seed)
    return model.prepare_images([Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes])


def _prompt(model, images, text=((5, 6, 7), (8, 9), (10, 11, 12))):
    """Text, image 1, text, image 2, ..., text (one placeholder block per image), expanded."""
    v = model.spec.vision
    ids = list(text[0])
    for i in range(len(images.grids)):
        ids += [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + list(text[i + 1])
    return model.expand_images(ids, images)


def _reference(model, ids, images, n=NEW):
    """Greedy tokens by the eager, stateless forward of the whole sequence at every step."""
    seq, out = list(ids), []
    pixels = torch.from_numpy(images.pixels)
    for _ in range(n):
        logits, _ = multimodal_forward(model.spec, model.backend.weights, seq, pixels, images.grids)
        out.append(int(logits[-1].argmax()))
        seq.append(out[-1])
    return out


@pytest.fixture(scope="module")
def case(model):
    images = _images(model, 0)
    ids = _prompt(model, images)
    return ids, images, _reference(model, ids, images)


@pytest.mark.parametrize("draft", [0, 3])
def test_greedy_tokens_equal_the_full_recompute_reference(model, case, draft):
    ids, images, ref = case
    assert model.generate(ids, NEW, draft=draft, images=images) == ref


def test_positions_continue_after_the_prompt(model, case):
    ids, images, _ = case
    pos3, delta = mrope_positions(ids, images.grids, model.spec.vision)
    rows = RopePositions(pos3, delta).rows(len(ids) - 2, 4)
    assert rows[:2].tolist() == [list(p) for p in pos3[-2:]]
    assert rows[2:].tolist() == [[len(ids) + delta] * 3, [len(ids) + 1 + delta] * 3] and delta < 0


def test_alone_equals_in_a_cohort_with_chunks_cutting_an_image(model, case):
    """A cohort of 4 (this prompt, another image prompt, two text prompts; greedy and seeded sampling, K 0 and
    2) with a prefill budget of 37 tokens, so chunks end inside images: each request's tokens equal its solo run."""
    ids, images, ref = case
    other = _images(model, 1, sizes=((24, 60),))
    other_ids = _prompt(model, other, text=((20, 21), (22, 23, 24)))
    sampled = SamplingParams(0.8, 0, 1.0, 7)
    requests = [Request(ids, NEW, draft=2, images=images),
                Request(other_ids, NEW, sampled, draft=0, images=other),
                Request([30, 31, 32, 33], NEW, draft=3),
                Request([40] * 50, NEW, sampled, draft=1)]
    lanes = ReferenceLanes.for_model(model, 4, prefix_cache=0)
    engine = Engine(lanes, lanes=4, prefill_budget=37)
    handles = [engine.submit(r) for r in requests]
    outs = [(h.result(), h.tokens) for h in handles]
    assert all(final.finish == "length" for final, _ in outs)
    assert outs[0][1] == ref
    for r, (_, tokens) in zip(requests, outs):
        alone = Engine(ReferenceLanes.for_model(model, 1, prefix_cache=0), lanes=1, prefill_budget=37)
        h = alone.submit(r)
        h.result()
        assert h.tokens == tokens
    assert lanes.usage()["slots_in_use"] == 0 and lanes.usage()["pages_in_use"] == 0


def test_prefix_reuse_is_keyed_by_the_images_content(model, case):
    """The same prompt with the same images restores the checkpoint; the same placeholders with another picture
    restore only the text before the first image — and both give their solo tokens."""
    ids, images, ref = case
    lanes = ReferenceLanes.for_model(model, 1, prefix_cache=8, checkpoint_every=64)
    engine = Engine(lanes, lanes=1, prefill_budget=64)       # checkpoints at 64 and 128 (an image's middle)

    def run(prompt, imgs):
        h = engine.submit(Request(prompt, NEW, images=imgs))
        final = h.result()
        return h.tokens, final.stats.cached_tokens

    assert run(ids, images) == (ref, 0)
    tokens, cached = run(ids, images)
    assert tokens == ref and cached == 128          # restored inside image 2: its rows come from the encoder
    changed = _images(model, 5)             # the same sizes: the same placeholders, other pictures
    assert changed.tokens == images.tokens and changed.digests != images.digests
    tokens, cached = run(ids, changed)
    assert tokens == _reference(model, ids, changed) and cached == 0     # the first image starts at token 4


def test_prefix_key_differs_only_at_image_tokens(model, case):
    ids, images, _ = case
    token = model.spec.vision.image_token_id
    key = prefix_key(ids, images, token)
    assert [k for k, t in zip(key, ids) if t != token] == [t for t in ids if t != token]
    assert all(k < 0 for k, t in zip(key, ids) if t == token) and len(set(key)) > len(set(ids))
    assert prefix_key(ids, None, token) == ids


def test_refusals(model, case):
    ids, images, _ = case
    engine = Engine(ReferenceLanes.for_model(model, 1, prefix_cache=0), lanes=1)
    text = load("model_specs/qwen3.8-tiny.yaml")
    cases = [
        (engine, Request(ids, 4), "image placeholder tokens"),                         # placeholders, no images
        (engine, Request(ids[:-20] + ids[-3:], 4, images=images), "does not match"),   # a run cut short
        (Engine(ReferenceLanes.for_model(text, 1, prefix_cache=0), lanes=1),
         Request([1, 2, 3], 4, images=images), "no vision tower"),
    ]
    for eng, request, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.submit(request)
    with pytest.raises(ValueError, match="no vision tower"):
        text.prepare_images([Image.new("RGB", (32, 32))])
    with pytest.raises(ValueError, match="preprocessed"):
        Request([1, 2], 4, images=[b"png"])


def test_images_beyond_the_context_are_refused_before_patchifying():
    small = load("model_specs/qwen3.8-tiny-vl.yaml", max_context=512)
    with pytest.raises(ValueError, match=r"image 1: 992×992 pixels after resizing: .* 3,844 image tokens, over the 512"):
        small.prepare_images([Image.new("RGB", (1000, 1000))])
    assert small.prepare_images([Image.new("RGB", (100, 100))]).tokens == (64,)


def test_the_shapes_only_images_make_are_kept_to_a_bound(model, monkeypatch):
    """Every image size is a new encoder shape and every chunk's image-token count a new prefill shape: a server
    that sees many sizes keeps only the most recent of those programs (the text shapes all stay)."""
    import ninfer_gen.reference as reference

    monkeypatch.setattr(reference, "IMAGE_PROGRAMS", 3)
    lanes = ReferenceLanes.for_model(model, 1, prefix_cache=0)
    be, engine = lanes.backend, Engine(lanes, lanes=1)
    text = [k for k in be._programs if not (k[0] == "vision" or k[-1])]
    for side in (140, 200, 260, 320, 380):                  # above the minimum: five token counts
        images = _images(model, side, sizes=((side, side),))
        assert engine.submit(Request(_prompt(model, images, text=((5,), (6,))), 2, images=images)).result().finish \
            == "length"
    imaged = [k for k in be._programs if k[0] == "vision" or k[-1]]
    assert len(imaged) == 3 and all(k in be._programs for k in text)
