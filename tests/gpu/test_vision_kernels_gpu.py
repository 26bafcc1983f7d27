"""GPU tier for the kernels of prompts with images: qk_rope_kv with M-RoPE against its torch reference (int8 and
bf16 pages) and, when a row's three positions are equal, bit for bit the 1-D kernel's q_out and pages;
embed_images bit for bit against its reference (all placeholders filled, a short `count`, none, past `cap`).
Run: pytest -m gpu tests/gpu/test_vision_kernels_gpu.py -q"""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compiler.buckets import profile_of
from compiler.kernels import embed_images, qk_rope_kv
from compiler.spec import load_spec
from harness import TARGET
from lab.cases import Case, make_case

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SPECS = {name: load_spec(ROOT / f"model_specs/qwen3.8-{name}.yaml") for name in ("27b", "tiny-vl")}


def _rope_keys() -> list:
    keys = []
    for spec in SPECS.values():
        at, profile = spec.model.attention, profile_of(spec)
        keys += [qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, b, t, kv, profile.page_size,
                                profile.pages_per_seq, spec.model.rms_norm_eps, TARGET.arch,
                                mrope=spec.vision.mrope_section)
                 for b, t in ((1, 1), (2, 4), (1, 256)) for kv in ("int8", "bf16")]
    return keys


ROPE = _rope_keys()
# (h, m, cap, token): one row, the 27B's prefill chunk, tiny-vl's, and more placeholders than cap
EMBED = [embed_images.Key(h, m, cap, SPECS[name].vision.image_token_id, TARGET.arch)
         for name, h, m, cap in (("27b", 5120, 1, 1), ("27b", 5120, 4096, 4096), ("tiny-vl", 128, 256, 256),
                                 ("tiny-vl", 128, 300, 16))]


@pytest.fixture(scope="session")
def h():
    import harness
    harness.build(ROPE + [replace(k, mrope=()) for k in ROPE] + EMBED)
    return harness


def _restore(pages: dict, pages0: dict) -> None:
    for name, t in pages.items():
        t.copy_(pages0[name])


@pytest.mark.parametrize("key", ROPE, ids=[k.name for k in ROPE])
def test_mrope_rope_kv(h, key):
    """Equal axes: the 1-D kernel's bits in q_out and every page; distinct axes: the reference."""
    case = make_case(replace(key, mrope=()), "cuda", 1)       # the 1-D kernel's inputs and argument list
    (_, args), = case.launches
    q_out, pages, pos = case.outputs["q_out"], case.inplace, args[7]
    pages0 = {name: t.clone() for name, t in pages.items()}
    h.run(case)
    one_d = {"q_out": q_out.clone()} | {name: t.clone() for name, t in pages.items()}

    _restore(pages, pages0)
    q_out.fill_(float("nan"))
    h.launch_key(key, qk_rope_kv, args + [pos.view(-1, 1).expand(-1, 3).contiguous()])
    torch.cuda.synchronize()
    for name, t in ({"q_out": q_out} | pages).items():
        assert h.same_bits(t, one_d[name]), f"{key.name}: {name} differs from the 1-D kernel's with equal axes"

    _restore(pages, pages0)
    g = torch.Generator(device="cuda").manual_seed(2)
    rope_pos = torch.randint(0, 8192, (key.b * key.t, 3), generator=g, device="cuda", dtype=torch.int32)
    start = {name[len("pages_"):]: t for name, t in pages0.items()}

    def ref():
        qo, pr = qk_rope_kv.reference(key, *args[1:9], start, rope_pos=rope_pos)
        return {"q_out": qo} | {"pages_" + name: t for name, t in pr.items()}
    mcase = Case([(key, args + [rope_pos])], {"q_out": q_out}, pages, ref, case.tol)
    h.run(mcase)
    h.compare(mcase, key.name)
    assert not torch.equal(q_out, one_d["q_out"]), f"{key.name}: rope_pos did not change the rotation"


@pytest.mark.parametrize("key", EMBED, ids=[k.name for k in EMBED])
def test_embed_images(h, key):
    """Placeholders ~30 % of the rows (row 0 one of them); `count` null (cap), every placeholder, half, none."""
    g = torch.Generator(device="cuda").manual_seed(3)
    y0 = torch.randn(key.m, key.h, generator=g, device="cuda").bfloat16()
    ids = torch.randint(0, 512, (key.m,), generator=g, device="cuda", dtype=torch.int32)
    ids[torch.rand(key.m, generator=g, device="cuda") < 0.3] = key.token
    ids[0] = key.token
    images = torch.randn(key.cap, key.h, generator=g, device="cuda").bfloat16()
    placeholders = int((ids == key.token).sum())
    for count in (None, placeholders, placeholders // 2, 0):
        c = None if count is None else torch.tensor([count], device="cuda", dtype=torch.int32)
        y = y0.clone()
        h.launch_key(key, embed_images, [y, ids, images, c])
        torch.cuda.synchronize()
        want = embed_images.reference(key, y0, ids, images, c)
        assert h.same_bits(y, want), f"{key.name}, count {count}: {(y != want).any(1).sum()} rows differ"
