"""`ninfer-gen bench --long-context` on the CPU (reference backend, tiny spec, random weights, tiny contexts): the
table is printed last, the JSON has every figure of every context and prompt with its ratio to the smallest,
bad options are one clear error line; and the byte counts the GPU run reports at the 27B's contexts agree with
the issue's (a step at 128K moves 1 / 0.78 of a step at 1K)."""
import json

import pytest

from compiler.buckets import plan_bucket, profile_of
from compiler.spec import load_spec
from compiler.targets import lookup
from ninfer_gen.api import REPO, TINY_SPEC
from ninfer_gen.cli import main
from ninfer_gen.cli.bench_common import step_bytes
from ninfer_gen.cli.bench_long import round_bytes

BASE = ["bench", str(TINY_SPEC), "--long-context", "--backend", "reference", "--decode-tokens", "6"]


def test_long_context_bench_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "long" / "bench.json"
    assert main(BASE + ["--contexts", "256,64", "--prompts", "128,256", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "long context, one lane: qwen3.8-tiny" in text and "plain decode (6 tokens from each context):" in text
    assert "MTP rounds, K = 3:" in text and "time to first token (plain):" in text
    assert text.rstrip().splitlines()[-1].startswith("peak memory of the runs (MiB resident):")
    r = json.loads(out.read_text())
    assert r["bench"] == "long-context" and r["backend"] == "reference" and r["draft"] == 3
    assert r["read_GBps"] is None and r["memory_plan"] is None and r["max_context"] >= 256 + 6 + 8
    for part, draft in (("plain", 0), ("rounds", 3)):
        rows = r[part]
        assert [x["context"] for x in rows] == [64, 256] and all(x["draft"] == draft for x in rows)
        for x in rows:
            assert x["tokens"] == 6 and x["final_context"] == x["context"] + 6 and x["ttft_ms"] > 0
            assert x["decode_tok_s"] > 0 and x["memory"]["host_peak_rss_bytes"] > 0
            moved = x["bytes_per_step" if draft == 0 else "bytes_per_round"]
            assert moved["total"] == sum(v for name, v in moved.items() if name != "total") > 0
            assert x["read_fraction"] is None and x["vs_base"]["base"] == 64
        assert rows[0]["vs_base"]["bytes_allow"] == 1.0 and 0.5 < rows[1]["vs_base"]["bytes_allow"] < 1.0
    assert r["rounds"][1]["bytes_per_round"]["mtp_kv"] > r["rounds"][0]["bytes_per_round"]["mtp_kv"] > 0
    assert r["rounds"][0]["rounds"] > 0 and 0 <= r["rounds"][0]["acceptance"] <= 1
    prompts = {x["tokens"]: x for x in r["prompts"]}
    assert prompts[128]["source"] == "a one-token request"
    assert prompts[256]["source"] == "the plain decode run at this context"
    assert prompts[256]["ttft_ms"] == r["plain"][1]["ttft_ms"]
    assert all(x["prefill_tok_s"] > 0 and x["effective_TFLOPs"] > 0 for x in prompts.values())
    assert prompts[256]["vs_base"]["base"] == 128
    assert r["peak_memory"]["host_peak_rss_bytes"] > 0


def test_long_context_bench_without_drafts_and_bad_options(capsys, monkeypatch):
    import torch

    assert main(BASE + ["--contexts", "64", "--prompts", "64", "--draft", "0"]) == 0
    text = capsys.readouterr().out
    assert "plain decode" in text and "MTP rounds" not in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in [(["--contexts", "64,x"], "comma-separated list of integers"),
                          (["--prompts", "0"], "positive integers"),
                          (["--contexts", "4090"], "exceed the model's 4096 (max_position_embeddings)"),
                          (["--decode-tokens", "0"], "--decode-tokens must be ≥ 1"),
                          (["--contexts", "64", "--prompts", "64", "--accept-prob", "0.8"], "GPU lanes only"),
                          (["--draft", "0", "--accept-prob", "0.8"], "needs --draft K > 0"),
                          (["--tp", "2"], "it has no --tp"),
                          (["--backend", "gpu"], "CUDA")]:
        assert main(BASE + argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.parametrize("context, allows", [(32768, 0.93), (131072, 0.78)])
def test_27b_bytes_per_step_at_long_context_agree_with_the_issue(context, allows):
    """What the GPU bench divides by: a 27B step moves 15.8 GB at 1K; at 32K / 128K its KV makes the bytes allow
    0.93× / 0.78× of the 1K speed (issue 31); a K = 3 round adds three MTP steps' weights and MTP-layer KV."""
    spec = load_spec(REPO / "model_specs" / "qwen3.8-27b.yaml")
    target, profile = lookup("sm_90"), profile_of(spec, cohorts=(1,), draft=3, max_context=131072 + 1024)
    plans = {name: plan_bucket(spec, target, *shape, profile)
             for name, shape in (("step", ("step", 1, 1)), ("verify", ("verify", 1, 4)), ("mtp", ("mtp", 1, 1)))}
    base = step_bytes(spec, plans["step"], 1024, "int8")
    assert 15.5e9 < base["total"] < 16.2e9
    at = step_bytes(spec, plans["step"], context, "int8")
    assert base["total"] / at["total"] == pytest.approx(allows, abs=0.01)
    assert at["kv"] == pytest.approx(context * 16 * 2 * 4 * 256 * (1 + 2 / 64), rel=1e-6)
    rnd = round_bytes(spec, plans, context, 3, "int8")
    assert rnd["mtp_kv"] == pytest.approx(3 * context * 2 * 4 * 256 * (1 + 2 / 64), rel=1e-6)
    assert rnd["total"] == rnd["weights"] + rnd["state"] + rnd["kv"] + rnd["mtp_weights"] + rnd["mtp_kv"]


def test_a_failing_context_is_reported_and_the_others_run(tmp_path, capsys, monkeypatch):
    from ninfer_gen.cli import bench_long

    real = bench_long.engine_run

    def failing(lanes, prompt, tokens, draft):
        if len(prompt) == 256:
            raise RuntimeError("out of pages (simulated)")
        return real(lanes, prompt, tokens, draft)
    monkeypatch.setattr(bench_long, "engine_run", failing)
    out = tmp_path / "long.json"
    assert main(BASE + ["--contexts", "64,256", "--prompts", "256", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("error: RuntimeError: out of pages (simulated)") == 3        # plain, rounds, the prompt
    r = json.loads(out.read_text())
    assert r["plain"][1] == {"context": 256, "draft": 0, "error": "RuntimeError: out of pages (simulated)"}
    assert r["plain"][0]["vs_base"]["base"] == 64 and "error" in r["prompts"][0]


def test_the_table_of_a_gpu_run(tmp_path, capsys):
    """The GPU run's figures (replays, ceilings, the plan) in the table — checked here, not after minutes of
    device time: a GPU-shaped result made from a CPU run's."""
    from ninfer_gen.cli.bench_long_table import table

    out = tmp_path / "long.json"
    assert main(BASE + ["--contexts", "64,256", "--prompts", "128", "--json", str(out)]) == 0
    capsys.readouterr()
    r = json.loads(out.read_text())
    r |= {"backend": "gpu", "device": "NVIDIA H200", "read_GBps": 4449.0, "copy_GBps": 4283.0,
          "budget_bytes": 24 * 2 ** 30, "memory_plan": {"peak": 22 * 2 ** 30},
          "peak_memory": {"allocator_peak_bytes": 21 * 2 ** 30, "allocator_reserved_peak_bytes": 21.5 * 2 ** 30,
                          "device_used_peak_bytes": 22 * 2 ** 30}}
    for x in r["plain"]:
        x |= {"step_replay_ms": 5.4, "replay_read_fraction": 0.66}
        x["vs_base"]["step_replay_ms"] = 1.0
    for x in r["rounds"]:
        x["read_fraction"] = 0.6
    text = table(r)
    assert "read stream 4,449 GB/s, copy 4,283 GB/s" in text and "5.400" in text and "66.0%" in text
    assert text.splitlines()[-1] == ("peak memory of the runs (GiB allocated / reserved / device): 21.00 / 21.50 / "
                                     "22.00; planned 22.00 GiB of a 24.00 GiB budget")


def test_the_read_stream_probe_compiles_for_every_target_arch():
    """The bench's ceiling (cli.read_stream): its NVRTC source builds for every supported arch, no spills, and its
    PTX keeps the unrolled 16-byte read-only loads (nothing is optimised away)."""
    from compiler.nvrtc import compile_source
    from compiler.targets import SUPPORTED_ARCHS
    from ninfer_gen.cli.read_stream import ENTRY, SOURCE

    for arch in SUPPORTED_ARCHS:
        built = compile_source(SOURCE, ENTRY, arch, ["-std=c++17"])
        assert built.image and built.resources[ENTRY].spills == 0, arch
    ptx = compile_source(SOURCE, ENTRY, "sm_90", ["-std=c++17"], ptx=True).image.decode()
    assert ptx.count("ld.global.nc.v4") >= 4
