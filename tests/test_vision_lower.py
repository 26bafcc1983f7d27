"""The vision encoder through the compiler on the CPU: its buckets (image-token counts), the fused graph equal to the
traced one, the plans of the tiny-vl and 27B towers with every call bound (the GEMM's bias epilogues, LayerNorm, the
position grid in place, the fused 2-D rotary + segment attention), and the tiny-vl plan run by compiler.emulate
(the families' references over the plan's arena, step inputs and packed weights) equal to the eager encoder bit for
bit, two images of different sizes in one call and one image in a larger bucket."""
from collections import Counter
from pathlib import Path

import pytest
import torch

from compiler.buckets_vision import bucket_for, plan_vision, vision_buckets
from compiler.emulate import run_plan
from compiler.interpret import run_graph
from compiler.kernels import attn_vision, gemm, gemv, module_of
from compiler.kernels.weight_layout import pack_for_device, padded_k, unpack_from_device
from compiler.lower import LoweringError, lower
from compiler.passes_vision import run_vision_pipeline
from compiler.plan import STEP_INPUTS, STEP_TENSORS, Input, Weight, format_plan
from compiler.reference_vision import rope_2d, segment_attention
from compiler.spec import load_spec, vision_tensor_table
from compiler.targets import resolve
from compiler.trace import trace_vision
from compiler.vision_model import encode, encoder_inputs

