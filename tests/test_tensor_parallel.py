"""Tensor parallelism on the CPU (issue 24): compiler.shard's rank specs and weight shares, and the tiny
spec run by two gloo processes (ninfer_gen.parallel.launch) against one process: logits of prefill, decode
steps, a verify and the step after its commit within fp32 reduction-order tolerance (≤ 1e-4), greedy
tokens identical over 64 steps with and without drafts, on both ranks. A rank's kernels build in the session's kernel
cache (tests/conftest.py)."""
from pathlib import Path

import pytest
import torch

from compiler.shard import shard_spec, shard_weights
from compiler.spec import SpecError, load_spec, tensor_table

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "model_specs"


def test_rank_specs_of_the_27b_and_their_heads():
    spec = load_spec(SPECS / "qwen3.8-27b.yaml")
    a = spec.model
    two = shard_spec(spec, 2).model
    assert (two.attention.num_heads, two.attention.num_kv_heads) == (a.attention.num_heads // 2, a.attention.num_kv_heads // 2)
    assert two.linear_attention.num_value_heads == a.linear_attention.num_value_heads // 2
    assert two.linear_attention.num_key_heads == a.linear_attention.num_key_heads // 2
    assert two.intermediate_size == a.intermediate_size // 2 and two.vocab_size == a.vocab_size
    eight = shard_spec(spec, 8).model.attention          # 3 query heads per rank of a 6-head group: 1 KV head
    assert (eight.num_heads, eight.num_kv_heads) == (a.attention.num_heads // 8, 1)
    assert shard_spec(spec, 1) is spec


def test_a_split_that_does_not_divide_is_refused_naming_it():
    spec = load_spec(SPECS / "qwen3.8-tiny.yaml")
    with pytest.raises(SpecError, match="4 query heads do not split over 3 ranks"):
        shard_spec(spec, 3)
    with pytest.raises(ValueError, match="already one rank"):
        shard_spec(shard_spec(spec, 2), 2)


def test_shares_have_the_rank_specs_shapes_and_rebuild_the_whole():
    from ninfer_gen.weights.random_weights import random_weights

    spec = load_spec(SPECS / "qwen3.8-tiny.yaml")
    full = random_weights(spec)
    local = shard_spec(spec, 2)
    shares = [shard_weights(spec, full, 2, r) for r in range(2)]
    for t in tensor_table(local):
        for share in shares:
            assert tuple(share[t.name].shape) == t.shape, t.name
    name = "layers.0.mlp.down_proj.weight"                      # row-parallel: the products sum to the whole
    x = torch.randn(3, spec.model.intermediate_size)
    half = spec.model.intermediate_size // 2
    parts = sum(x[:, r * half:(r + 1) * half] @ shares[r][name].t() for r in range(2))
    assert torch.allclose(parts, x @ full[name].t(), atol=1e-5)
    name = "layers.0.linear_attn.in_proj_qkv.weight"            # column-parallel: q, k and v rows re-interleaved
    g = spec.model.linear_attention
    kd, vd = g.key_dim // 2, g.value_dim // 2
    whole = torch.cat([torch.cat([s[name][:kd] for s in shares]), torch.cat([s[name][kd:2 * kd] for s in shares]),
                       torch.cat([s[name][2 * kd:2 * kd + vd] for s in shares])])
    assert torch.equal(whole, full[name])
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shares]), full["lm_head.weight"])


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process():
    from ninfer_gen.parallel import launch
    from tp_worker import run_rank

    prompt = [5, 9, 2, 77, 31, 8, 100, 3, 44, 12, 250, 6]
    one = run_rank(0, 1, str(ROOT), prompt, 64)
    ranks = launch(2, run_rank, 2, str(ROOT), prompt, 64, threads=1)
    assert ranks[0]["kv_heads"] == 1 and ranks[0]["value_heads"] == 3
    worst = 0.0
    for r in ranks:
        for key in ("prefill", "verify", "after_commit"):
            worst = max(worst, (r[key] - one[key]).abs().max().item())
        for a, b in zip(r["steps"], one["steps"]):
            worst = max(worst, (a - b).abs().max().item())
        assert r["plain"] == one["plain"] and len(one["plain"]) == 64
        assert r["drafted"] == one["drafted"] == one["plain"]
    print(f"\nTP=2 (gloo) vs TP=1: logits max |diff| {worst:.2e} over prefill, 4 steps, verify, a step after "
          f"commit; 64 greedy tokens equal with and without drafts")
    assert worst <= 1e-4


