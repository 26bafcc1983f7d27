"""test_vision_mrope: prompts with images in the reference — M-RoPE positions against HF's `get_rope_index`, text
positions unchanged bit for bit, and the logits of a prompt with two images of different sizes (text between
them) against HF's Qwen3_5ForConditionalGeneration (fp32, CPU, tiny random model), eager and as a traced prefill
over paged KV and GDN state.
"""
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from compiler import model
from compiler.interpret import run_graph
from compiler.multimodal import expand_image_placeholders, image_token_counts, mrope_positions, multimodal_forward
from compiler.ops import EagerOps
from compiler.prims import PRIMS
from compiler.spec import load_spec
from compiler.trace import StatePools, state_avals, trace
from compiler.reference_ops import torch_dtype
from compiler.vision_model import encode
from hf_fixtures import randomize_
from ninfer_gen.vision.preprocess import preprocess
from vision_fixtures import hf_config, image_config, make_images, randomize_vision_, vision_params

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread_module")     # tiny ops: one torch thread (conftest)


@pytest.fixture(scope="module")
def spec():
    return load_spec(ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml")


@pytest.fixture(scope="module")
def hf(spec):
    with torch.random.fork_rng():
        m = Qwen3_5ForConditionalGeneration(hf_config(spec)).float().eval()
    randomize_(m.model.language_model, seed=5)
    randomize_vision_(m.model.visual, seed=6)
    with torch.no_grad():
        h = spec.model.hidden_size
        m.lm_head.weight.copy_(torch.randn(m.lm_head.weight.shape, generator=torch.Generator().manual_seed(7))
                               * 2 / math.sqrt(h))
    return m


@pytest.fixture(scope="module")
def params(hf):
    text = {k: v.detach().clone() for k, v in hf.model.language_model.state_dict().items()}
    return {**text, "lm_head.weight": hf.lm_head.weight.detach().clone(), **vision_params(hf.model.visual)}


@pytest.fixture(scope="module")
def prompt(spec):
    """Text, image 1, text, image 2, text: the chat template's start/placeholder/end tokens, expanded."""
    v = spec.vision
    processed = preprocess(make_images(), image_config(spec))
    g = torch.Generator().manual_seed(11)
    text = [torch.randint(0, v.image_token_id - 4, (n,), generator=g).tolist() for n in (9, 13, 7)]
    ids = (text[0] + [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + text[1]
           + [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id] + text[2])
    ids = expand_image_placeholders(ids, image_token_counts(processed.grids, 2), v.image_token_id)
    return ids, torch.from_numpy(processed.pixels), processed.grids


def _hf_logits(hf, spec, ids, pixels, grids):
    t = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=t, pixel_values=pixels, image_grid_thw=torch.tensor(grids), use_cache=False,
                  mm_token_type_ids=(t == spec.vision.image_token_id).int()).logits[0]


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def test_positions_equal_hf_rope_index(hf, spec, prompt):
    ids, _, grids = prompt
    t = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(t, (t == spec.vision.image_token_id).int(), torch.tensor(grids))
    ours, our_delta = mrope_positions(ids, grids, spec.vision)
    assert torch.equal(torch.tensor(ours).T, ref[:, 0]) and our_delta == int(delta)
    assert our_delta < 0                                  # images take fewer positions than tokens


def test_mrope_with_equal_axes_is_rope_bit_for_bit(spec):
    at = spec.model.attention
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 4, at.head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
        pos = torch.arange(100, 137, dtype=torch.int32)
        one = PRIMS["rope"].reference(x, pos, rotary_dim=at.rotary_dim, theta=at.rope_theta)
        three = PRIMS["mrope"].reference(x, pos[:, None].expand(-1, 3).contiguous(), rotary_dim=at.rotary_dim,
                                         theta=at.rope_theta, section=spec.vision.mrope_section)
        assert torch.equal(one, three)


def test_text_only_forward_unchanged_by_mrope_positions(spec, params):
    """A text prompt given its positions as three equal axes: the same logits bit for bit as without."""
    ids = torch.randint(0, 500, (1, 20), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    plain, _ = model.forward(EagerOps(), spec, params.__getitem__, ids, model.Batch(1, 20, zero))
    pos3 = torch.arange(20, dtype=torch.int32)[:, None].expand(-1, 3).contiguous()
    three, _ = model.forward(EagerOps(), spec, params.__getitem__, ids, model.Batch(1, 20, zero, mrope=pos3))
    assert torch.equal(plain, three)


def test_logits_with_two_images_equal_hf(hf, spec, params, prompt):
    ids, pixels, grids = prompt
    ref = _hf_logits(hf, spec, ids, pixels, grids)
    ours, _ = multimodal_forward(spec, params, ids, pixels, grids)
    diff = _max_diff(ours, ref)
    print(f"two-image prompt ({len(ids)} tokens, {sum(image_token_counts(grids, 2))} image tokens), reference vs "
          f"HF Qwen3_5ForConditionalGeneration: max |diff| {diff:.2e}, logit std {float(ref.std()):.2f}")
    assert ref.std() > 1.0 and diff <= TOL


def test_images_and_positions_both_matter(hf, spec, params, prompt):
    """Guards against a vacuous pass: 1-D positions, or the placeholders' own embeddings, move the logits."""
    ids, pixels, grids = prompt
    ours, _ = multimodal_forward(spec, params, ids, pixels, grids)
    tokens = torch.tensor([ids], dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    images = encode(spec, params, pixels, grids)
    flat, _ = model.forward(EagerOps(), spec, params.__getitem__, tokens, model.Batch(1, len(ids), zero), images=images)
    pos3 = torch.tensor(mrope_positions(ids, grids, spec.vision)[0], dtype=torch.int32)
    batch = model.Batch(1, len(ids), zero, mrope=pos3)
    no_images, _ = model.forward(EagerOps(), spec, params.__getitem__, tokens, batch)
    assert _max_diff(ours, flat) > 1e-2 and _max_diff(ours, no_images) > 1e-1


@pytest.mark.parametrize("split", [None, 30], ids=["whole", "chunk-splits-image-1"])
def test_traced_prefill_with_images(hf, spec, params, prompt, split):
    """The prefill graph (paged KV, GDN state slots) with image tokens and M-RoPE inputs; in two chunks, the
    first ending inside image 1, each chunk gets the image tokens of its own placeholders and its positions."""
    ids, pixels, grids = prompt
    n = len(ids)
    pools = StatePools(num_pages=math.ceil(n / 64), num_slots=1, pages_per_seq=math.ceil(n / 64), kv_dtype="f32")
    state = {k: torch.zeros(shape, dtype=torch_dtype(dt)) for k, (shape, dt) in state_avals(spec, pools).items()}
    images = encode(spec, params, pixels, grids)
    pos3 = torch.tensor(mrope_positions(ids, grids, spec.vision)[0], dtype=torch.int32)
    is_image = torch.tensor(ids) == spec.vision.image_token_id
    logits = []
    for lo, hi in ([(0, n)] if split is None else [(0, split), (split, n)]):
        first, count = int(is_image[:lo].sum()), int(is_image[lo:hi].sum())
        chunk_images = torch.cat([images[first:first + count], torch.randn(3, images.shape[1])])   # bucket padding
        graph = trace(spec, "prefill", 1, hi - lo, pools, mrope=True, image_tokens=count + 3)
        inputs = {"tokens": torch.tensor([ids[lo:hi]], dtype=torch.int32), "pos": torch.tensor([lo], dtype=torch.int32),
                  "block_table": torch.arange(pools.pages_per_seq, dtype=torch.int32)[None],
                  "slots": torch.zeros(1, dtype=torch.int32), "images": chunk_images, "mrope": pos3[lo:hi]}
        text_params = {k: v for k, v in params.items() if k in graph.weights}
        logits.append(run_graph(graph, inputs, text_params, state)["logits"])
    diff = _max_diff(torch.cat(logits), _hf_logits(hf, spec, ids, pixels, grids))
    print(f"traced prefill ({'whole' if split is None else f'chunks at {split}'}) vs HF: max |diff| {diff:.2e}")
    assert diff <= TOL
    assert "mrope" in str(graph) and "embed_images" in str(graph)


def test_decode_after_images(hf, spec, params, prompt):
    """Decode steps after the prompt: cache position p, RoPE position p + delta on all three axes (the step
    graph with an `mrope` input and no image tokens), against HF's full forward of the longer sequence."""
    ids, pixels, grids = prompt
    n, steps = len(ids), 3
    pages = math.ceil((n + steps) / 64)
    pools = StatePools(num_pages=pages, num_slots=1, pages_per_seq=pages, kv_dtype="f32")
    state = {k: torch.zeros(shape, dtype=torch_dtype(dt)) for k, (shape, dt) in state_avals(spec, pools).items()}
    images = encode(spec, params, pixels, grids)
    pos3, delta = mrope_positions(ids, grids, spec.vision)
    common = {"block_table": torch.arange(pages, dtype=torch.int32)[None], "slots": torch.zeros(1, dtype=torch.int32)}
    prefill = trace(spec, "prefill", 1, n, pools, mrope=True, image_tokens=images.shape[0])
    weights = {k: v for k, v in params.items() if k in prefill.weights}
    out = run_graph(prefill, {**common, "tokens": torch.tensor([ids], dtype=torch.int32),
                              "pos": torch.zeros(1, dtype=torch.int32), "images": images,
                              "mrope": torch.tensor(pos3, dtype=torch.int32)}, weights, state)["logits"]
    step = trace(spec, "step", 1, 1, pools, mrope=True)
    seq, logits = list(ids), []
    for p in range(n, n + steps):
        seq.append(int(out[-1].argmax()))
        out = run_graph(step, {**common, "tokens": torch.tensor([[seq[-1]]], dtype=torch.int32),
                               "pos": torch.tensor([p], dtype=torch.int32),
                               "mrope": torch.tensor([[p + delta] * 3], dtype=torch.int32)}, weights, state)["logits"]
        logits.append(out)
    ref = _hf_logits(hf, spec, seq, pixels, grids)[n:]
    diff = _max_diff(torch.cat(logits), ref)
    print(f"{steps} decode steps after the images vs HF: max |diff| {diff:.2e}")
    assert diff <= TOL


def test_placeholder_errors(spec):
    v = spec.vision
    assert expand_image_placeholders([1, v.image_token_id, 2], [3], v.image_token_id) == [1, *[v.image_token_id] * 3, 2]
    with pytest.raises(ValueError, match="more image placeholders than its 1 images"):
        expand_image_placeholders([1, v.image_token_id, 2, v.image_token_id], [4], v.image_token_id)
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_image_placeholders([1, v.image_token_id], [4, 4], v.image_token_id)
    with pytest.raises(ValueError, match="run of 3 image placeholders at token 1 does not match"):
        mrope_positions([1, *[v.image_token_id] * 3, 2], [(1, 4, 4)], v)
    with pytest.raises(ValueError, match="placeholders for 0 of its 1 images"):
        mrope_positions([1, 2], [(1, 4, 4)], v)
    pools = StatePools(1, 1, 1, kv_dtype="f32")
    with pytest.raises(ValueError, match="needs a spec with a vision section"):
        trace(load_spec(ROOT / "model_specs" / "qwen3.8-tiny.yaml"), "prefill", 1, 8, pools, mrope=True)
    with pytest.raises(ValueError, match="in a prompt's pieces only"):
        trace(spec, "verify", 1, 4, pools, mrope=True, image_tokens=1)
    with pytest.raises(ValueError, match="image_tokens needs mrope"):
        trace(spec, "prefill", 1, 8, pools, image_tokens=4)
