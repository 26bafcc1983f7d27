"""CPU logic of the runtime: block manager, state-slot allocator, memory plan."""
from pathlib import Path

import pytest

from compiler.spec import load_spec
from ninfer_gen.cli import main
from ninfer_gen.allocators.kv import BlockManager, BlockTable, OutOfPages
from ninfer_gen.executor.memory_plan import GiB, MemoryPlanError, kv_pool_pages, parse_bytes, plan_memory
from ninfer_gen.allocators.slots import OutOfSlots, SlotAllocator

SPECS = Path(__file__).parent.parent / "model_specs"
BIG = load_spec(SPECS / "qwen3.8-27b.yaml")


def test_reserve_trim_free_accounting():
    bm = BlockManager(num_pages=8, page_size=64)
    t = BlockTable()
    bm.reserve(t, 130)
    assert len(t.pages) == 3 and bm.free_pages == 5
    t.length = 130
    bm.trim(t, 64)  # rejected drafts past token 64 roll back
    assert len(t.pages) == 1 and t.length == 64 and bm.free_pages == 7
    with pytest.raises(ValueError, match="holds 64"):
        bm.trim(t, 65)
    bm.free(t)
    assert bm.free_pages == 8 and t.pages == []


def test_out_of_pages_is_all_or_nothing():
    bm = BlockManager(num_pages=2, page_size=64)
    t = BlockTable()
    with pytest.raises(OutOfPages, match="need 3 more KV pages, 2 free"):
        bm.reserve(t, 150)
    assert bm.free_pages == 2 and t.pages == []


def test_prefix_pages_are_shared_with_reference_counts():
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(10))
    a = BlockTable()
    bm.reserve(a, len(prompt))
    a.length = len(prompt)
    bm.register_prefix(a, prompt)
    b = bm.match_prefix(prompt[:8] + [99, 98, 97])
    assert b.pages == a.pages[:2] and b.length == 8  # two full pages shared, the partial one is not
    assert bm.refcount(a.pages[0]) == 2
    bm.free(a)
    assert bm.refcount(b.pages[0]) == 1 and bm.free_pages == 8 - 2
    assert bm.match_prefix([7] * 10).pages == []  # different tokens share nothing


def test_freed_prefix_page_can_be_revived_until_reused():
    bm = BlockManager(num_pages=2, page_size=4)
    a = BlockTable()
    bm.reserve(a, 4)
    bm.register_prefix(a, [1, 2, 3, 4])
    page = a.pages[0]
    bm.free(a)
    again = bm.match_prefix([1, 2, 3, 4, 5])
    assert again.pages == [page] and bm.refcount(page) == 1 and bm.free_pages == 1


def test_slots_are_distinct_and_checked():
    slots = SlotAllocator(2)
    a, b = slots.allocate(), slots.allocate()
    assert a != b
    with pytest.raises(OutOfSlots, match="all 2 state slots"):
        slots.allocate()
    slots.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(a)
    assert slots.allocate() == a


def test_27b_plan_fits_24gib_at_8_lanes_16k():
    plan = plan_memory(BIG, cohort=8, max_context=16384, budget=24 * GiB)
    assert plan.total <= 24 * GiB
    assert 16.0 * GiB < plan.weights < 16.2 * GiB
    assert plan.state_slots == 8 * (150994944 + 2949120)
    assert plan.kv_tokens >= 8 * 16384


def test_27b_plan_with_a_shared_kv_pool():
    """C8 sharing one 16K-token pool (the reference engine's setting) needs far less than C8 × 16K each."""
    shared = plan_memory(BIG, cohort=8, max_context=16384, budget=24 * GiB, kv_pool_tokens=16384)
    assert kv_pool_pages(8, 16384, shared.page_size, 16384) * shared.page_size == 16384
    assert kv_pool_pages(8, 16384, shared.page_size) == 8 * kv_pool_pages(1, 16384, shared.page_size)
    with pytest.raises(MemoryPlanError, match="cannot hold one lane's context"):
        plan_memory(BIG, cohort=8, max_context=32768, budget=24 * GiB, kv_pool_tokens=16384)
    with pytest.raises(MemoryPlanError, match="a shared pool of 900000 tokens"):
        plan_memory(BIG, cohort=8, max_context=16384, budget=24 * GiB, kv_pool_tokens=900000)


