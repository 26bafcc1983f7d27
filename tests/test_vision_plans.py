"""test_vision_plans: the GPU side of prompts with images, on the CPU — an images profile's plans (every entry but
the fold reads M-RoPE positions, a prompt's pieces take image tokens with a count), its rounds (the round kernels
write the next entry's M-RoPE positions), the step inputs the host fills (positions of a lane with images, the
image tokens of a piece) and the memory plan's vision part. Text profiles stay as they were. The NVRTC build uses
the session's kernel cache (tests/conftest.py).
"""
from pathlib import Path

import pytest
import torch

from compiler.buckets import plan_bucket, plan_rounds, profile_of
from compiler.multimodal import RopePositions
from compiler.plan import BucketInput, Input, NULL
from compiler.spec import load_spec
from compiler.targets import TARGETS
from ninfer_gen.executor.device_state import StepInputs
from ninfer_gen.executor.memory_plan import GiB, plan_memory, vision_bytes

ROOT = Path(__file__).resolve().parents[1]
TINY_VL = load_spec(ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml")
BIG = load_spec(ROOT / "model_specs" / "qwen3.8-27b.yaml")
T3090 = TARGETS["rtx3090"]


def _args(plan, family):
    return [dict(c.args) for c in plan.calls if c.key.family == family]


@pytest.mark.parametrize("spec", [TINY_VL, BIG], ids=["tiny-vl", "27b"])
def test_an_images_profile_reads_mrope_everywhere_and_images_in_prompt_pieces(spec):
    images, text = profile_of(spec, cohorts=(1, 2), images=True), profile_of(spec, cohorts=(1, 2))
    for shape in images.shapes():
        entry, b, t = shape
        plan, base = plan_bucket(spec, T3090, *shape, images), plan_bucket(spec, T3090, *shape, text)
        piece = entry in ("prefill", "step") and b == 1
        ropes = _args(plan, "qk_rope_kv")
        if entry.split(".")[0] == "commit":     # commit, commit.rec1 (fold_in_verify's second record set)
            assert plan.keys() == base.keys()
            continue
        assert ropes and all(a["rope_pos"] == Input("mrope") and a["pos"] == Input("row_pos") for a in ropes)
        assert all(c.key.mrope == spec.vision.mrope_section for c in plan.calls if c.key.family == "qk_rope_kv")
        assert "mrope" in plan.step_inputs()
        assert ("images" in plan.step_tensors()) == piece
        assert plan.family_counts()["embed_images"] == int(piece)
        assert plan.launches == base.launches + int(piece)       # the same kernels otherwise, M-RoPE keyed
        if piece:
            (a,) = _args(plan, "embed_images")
            assert a["count"] == Input("image_count") and plan.step_tensors()["images"][0] == (t, spec.model.hidden_size)
        assert all(not c.key.mrope for c in base.calls if c.key.family == "qk_rope_kv")
        assert "mrope" not in base.step_inputs() and "images" not in base.step_tensors()


def test_rounds_write_the_next_entrys_mrope_positions():
    spec = TINY_VL
    for images in (True, False):
        rounds = plan_rounds(spec, T3090, profile_of(spec, cohorts=(1, 2), images=images))
        for rp in rounds.values():
            writers = [dict(s.args) for s in rp.steps if hasattr(s, "key") and s.key.family == "spec_round"
                       and s.key.stage in ("begin", "accept", "draft")]
            bound = [a["in_mrope"] for a in writers if a["in_tokens"] is not NULL]
            assert bound and all(isinstance(b, BucketInput) == images and (b.name == "mrope" if images else b is NULL)
                                 for b in bound)


def test_step_inputs_carry_a_lanes_positions_and_a_pieces_images():
    plan = plan_bucket(TINY_VL, T3090, "step", 1, 4, profile_of(TINY_VL, cohorts=(1, 2), images=True))
    inputs = StepInputs(1, 4, plan.max_pages, 99, "cpu", plan.step_tensors(), plan.step_inputs())
    rope = RopePositions([(0, 0, 0), (1, 1, 1), (1, 2, 3), (1, 2, 4)], -1)
    inputs.set([[5, 508, 508, 7]], [2], [[0]], [0], [rope])
    got = inputs.views["mrope"].view(4, 3).tolist()
    assert got == [[1, 2, 3], [1, 2, 4], [3, 3, 3], [4, 4, 4]]          # prompt rows 2, 3, then 4 + delta …
    assert inputs.views["image_count"].item() == 0
    rows = torch.randn(2, TINY_VL.model.hidden_size).bfloat16()
    inputs.set_images(rows)
    assert inputs.views["image_count"].item() == 2 and torch.equal(inputs.tensors["images"][:2], rows)
    inputs.set([[5, 6, 7, 8]], [10], [[0]], [0])                          # a text row: three equal axes
    assert inputs.views["mrope"].view(4, 3).tolist() == [[p] * 3 for p in range(10, 14)]
    assert inputs.views["image_count"].item() == 0
    with pytest.raises(Exception, match="exceed"):
        inputs.set_images(torch.zeros(5, TINY_VL.model.hidden_size))
    text_plan = plan_bucket(TINY_VL, T3090, "step", 1, 4, profile_of(TINY_VL, cohorts=(1, 2)))
    text = StepInputs(1, 4, text_plan.max_pages, 99, "cpu", text_plan.step_tensors(), text_plan.step_inputs())
    assert "mrope" not in text.views and text.host.numel() < inputs.host.numel()


def test_memory_plan_counts_the_tower_and_one_image():
    tower = vision_bytes(BIG, 4096)
    assert 0.8 * GiB < tower < 1.3 * GiB and vision_bytes(BIG, 16384) > tower and vision_bytes(BIG, 0) == 0
    base = plan_memory(BIG, 8, 16384, 24 * GiB, kv_pool_tokens=100_000)
    plan = plan_memory(BIG, 8, 16384, 24 * GiB, kv_pool_tokens=100_000, vision_patches=4096)
    assert plan.vision == tower and plan.kv_pool == base.kv_pool - tower and plan.peak <= 24 * GiB
    assert any("vision tower" in name and size == tower for name, size in plan.rows())
    room = plan_memory(BIG, 8, 16384, 24 * GiB, kv_pool_tokens=16384, vision_patches=4096)
    full = plan_memory(BIG, 8, 16384, 24 * GiB, kv_pool_tokens=room.kv_pages * 64, vision_patches=4096)
    assert full.kv_pages == room.kv_pages and full.peak <= 24 * GiB    # the largest pool, its trash page included
    print(f"\n27B, C8 × 16K with the tower and one 4,096-patch image: a shared pool of {room.kv_pages * 64:,} tokens, "
          f"planned peak {full.peak / GiB:.3f} GiB")


def images_keys(target: str) -> list:
    """The keys an images profile adds or changes: M-RoPE qk_rope_kv, embed_images, the round kernels that write
    the next entry's M-RoPE positions."""
    from compiler.buckets import plan_profile, profile_keys

    profile, t = profile_of(TINY_VL, cohorts=(1, 2), images=True), TARGETS[target]
    return [k for k in profile_keys(plan_profile(TINY_VL, t, profile), plan_rounds(TINY_VL, t, profile))
            if k.family in ("qk_rope_kv", "embed_images", "spec_round")]


@pytest.mark.prebuild(keys=images_keys)
@pytest.mark.parametrize("target", ["rtx3090", "h200"])
def test_the_images_profiles_new_kernels_compile_without_spills(target, kernel_cache):
    """`images_keys` compile with NVRTC (no GPU needed) and spill nothing."""
    from compiler.build_cache import build_kernels

    keys = images_keys(target)
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    # every key built once (none twice), compiled here or earlier in the session from the same source
    assert summary.kernels == len(keys) == len(summary.built) and summary.spills == 0, summary.table()
    assert {k.family for k in keys} == {"qk_rope_kv", "embed_images", "spec_round"}


def test_the_snapshot_state_mode_takes_images_too():
    """The comparison build (K+1 state copies instead of ReplaySSM records) plans its verify with M-RoPE as well."""
    profile = profile_of(TINY_VL, cohorts=(1, 2), images=True, snapshots=True)
    verify = plan_bucket(TINY_VL, T3090, "verify", 2, profile.tail_tokens, profile)
    assert "mrope" in verify.step_inputs() and plan_rounds(TINY_VL, T3090, profile)


def test_the_memory_plan_counts_the_compiled_encoder_as_it_holds_it():
    """executor.vision_plan.encoder_bytes (what a load with vision_kernels plans for the tower) equals the packed
    planes and arena the encoder builds (tiny-vl, counted on the CPU), and the 27B's fits the torch tower's part."""
    from compiler.buckets_vision import plan_vision, vision_buckets
    from compiler.emulate import weight_planes
    from compiler.spec import load_spec, vision_tensor_table
    from compiler.targets import lookup
    from ninfer_gen.executor.memory_plan import GiB, plan_memory, vision_bytes
    from ninfer_gen.executor.vision_plan import encoder_bytes

    target = lookup("h200")
    spec = load_spec(ROOT / "model_specs/qwen3.8-tiny-vl.yaml")
    tensors = {t.name: torch.zeros(t.shape, dtype=torch.bfloat16) for t in vision_tensor_table(spec)}
    plans = [plan_vision(spec, target, t) for t in vision_buckets(spec, 1024)]
    held = sum(v.numel() * v.element_size() for v in weight_planes(plans[-1], tensors).values())
    assert encoder_bytes(spec, target, 1024) == held + max(p.arena_bytes for p in plans)
    big = load_spec(ROOT / "model_specs/qwen3.8-27b.yaml")
    compiled, torch_tower = vision_bytes(big, 4096, target), vision_bytes(big, 4096)
    assert 0.85 * GiB < compiled < torch_tower
    plan = plan_memory(big, 8, 16384, 24 * GiB, kv_pool_tokens=8 * 16384 // 2, vision_patches=4096,
                       vision_target=target)
    assert plan.vision == compiled
