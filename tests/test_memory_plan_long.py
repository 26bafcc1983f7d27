"""The 24 GiB memory plan at long context (issue 31) on the CPU, 27B spec, INT8 KV: one lane × 131,072 tokens
with K = 3 fits with a planned device peak ≤ 23.5 GiB, C2 × 64K and C4 × 32K fit, C8 × 128K is refused with
the plan's message; the block table of a 128K lane is 2,048 pages and every kernel's int32 index expression
stays in range for the plans of that context."""
import pytest

from compiler.buckets import plan_bucket, profile_of
from compiler.spec import load_spec
from compiler.targets import lookup
from ninfer_gen.api import REPO
from ninfer_gen.executor.memory_plan import GiB, MemoryPlanError, kv_pool_pages, plan_memory

BIG = load_spec(REPO / "model_specs" / "qwen3.8-27b.yaml")
BUDGET = 24 * GiB
PEAK_LIMIT = 23.5 * GiB          # the acceptance: planned (and measured) device peak
KIB_PER_TOKEN = 35.1             # 16 attention layers + the MTP layer, INT8-G64 K and V with fp16 scales


def test_one_lane_of_128k_with_three_drafts_fits_24gib():
    plan = plan_memory(BIG, cohort=1, max_context=131072, budget=BUDGET, draft=3)
    assert plan.kv_dtype == "int8" and plan.draft_tokens == 3 and plan.total == BUDGET
    assert plan.kv_bytes_per_token / 1024 == pytest.approx(KIB_PER_TOKEN, abs=0.05)
    assert plan.kv_tokens >= 131072
    assert plan.used_kv_pages == 131072 // 64 + 1                     # the lane's 2,048 pages + the trash page
    kv = plan.used_kv_pages * plan.page_size * plan.kv_bytes_per_token
    assert kv == pytest.approx(4.39 * GiB, rel=0.01)                 # the 4.4 GiB at 128K
    assert plan.peak == plan.total - plan.kv_pool + kv
    assert plan.peak <= PEAK_LIMIT, f"planned peak {plan.peak / GiB:.3f} GiB"
    assert 16.0 * GiB < plan.weights < 16.2 * GiB
    assert plan.to_json()["peak"] == plan.peak and plan.to_json()["kv_pool_tokens"] is None


@pytest.mark.parametrize("cohort, context", [(2, 65536), (4, 32768)])
def test_fewer_tokens_per_lane_fit_more_lanes(cohort, context):
    plan = plan_memory(BIG, cohort=cohort, max_context=context, budget=BUDGET, draft=3)
    assert plan.kv_tokens >= cohort * context
    assert plan.used_kv_pages == cohort * context // 64 + 1
    assert plan.peak <= PEAK_LIMIT, f"C{cohort} × {context}: planned peak {plan.peak / GiB:.3f} GiB"


def test_eight_lanes_of_128k_are_refused_with_the_plans_message():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(BIG, cohort=8, max_context=131072, budget=BUDGET, draft=3)
    msg = str(err.value)
    assert "does not fit in 24.00 GiB" in msg and "weights 16.11 GiB" in msg
    assert "8 lane(s) × 131072 tokens need 35.06 GiB" in msg and "35.1 KiB per token" in msg
    assert "Lower --max-context or --cohorts, or raise --vram-budget" in msg


def test_a_shared_pool_peak_counts_the_pool_not_every_lanes_context():
    shared = plan_memory(BIG, cohort=4, max_context=131072, budget=BUDGET, draft=3, kv_pool_tokens=131072)
    assert shared.used_kv_pages == kv_pool_pages(4, 131072, 64, 131072) + 1 == 2049
    assert shared.peak <= PEAK_LIMIT


def test_a_128k_profile_has_a_2048_page_block_table():
    profile = profile_of(BIG, cohorts=(1,), draft=3, max_context=131072)
    assert profile.pages_per_seq == 2048 and profile.prefill_chunk == 4096


INT32_MAX = 2 ** 31 - 1


def _int32_extents(key) -> dict[str, int]:
    """The largest value of each index expression the key's template computes in `int` (not size_t) at the
    key's block-table width: templates/qk_rope_kv, attn_decode, attn_combine, attn_prefill and spec_round."""
    positions = key.max_pages * key.page                       # a row's positions 0 … positions − 1
    out = {"position": positions, "fp32 position exact below 2^24": positions}
    if key.family == "qk_rope_kv":
        out["block_table[(row / T) * MAXP + p / PAGE]"] = key.b * key.max_pages
    if key.family == "attn_decode":
        tt = key.page if key.kv_dtype == "int8" else key.page // 2
        out["tile * TT + tok (kpos)"] = key.max_pages * (key.page // tt) * tt
        out["pg0 * SUBS (tile index)"] = key.max_pages * (key.page // tt)
    if key.family == "attn_prefill":
        out["(kt + 2) * TK"] = (positions // key.tk + 2) * key.tk
        out["GROUP * T (flattened query rows)"] = key.hq // key.hkv * key.t
    return out


@pytest.mark.parametrize("entry, batch, tokens", [("step", 1, 1), ("verify", 1, 4), ("step", 8, 1),
                                                  ("prefill", 1, 4096)])
def test_kernel_index_math_holds_131072_positions(entry, batch, tokens):
    """Every paged key the 128K plans launch: its int32 expressions fit, positions are exact in fp32 (the
    RoPE angle is fp32(pos) · inv_freq), and the row's pages are addressed by a 2,048-wide block table."""
    target = lookup("sm_86")
    profile = profile_of(BIG, cohorts=(1, 8), draft=3, max_context=131072)
    plan = plan_bucket(BIG, target, entry, batch, tokens, profile)
    paged = [c.key for c in plan.calls if hasattr(c.key, "max_pages")]
    assert paged, f"{entry} {batch}×{tokens}: no paged kernel in the plan"
    for key in paged:
        assert key.max_pages == 2048, key.name
        for what, value in _int32_extents(key).items():
            limit = 2 ** 24 if what.startswith("fp32") else INT32_MAX
            assert value <= limit, f"{key.name}: {what} reaches {value}"
    decode = [k for k in paged if k.family == "attn_decode"]
    for key in decode:                        # the split rule gives every split at least one page at 128K
        assert 1 <= key.splits <= key.max_pages and -(-key.max_pages // key.splits) * key.splits >= key.max_pages


def test_a_plan_held_back_by_prefix_checkpoints_names_the_option():
    """Session 18's agent bench (4 sessions × 32K, 16 prefix checkpoints: 2.29 GiB of GDN states) did not fit and the
    message named only --max-context, --cohorts and --vram-budget; with checkpoints in the plan it names
    --prefix-cache too, and 8 checkpoints fit."""
    pool = 4 * 34816
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(BIG, cohort=4, max_context=34816, budget=BUDGET, draft=3, kv_pool_tokens=pool, prefix_states=16)
    assert "keep fewer than 16 prefix checkpoints (--prefix-cache)" in str(err.value)
    plan_memory(BIG, cohort=4, max_context=34816, budget=BUDGET, draft=3, kv_pool_tokens=pool, prefix_states=8)
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(BIG, cohort=8, max_context=131072, budget=BUDGET, draft=3)
    assert "--prefix-cache" not in str(err.value)
