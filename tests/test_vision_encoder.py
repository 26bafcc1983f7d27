"""test_vision_encoder: the vision encoder traced into our IR and run by the reference interpreter against HF's
Qwen3_5VisionModel (fp32, CPU, tiny random tower, two images of different sizes in one call), the eager program,
padded buckets, each new primitive's reference against plain torch, and the graph's stable text.
"""
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from compiler.interpret import run_graph
from compiler.ir import AVal
from compiler.prims import PRIMS
from compiler.spec import load_spec
from compiler.trace import trace_vision
from compiler.vision_model import encode, encoder_inputs
from ninfer_gen.vision.preprocess import preprocess
from vision_fixtures import hf_config, image_config, make_images, randomize_vision_, vision_params

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-4


@pytest.fixture(scope="module")
def spec():
    return load_spec(ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml")


@pytest.fixture(scope="module")
def tower(spec):
    with torch.random.fork_rng():
        model = Qwen3_5VisionModel(hf_config(spec).vision_config).float().eval()
    randomize_vision_(model, seed=3)
    return model


@pytest.fixture(scope="module")
def batch(spec):
    processed = preprocess(make_images(), image_config(spec))
    assert len(set(processed.grids)) == 2            # two different sizes, in one call
    return torch.from_numpy(processed.pixels), processed.grids


@pytest.fixture(scope="module")
def hf_out(tower, batch):
    pixels, grids = batch
    with torch.no_grad():
        return tower(pixels, grid_thw=torch.tensor(grids)).pooler_output


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def test_hf_output_is_not_flat(hf_out):
    """O(1) weights: the tower's output varies by O(1), so 1e-4 is a real test."""
    assert hf_out.std() > 0.3 and hf_out.shape[1] == 128


def test_traced_graph_equals_hf(spec, tower, batch, hf_out):
    pixels, grids = batch
    n = pixels.shape[0]
    graph = trace_vision(spec, n, len(grids))
    coords, cu = encoder_inputs(grids, spec.vision.spatial_merge_size)
    out = run_graph(graph, {"pixels": pixels, "coords": coords, "cu_seqlens": cu}, vision_params(tower), {})["embeds"]
    diff = _max_diff(out, hf_out)
    print(f"vision encoder, graph vs HF: max |diff| {diff:.2e} over {tuple(out.shape)}")
    assert diff <= TOL


def test_eager_equals_graph(spec, tower, batch):
    pixels, grids = batch
    eager = encode(spec, vision_params(tower), pixels, grids)
    coords, cu = encoder_inputs(grids, spec.vision.spatial_merge_size)
    graph = run_graph(trace_vision(spec, pixels.shape[0], len(grids)),
                      {"pixels": pixels, "coords": coords, "cu_seqlens": cu}, vision_params(tower), {})["embeds"]
    assert torch.equal(eager, graph)


def test_padded_bucket(spec, tower, batch, hf_out):
    """A bucket larger than the call (more patch rows, more image slots): the real tokens are unchanged."""
    pixels, grids = batch
    n, extra = pixels.shape[0], 4 * 6
    padded = torch.cat([pixels, torch.randn(extra, pixels.shape[1])])
    coords, cu = encoder_inputs(grids, spec.vision.spatial_merge_size, patches=n + extra, images=4)
    assert cu.tolist()[-3:] == [n, n, n] and coords[n:].abs().sum() == 0
    out = run_graph(trace_vision(spec, n + extra, 4), {"pixels": padded, "coords": coords, "cu_seqlens": cu},
                    vision_params(tower), {})["embeds"]
    assert _max_diff(out[: n // 4], hf_out) <= TOL


def test_images_do_not_see_each_other(spec, tower, batch):
    """Attention stays within an image: encoding the second image alone gives its tokens of the pair."""
    pixels, grids = batch
    first = grids[0][1] * grids[0][2]
    pair = encode(spec, vision_params(tower), pixels, grids)
    alone = encode(spec, vision_params(tower), pixels[first:], grids[1:])
    assert _max_diff(pair[first // 4:], alone) <= 1e-5


def test_encoder_inputs_match_hf_geometry(spec):
    """coords rows/cols are HF's rotary position ids; cu_seqlens HF's segment bounds."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids
    grids = [(1, 4, 6), (1, 8, 2)]
    coords, cu = encoder_inputs(grids, 2)
    thw = torch.tensor(grids)
    assert torch.equal(coords[:, :2].long(), get_vision_position_ids(thw, 2))
    assert cu.tolist() == get_vision_cu_seqlens(thw).tolist()
    with pytest.raises(ValueError, match="do not fit a bucket"):
        encoder_inputs(grids, 2, patches=10)
    with pytest.raises(ValueError, match="one frame"):
        encoder_inputs([(2, 4, 4)], 2)


def test_golden_text(spec):
    text = str(trace_vision(spec, 64, 2, act_dtype="bf16")) + "\n"
    path = GOLDEN / "qwen3.8-tiny-vl.vision.p64i2.txt"
    if os.environ.get("NINFER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; regenerate with NINFER_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"graph text changed for {path.name}"
    assert str(trace_vision(spec, 64, 2, act_dtype="bf16")) + "\n" == text


def test_trace_errors(spec):
    with pytest.raises(ValueError, match="positive multiple of 4"):
        trace_vision(spec, 30, 1)
    with pytest.raises(ValueError, match="no vision section"):
        trace_vision(load_spec(ROOT / "model_specs" / "qwen3.8-tiny.yaml"), 64, 1)


# ---------------------------------------------------------------- the new primitives, one by one

def _ref(name, *args, **params):
    return PRIMS[name].reference(*args, **params)


def test_prim_linear_bias_layernorm_gelu():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)
    assert torch.allclose(_ref("linear_bias", x, w, b), x @ w.T + b, atol=1e-6)
    nw, nb = torch.randn(8, generator=g), torch.randn(8, generator=g)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mu) / torch.sqrt(var + 1e-6) * nw + nb
    assert torch.allclose(_ref("layernorm", x, nw, nb, eps=1e-6), expected, atol=1e-5)
    tanh = 0.5 * x * (1 + torch.tanh((2 / np.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    assert torch.allclose(_ref("gelu", x, approximate="tanh"), tanh, atol=1e-6)
    assert torch.allclose(_ref("gelu", x, approximate="none"), 0.5 * x * (1 + torch.erf(x / 2 ** 0.5)), atol=1e-6)
    rule = PRIMS["linear_bias"].shape_rule
    assert rule(AVal((5, 8), "f32"), AVal((3, 8), "f32"), AVal((3,), "f32")) == [AVal((5, 3), "f32")]
    with pytest.raises(TypeError, match="linear_bias"):
        PRIMS["linear_bias"].shape_rule(AVal((5, 8), "f32"), AVal((3, 8), "f32"), AVal((4,), "f32"))
    with pytest.raises(TypeError, match="approximate"):
        PRIMS["gelu"].shape_rule(AVal((5, 8), "f32"), approximate="fast")


def test_prim_pos_embed_bilinear_is_interpolate():
    """Each image's resampled grid equals F.interpolate(bilinear, align_corners=True) of the table."""
    side, hidden = 5, 3
    table = torch.randn(side * side, hidden)
    grids = [(1, 4, 6), (1, 2, 2)]
    coords, _ = encoder_inputs(grids, 2, patches=28)
    out = _ref("pos_embed_bilinear", table, coords, side=side, dtype="f32")
    image = table.T.reshape(1, hidden, side, side)
    start = 0
    for _, h, w in grids:
        full = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)[0]   # [hidden, h, w]
        rows = coords[start:start + h * w].long()
        assert torch.allclose(out[start:start + h * w], full[:, rows[:, 0], rows[:, 1]].T, atol=1e-6)
        start += h * w
    assert out[start:].abs().sum() == 0                      # padding rows


def test_prim_rope_2d_rotates_pairs_by_row_and_column():
    """Dims i and i + D/2 rotate together by angle row·f_i (i < D/4) or col·f_(i − D/4): norms are kept and the
    angle is exact for a unit vector."""
    d, theta = 8, 100.0
    coords = torch.tensor([[3, 5, 4, 6]], dtype=torch.int32)
    freqs = 1.0 / theta ** (torch.arange(0, d // 2, 2).float() / (d // 2))
    angles = torch.cat([3 * freqs, 5 * freqs])
    for i in range(d // 2):
        x = torch.zeros(1, 1, d)
        x[0, 0, i] = 1.0
        y = _ref("rope_2d", x, coords, theta=theta)[0, 0]
        assert torch.allclose(y[i], angles[i].cos(), atol=1e-6)
        assert torch.allclose(y[i + d // 2], angles[i].sin(), atol=1e-6)


def test_prim_segment_attention_is_blockwise_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 2, 4, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 6, 6], dtype=torch.int32)
    out = _ref("segment_attention", q, k, v, cu, scale=0.5)
    for lo, hi in ((0, 3), (3, 6)):
        p = torch.softmax(torch.einsum("qhd,khd->hqk", q[lo:hi], k[lo:hi]) * 0.5, -1)
        assert torch.allclose(out[lo:hi], torch.einsum("hqk,khd->qhd", p, v[lo:hi]), atol=1e-6)
    assert out[6:].abs().sum() == 0


def test_bf16_runs_close(spec, tower, batch, hf_out):
    """bf16 activations and weights (the tower's recipe row): the same graph, within bf16 rounding."""
    pixels, grids = batch
    coords, cu = encoder_inputs(grids, spec.vision.spatial_merge_size)
    params = {k: v.bfloat16() for k, v in vision_params(tower).items()}
    out = run_graph(trace_vision(spec, pixels.shape[0], len(grids), act_dtype="bf16"),
                    {"pixels": pixels.bfloat16(), "coords": coords, "cu_seqlens": cu}, params, {})["embeds"]
    assert out.dtype == torch.bfloat16 and _max_diff(out, hf_out) <= 0.05 * float(hf_out.abs().max())