def test_per_card_plan_of_the_27b_at_tp2_holds_c8_at_64k(capsys):
    """One card's share at TP = 2 (weights halved but for the replicated embedding; GDN slots and KV of its
    heads): 8 lanes × 64K tokens fit 24 GiB per card, which one card refuses."""
    from ninfer_gen.cli import main
    from ninfer_gen.executor.memory_plan import GiB, MemoryPlanError, plan_memory

    spec = load_spec(SPECS / "qwen3.8-27b.yaml")
    card = plan_memory(shard_spec(spec, 2), 8, 65536, 24 * GiB, draft=3)
    assert card.kv_tokens >= 8 * 65536 and card.weights < 9 * GiB
    with pytest.raises(MemoryPlanError, match="8 lane"):
        plan_memory(spec, 8, 65536, 24 * GiB, draft=3)
    assert main(["plan", str(SPECS / "qwen3.8-27b.yaml"), "--cohorts", "8", "--max-context", "65536", "--tp", "2"]) == 0
    assert "per card of 2" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_run_with_tp2_prints_what_one_process_prints(capfd):
    from ninfer_gen.cli import main

    argv = ["run", "--weights", str(SPECS / "qwen3.8-tiny.yaml"), "--prompt", "ab", "--max-tokens", "12", "--draft", "0",
            "--backend", "reference"]
    assert main(argv) == 0
    one = capfd.readouterr().out
    assert main(argv + ["--tp", "2"]) == 0
    assert capfd.readouterr().out == one
    assert main(argv + ["--tp", "3"]) == 2
    assert "do not split over 3 ranks" in capfd.readouterr().err


