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