def test_27b_plan_overflow_names_the_parts():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(BIG, cohort=8, max_context=32768, budget=24 * GiB)
    msg = str(err.value)
    assert "does not fit in 24.00 GiB" in msg and "weights 16.11 GiB" in msg and "8 lane(s) × 32768" in msg


@pytest.mark.parametrize("text,value", [("24GiB", 24 * GiB), ("22 GB", 22 * 10 ** 9), ("512MiB", 512 * 2 ** 20),
                                        ("1000", 1000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_plan_cli_json_and_error(capsys):
    assert main(["plan", str(SPECS / "qwen3.8-27b.yaml"), "--cohorts", "1", "--json"]) == 0
    assert '"kv_tokens"' in capsys.readouterr().out
    assert main(["plan", str(SPECS / "qwen3.8-27b.yaml"), "--vram-budget", "16GiB"]) == 2
    assert capsys.readouterr().err.startswith("error: does not fit in 16.00 GiB")


def test_pieces_of_several_sequences_run_together_in_order():
    """GpuBackend._together (prefill_many, mtp_many): each row's pieces in their order; the pass's pieces of one
    shape share the smallest bucket that holds them, more than the largest bucket's rows split; prefill pieces
    (B = 1 buckets only) and pieces with images run one by one."""
    from collections import deque
    from types import SimpleNamespace

    import torch

    from compiler.buckets import Profile
    from ninfer_gen.executor.gpu_backend import GpuBackend, _Piece

    profile = Profile(cohorts=(1, 2, 4, 6), draft=3, mtp=True)
    fake = SimpleNamespace(profile=profile, bucket=lambda entry, b, t: (entry, b, t))
    lengths = [3, 30, 7, 17, 2, 30, 30]
    queues = [deque(_Piece(row, e, t, [0] * t, 0, t) for e, t in profile.prompt_pieces(n))
              for row, n in enumerate(lengths)]
    queues[6][0].images = torch.zeros(1, 4)                 # row 6's first piece (prefill 16) carries images
    seen = {row: [] for row in range(len(lengths))}
    calls = []
    for (entry, b, t), pieces in GpuBackend._together(fake, queues):
        assert all(p.entry == entry and p.t == t for p in pieces) and len(pieces) <= b
        assert (entry, b, t) in profile.shapes()
        calls.append((entry, b, t, len(pieces)))
        for p in pieces:
            seen[p.row].append((p.entry, p.t))
    assert seen == {row: profile.prompt_pieces(n) for row, n in enumerate(lengths)}
    # pieces: 3 = 1,1,1; 30 = 16,4,4,4,1,1; 7 = 4,1,1,1; 17 = 16,1; 2 = 1,1. A pass takes every row's next piece:
    # 29 pieces in 14 calls
    assert calls == [("step", 2, 1, 2), *[("prefill", 1, 16, 1)] * 3, ("step", 1, 4, 1), ("prefill", 1, 16, 1),
                     ("step", 4, 1, 4), ("step", 4, 4, 3),
                     ("step", 2, 1, 2), ("step", 4, 4, 3),
                     ("step", 4, 4, 3), ("step", 1, 1, 1),
                     ("step", 4, 1, 3), ("step", 4, 1, 3)]
    many = [deque([_Piece(row, "step", 1, [0], 0, 1)]) for row in range(9)]   # 9 rows > the largest bucket (6)
    assert [(b, len(p)) for (_, b, _), p in GpuBackend._together(fake, many)] == [(6, 6), (4, 3)]