def test_a_rank_plan_reduces_after_each_row_parallel_projection_and_gathers_the_logits():
    """The 27B's rank plan at TP = 2 (sm_86): one all_reduce after each layer's mixer and MLP down
    projection (bf16, B·T × hidden), the residual add and the next norm in one in-place rmsnorm, one
    all_gather of the fp32 logits; the plan's kernels exclude the collectives."""
    from compiler.buckets import plan_bucket
    from compiler.plan import Collective, format_plan
    from compiler.targets import lookup

    spec = shard_spec(load_spec(SPECS / "qwen3.8-27b.yaml"), 2)
    a = spec.model
    plan = plan_bucket(spec, lookup("sm_86"), "verify", 2, 4)
    rows = 2 * 4
    reduces = [c for c in plan.collectives() if c.key.op == "all_reduce"]
    gathers = [c for c in plan.collectives() if c.key.op == "all_gather"]
    assert len(reduces) == 2 * a.layers.count and len(gathers) == 1
    assert {c.key for c in reduces} == {Collective("all_reduce", rows * a.hidden_size, "bf16", 2)}
    assert gathers[0].key == Collective("all_gather", rows * a.vocab_size // 2, "f32", 2)
    assert not any(isinstance(k, Collective) for k in plan.keys())
    for c in reduces:                       # reduced into its own bytes, then added into the residual in place
        i = plan.calls.index(c)
        after = plan.calls[i + 1]
        assert plan.calls[i - 1].key.family == "gemv" and plan.calls[i - 1].binding("y") == c.binding("x")
        assert after.key.family == "rmsnorm" and after.key.add and after.binding("delta") == c.binding("y")
        assert not after.programmatic
    assert "all_gather_n" in format_plan(plan) and " collective " in format_plan(plan)


def rank_step_keys() -> list:
    """The keys of one rank's decode step of the 27B at --tp 2 on sm_86."""
    from compiler.buckets import plan_bucket
    from compiler.targets import lookup

    return plan_bucket(shard_spec(load_spec(SPECS / "qwen3.8-27b.yaml"), 2), lookup("sm_86"), "step", 1, 1).keys()


@pytest.mark.slow
@pytest.mark.prebuild(keys=rank_step_keys)
def test_a_rank_plans_kernels_compile_and_a_quantised_share_must_hold_whole_groups(kernel_cache, tmp_path, capsys):
    from compiler.build_cache import build_kernels
    from ninfer_gen.cli import main

    keys = rank_step_keys()
    summary = build_kernels(keys, jobs=2, root=kernel_cache, progress=False)
    assert summary.kernels == len(keys) and summary.spills == 0
    assert main(["build", str(SPECS / "qwen3.8-tiny.yaml"), "--tp", "2", "--build-dir", str(tmp_path)]) == 2
    assert "96 input columns per rank are not a multiple of its q5g64 group" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_bench_with_tp2_writes_one_report(tmp_path, capfd):
    import json

    from ninfer_gen.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", str(ROOT / "models/qwen3.8-small-py"), "--tp", "2", "--concurrency", "1", "--output-tokens",
                 "8", "--no-plain", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "2 tensor-parallel ranks" in report["device"] and report["runs"]["mtp"][0]["concurrency"] == 1
    assert capfd.readouterr().out.count("cohort bench:") == 1        # rank 0 alone prints


@pytest.mark.slow
def test_the_cohort_engine_over_replicated_lanes_equals_one_process():
    """engine.replicated: the lead's engine drives the follower's lanes call by call — the same tokens as one
    process for greedy and seeded requests (K = 0 and 3, one cancelled mid-stream), an unseeded sampled
    request finishes without desynchronising the ranks, and every rank's slots are free after, its pages
    those the prefix cache keeps, as in one process."""
    from ninfer_gen.parallel import launch
    from tp_worker import engine_rank

    one = engine_rank(0, 1, str(ROOT))
    lead, follower = launch(2, engine_rank, 2, str(ROOT), threads=1)
    assert lead["finish"] == one["finish"] and lead["finish"][2] == "cancelled"
    assert [t for i, t in enumerate(lead["tokens"]) if i not in (2, 5)] == \
        [t for i, t in enumerate(one["tokens"]) if i not in (2, 5)]
    assert len(lead["tokens"][5]) == 20
    assert lead["usage"] == follower["usage"] and lead["usage"]["slots_in_use"] == 0
    shared = {k: v for k, v in one["usage"].items() if k != "prefix_bytes"}
    assert {k: lead["usage"][k] for k in shared} == shared            # the prefix cache's pages pinned alike,
    assert lead["usage"]["prefix_bytes"] < 0.6 * one["usage"]["prefix_bytes"]  # a rank's GDN states half


def _serve(tmp_path, tp: int):
    import subprocess
    import sys
    import time

    import httpx

    from ninfer_gen.parallel import free_port

    port = free_port()
    log = open(tmp_path / f"serve_tp{tp}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_gen.cli", "serve", "--backend", "reference", "--port",
                             str(port), "--lanes", "2", "--tp", str(tp), "--log-level", "warning"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (tmp_path / f"serve_tp{tp}.log").read_text()[-2000:]
        time.sleep(0.25)
    proc.kill()
    raise AssertionError("the server did not start")


@pytest.mark.slow
def test_serve_with_tp2_answers_what_one_process_answers(tmp_path):
    """`ninfer-gen serve --tp 2`: the lead serves HTTP and drives the follower; greedy completions equal the
    single-process server's, and the launcher and both ranks exit when it is terminated."""
    import signal
    import subprocess

    import httpx

    body = {"model": "qwen3.8-small-py", "max_tokens": 16, "temperature": 0}
    texts = []
    for tp in (1, 2):
        proc, url = _serve(tmp_path, tp)
        try:
            texts.append([httpx.post(url + "/v1/completions", json=body | {"prompt": p}, timeout=60).json()
                          ["choices"][0]["text"] for p in ("def fib(n):", "class Stack:")])
        finally:
            proc.terminate()
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()                        # no server left behind, whatever failed
                raise
        assert code in (0, 130, -signal.SIGTERM)
    assert texts[0] == texts[1] and all(texts[0])


def test_an_in_place_kernel_may_not_overwrite_what_is_read_after_it():
    """The in-place add + norm takes its input's bytes only when nothing after it reads them, directly or
    through a view (compiler.lower)."""
    from compiler.ir import Graph
    from compiler.lower import LoweringError, _overwritten
    from compiler.ops import TraceOps

    def graph(read_after: bool):
        ops = TraceOps("bf16")
        x, d, w = ops.new_var((2, 128), "bf16"), ops.new_var((2, 128), "bf16"), ops.new_var((128,), "bf16")
        total, y = ops.bind("add_rmsnorm", x, d, w, eps=1e-6, offset=1.0)
        out = ops.add(ops.reshape(x, 2, 128), y) if read_after else ops.add(total, y)
        return Graph("g", {"x": x, "d": d}, {"w": w}, {}, ops.eqns, {"out": out})

    g = graph(False)
    assert _overwritten(g, 0, 0) == g.eqns[0].inputs[0].uid
    with pytest.raises(LoweringError, match="overwrites an input that is read after it"):
        _overwritten(graph(True), 0, 0)


@pytest.mark.slow
def test_cli_run_with_tp2_samples_alike_on_every_rank_without_a_seed(capfd):
    """Sampling without --seed: every rank's generator starts from the same default seed (ranks drawing
    apart would desynchronise their collectives); the command ends normally."""
    from ninfer_gen.cli import main

    assert main(["run", "--weights", str(SPECS / "qwen3.8-tiny.yaml"), "--prompt", "ab", "--max-tokens", "24",
                 "--temperature", "0.9", "--backend", "reference", "--tp", "2"]) == 0
    assert "24 new tokens" in capfd.readouterr().err
