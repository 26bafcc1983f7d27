"""`ninfer-gen bench --workload agent` on the CPU (reference backend, tiny spec, random weights, tiny sizes):
the table is printed, the JSON has every figure of every row, the PNG is written beside it, prefix reuse
prefills fewer tokens of the later turns than the run without it, a backend without the option says so,
and bad options are one clear error line."""
import json

import pytest

from ninfer_gen.cli import bench_agent, main
from ninfer_gen.api import TINY_SPEC

BASE = ["bench", str(TINY_SPEC), "--backend", "reference", "--workload", "agent", "--context-tokens", "160",
        "--turns", "3", "--tool-tokens", "10-30", "--answer-tokens", "4-8"]


def test_agent_bench_with_and_without_reuse(tmp_path, capsys):
    out = tmp_path / "agent" / "bench.json"
    assert main(BASE + ["--sessions", "1,2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("agent bench: qwen3.8-tiny") and "160-token shared context (seeded random ids)" in text
    assert "TTFT turn 1 ms" in text and "TTFT of turns 2+ with reuse / without (mean): S=1" in text
    r = json.loads(out.read_text())
    assert r["workload"] == "agent" and r["draft"] == 3 and r["turns"] == 3 and r["prefix_cache"] == 16
    assert r["tool_tokens"] == [10, 30] and r["answer_tokens"] == [4, 8]
    assert r["plot"] == str(out.with_suffix(".png")) and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    rows = {name: {x["sessions"]: x for x in r["runs"][name]} for name in ("no_reuse", "reuse")}
    for s in (1, 2):
        plain, reused = rows["no_reuse"][s], rows["reuse"][s]
        for x in (plain, reused):
            assert x["requests"] == 3 * s and 4 * 3 * s <= x["output_tokens"] <= 8 * 3 * s and x["tok_s"] > 0
            assert x["ttft_ms"]["turn1"]["n"] == s and x["ttft_ms"]["later"]["n"] == 2 * s
            for t in x["ttft_ms"].values():
                assert 0 < t["p50"] <= t["p99"] and t["mean"] > 0
            assert len(x["ttft_ms_per_turn"]) == 3 and 0 <= x["acceptance"] <= 1 and x["tokens_per_round"] >= 1
            assert x["memory"]["host_peak_rss_bytes"] > 0
            assert x["engine"]["prefill_tokens"] == sum(x["prefilled_tokens"].values())
        # the same workload: every answer has its drawn length, so the prompts are equally long
        assert plain["prompt_tokens"] == reused["prompt_tokens"] and plain["output_tokens"] == reused["output_tokens"]
        assert plain["prefilled_tokens"] == plain["prompt_tokens"] and plain["engine"]["prefix_hit_tokens"] == 0
        # turn 1: the sessions start together, so none finds the context checkpointed
        assert reused["prefilled_tokens"]["turn1"] == reused["prompt_tokens"]["turn1"]
        # later turns restore the session's previous turn: about one answer token + the tool result each
        assert reused["prefilled_tokens"]["later"] <= 2 * s * (1 + 30) < plain["prefilled_tokens"]["later"]
        assert reused["engine"]["prefix_hit_tokens"] == sum(reused["prompt_tokens"].values()) - reused["engine"][
            "prefill_tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--sessions", "1,x"], "--sessions: expected a comma-separated list of integers"),
    (["--tool-tokens", "30-10"], "--tool-tokens: expected 1 ≤ MIN ≤ MAX"),
    (["--answer-tokens", "many"], "--answer-tokens: expected MIN-MAX"),
    (["--turns", "0"], "--turns must be ≥ 1"),
    (["--context-tokens", "0"], "--context-tokens must be ≥ 1"),
    (["--draft", "0", "--accept-prob", "0.8"], "needs --draft K > 0")])
def test_agent_bench_bad_options(argv, message, capsys):
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_gdn_state_per_lane_counts_the_records_per_lane_and_the_snapshots_k_plus_1_states():
    """The figure the agent bench and the C1 bench print (issue 31: does ReplaySSM still save memory under low
    acceptance and frequent tool calls): a lane's committed GDN state, its share of the ReplaySSM records (the
    records hold one row per lane of the largest cohort), and the snapshot design's state + K + 1 snapshots (a
    state copy and the pre-conv column per verify token, as the memory plan counts them)."""
    from types import SimpleNamespace

    import torch

    from compiler.spec import load_spec
    from ninfer_gen.cli.bench_common import gdn_state_per_lane

    spec = load_spec(TINY_SPEC)
    g = spec.model.linear_attention
    n_gdn = sum(kind == "linear_attention" for kind in spec.model.layers.kinds)
    records = {"layer0": {"x": torch.zeros(4, 10, dtype=torch.bfloat16), "dt": torch.zeros(4, 6)}}
    be = SimpleNamespace(state=SimpleNamespace(records=records, records1={}), profile=SimpleNamespace(cohorts=(1, 2, 4)))
    st = gdn_state_per_lane(SimpleNamespace(backend=be, spec=spec), 3)
    state = n_gdn * g.num_value_heads * g.key_head_dim * g.value_head_dim * 4
    snapshot = n_gdn * (4 * g.num_value_heads * g.key_head_dim * g.value_head_dim + 2 * g.conv_dim)   # per token
    assert st == {"committed": state, "verify_buffers": (80 + 96) // 4, "total": state + 44,
                  "snapshot_total": state + 4 * snapshot}
    r = {"backend": "gpu", "model": "m", "device": "d", "context_tokens": 8, "context_source": "s", "turns": 1,
         "tool_tokens": [1, 2], "answer_tokens": [1, 2], "draft": 3, "accept_prob": 0.3, "prefill_budget": 64,
         "prefix_cache": 2, "runs": {"reuse": []}, "gdn_state_bytes_per_lane": st}
    assert "GDN state per lane, K = 3 (sized by K, whatever the acceptance): ReplaySSM" in bench_agent.table(r)


def test_gpu_memory_cell_shows_allocated_reserved_and_device():
    """The benches' GPU memory cell: allocated / reserved / device GiB (device − reserved is what lies outside the
    allocator: CUDA context, module images); figures of an older JSON without the reserved peak still print."""
    from ninfer_gen.cli.bench_common import GiB, memory_text

    m = {"allocator_peak_bytes": 23 * GiB, "allocator_reserved_peak_bytes": 23.5 * GiB,
         "device_used_peak_bytes": 24 * GiB}
    assert memory_text(m) == "23.00 / 23.50 / 24.00"
    assert memory_text({"allocator_peak_bytes": 2 * GiB, "device_used_peak_bytes": 3 * GiB}) == "2.00 / — / 3.00"
    assert memory_text({"host_peak_rss_bytes": 3 * 2 ** 20}) == "3"