ROOT = Path(__file__).resolve().parents[1]
TINY_VL = load_spec(ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml")
BIG = load_spec(ROOT / "model_specs" / "qwen3.8-27b.yaml")
RTX3090, H200 = resolve("rtx3090"), resolve("h200")


def tower(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {t.name: (torch.randn(t.shape, generator=g) * 0.1).bfloat16() for t in vision_tensor_table(spec)}
    for name in w:
        if "norm" in name and name.endswith("weight"):
            w[name] = (1 + 0.1 * torch.randn(w[name].shape, generator=g)).bfloat16()
    return w


def test_buckets_are_image_token_counts():
    assert vision_buckets(TINY_VL) == [16, 32, 64, 128, 256, 512, 1024]
    assert vision_buckets(BIG, 3000) == [16, 32, 64, 128, 256, 512, 750]
    assert [bucket_for(n, vision_buckets(BIG)) for n in (1, 16, 17, 1000, 1024)] == [16, 16, 32, 1024, 1024]
    with pytest.raises(ValueError, match="exceeds the largest encoder bucket"):
        bucket_for(1025, vision_buckets(BIG))


def test_fused_graph_equals_the_traced_one_bit_for_bit():
    traced = trace_vision(TINY_VL, 64, 2, "bf16")
    fused = run_vision_pipeline(traced)
    prims = Counter(e.prim for e in fused.eqns)
    assert prims["vision_attention"] == 2 and prims["linear_bias_residual"] == 4 and prims["pos_embed_add"] == 1
    assert not {"gelu", "add", "rope_2d", "segment_attention", "slice"} & set(prims)
    w = tower(TINY_VL)
    coords, cu = encoder_inputs([(1, 4, 6), (1, 6, 4)], 2, 64, 2)
    inputs = {"pixels": torch.randn(64, TINY_VL.vision.patch_dim).bfloat16(), "coords": coords, "cu_seqlens": cu}
    assert torch.equal(run_graph(traced, inputs, w, {})["embeds"], run_graph(fused, inputs, w, {})["embeds"])


def test_unfused_graph_is_refused_with_the_primitive_named():
    with pytest.raises(LoweringError, match="no lowering rule for primitive 'pos_embed_bilinear'"):
        lower(trace_vision(TINY_VL, 64, 1, "bf16"), TINY_VL, RTX3090)


@pytest.mark.parametrize("spec,tokens,images,target", [(TINY_VL, 16, 2, RTX3090), (TINY_VL, 1024, 1, H200),
                                                        (BIG, 16, 1, RTX3090), (BIG, 1024, 1, H200)],
                         ids=["tiny-vl-16x2-3090", "tiny-vl-1024-h200", "27b-16-3090", "27b-1024-h200"])
def test_encoder_plan_binds_every_call(spec, tokens, images, target):
    v = spec.vision
    plan = plan_vision(spec, target, tokens, images)
    patches = tokens * v.merge_unit
    assert plan.shape == ("vision", images, patches)
    assert format_plan(plan).startswith(f"plan {spec.name}.vision entry=vision images={images} patches={patches} ")
    fam = plan.family_counts()
    assert fam == {"gemm": 4 * v.depth + 3, "layernorm": 2 * v.depth + 1, "attn_vision": v.depth, "pos_embed": 1}
    for c in plan.calls:
        names = [p.name for p in module_of(c.key).params(c.key)]
        assert [n for n, _ in c.args] == names, c.key.name
        assert all(b.name in STEP_INPUTS or b.name in STEP_TENSORS for _, b in c.args if isinstance(b, Input))
    epilogues = Counter(c.key.epilogue for c in plan.calls if c.key.family == "gemm")
    # bias: the patch embedding, each block's qkv, the merger's fc2; the blocks' proj and fc2 add the residual
    assert epilogues == {"bias": 2 + v.depth, "bias_residual": 2 * v.depth, "bias_gelu_tanh": v.depth, "bias_gelu": 1}
    assert all(c.key.fmt == "bf16" and c.key.m in (patches, tokens) for c in plan.calls if c.key.family == "gemm")
    weights = {b.name for c in plan.calls for _, b in c.args if isinstance(b, Weight)}
    assert weights == {t.name for t in vision_tensor_table(spec)}
    assert plan.step_inputs() == {"coords": 4 * patches, "cu_seqlens": images + 1}
    assert plan.step_tensors() == {"pixels": ((patches, v.patch_dim), "bf16")}
    assert plan.outputs["embeds"].shape == (tokens, spec.model.hidden_size)
    (attn,) = {c.key for c in plan.calls if c.key.family == "attn_vision"}
    assert (attn.heads, attn.d, attn.m, attn.segments) == (v.num_heads, v.head_dim, patches, images)


def test_27b_tower_needs_the_gemm_k_tail():
    """The 27B's MLP width 4304 is no multiple of 64: fc2 reads a K tail; its planes hold K padded with zeros."""
    plan = plan_vision(BIG, RTX3090, 16)
    assert {c.key.k for c in plan.calls if c.key.family == "gemm" and c.key.k % 64} == {4304}
    w = (torch.randn(40, 4304) * 0.1).bfloat16()
    packed = pack_for_device(w, pad_k=True)
    back = unpack_from_device(packed, "bf16", 40, padded_k("bf16", 4304))
    assert torch.equal(back[:, :4304], w) and not back[:, 4304:].any()


@pytest.mark.parametrize("epilogue", gemv.BIAS_EPILOGUES)
def test_bias_epilogues_round_as_the_reference(epilogue):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(24, 64, generator=g).bfloat16(), (torch.randn(48, 64, generator=g) * 0.2).bfloat16()
    b, res = torch.randn(48, generator=g).bfloat16(), torch.randn(24, 48, generator=g).bfloat16()
    key = gemm.make_key("bf16", 48, 64, 24, RTX3090, epilogue)
    lin = torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16()
    want = {"bias": lin, "bias_residual": res + lin, "bias_gelu": torch.nn.functional.gelu(lin),
            "bias_gelu_tanh": torch.nn.functional.gelu(lin, approximate="tanh")}[epilogue]
    assert torch.equal(gemm.reference(key, x, w, res, bias=b), want)


def test_attn_vision_reference_is_the_primitives():
    g = torch.Generator().manual_seed(2)
    key = attn_vision.Key(4, 16, 64, 2, 0.25, "sm_86")
    qkv = torch.randn(64, 3 * 64, generator=g).bfloat16()
    coords, cu = encoder_inputs([(1, 4, 6), (1, 6, 4)], 2, 64, 2)
    q, k, v = qkv.view(64, 3, 4, 16).unbind(1)
    want = segment_attention(rope_2d(q, coords, theta=1e4), rope_2d(k, coords, theta=1e4), v, cu, scale=0.25)
    got = attn_vision.reference(key, qkv, coords, cu, attn_vision.inv_freq(1e4, 16))
    assert torch.equal(got, want) and not got[48:].any()


@pytest.mark.parametrize("grids,tokens,images", [([(1, 4, 6), (1, 6, 4)], 16, 2), ([(1, 10, 8)], 32, 1)],
                         ids=["two-images", "one-image-padded"])
def test_emulated_plan_equals_the_eager_encoder(grids, tokens, images):
    """The plan's calls, run by their families' references over its arena (NaN where unwritten), equal the eager
    encoder (compiler.vision_model.encode) to one bf16 rounding: the GEMM family's reference multiplies in fp32
    (x.float() @ W.float()) and the eager encoder's bf16 F.linear sums in another order, so a few values (< 1 %;
    measured 0.04 %) land one bf16 ulp apart — 10^4 times below the bf16 encoder's distance from the fp32 one."""
    spec, w = TINY_VL, tower(TINY_VL)
    n = sum(t * h * ww for t, h, ww in grids)
    pixels = torch.randn(n, spec.vision.patch_dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = encode(spec, w, pixels, grids)
    plan = plan_vision(spec, RTX3090, tokens, images)
    patches = tokens * spec.vision.merge_unit
    coords, cu = encoder_inputs(grids, spec.vision.spatial_merge_size, patches, images)
    padded = torch.zeros(patches, spec.vision.patch_dim).bfloat16()
    padded[:n] = pixels
    got = run_plan(plan, {"pixels": padded, "coords": coords, "cu_seqlens": cu}, w)["embeds"]
    assert got.shape == (tokens, spec.model.hidden_size) and not got.isnan().any()
    got = got[:want.shape[0]]
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -20)
    assert (got != want).float().mean() < 0.01


def test_lab_cases_bind_every_encoder_kernel():
    """The GPU tier's cases (lab.cases, lab.cases_vision) pass each encoder kernel its full argument list, and their
    references give every compared output's shape (tiny-vl, two images in the smallest bucket)."""
    from lab.cases import make_case

    for key in plan_vision(TINY_VL, RTX3090, 16, 2).keys():
        case = make_case(key, "cpu")
        assert len(case.launches[-1][1]) == len(module_of(key).params(key)), key.name
        expected = case.reference()
        for name, actual in {**case.outputs, **case.inplace}.items():
            assert expected[name].shape == actual.shape, (key.name, name)


def test_compiled_encoder_knows_no_kernel_family():
    """executor.vision_plan resolves bindings by kind, as executor.executable does."""
    import inspect

    from ninfer_gen.executor import vision_plan

    src = inspect.getsource(vision_plan)
    assert ".family" not in src and "module_of" not in src
