"""`ninfer-gen bench --concurrency` and `--long-prompt` on the CPU (reference backend, tiny spec, random
weights): the table is printed, the JSON has every figure of every row, the PNG plot is written beside it,
and bad options are one clear error line."""
import json

from ninfer_gen.cli import main
from ninfer_gen.api import TINY_SPEC

BASE = ["bench", str(TINY_SPEC), "--backend", "reference", "--output-tokens", "4"]


def test_cohort_bench_prints_the_table_and_writes_json_and_a_plot(tmp_path, capsys):
    out = tmp_path / "cohort" / "bench.json"
    assert main(BASE + ["--concurrency", "1,2", "--json", str(out), "--long-prompt", "100",
                        "--prefill-budget", "32", "--running-lanes", "3"]) == 0
    text = capsys.readouterr().out
    assert "with MTP, K = 3:" in text and "plain decode (draft 0):" in text and "MTP / plain, end to end" in text
    assert "long prompt: 100 tokens arriving while 3 lanes decode" in text and "during its prefill" in text
    r = json.loads(out.read_text())
    assert r["backend"] == "reference" and r["draft"] == 3 and r["prefill_budget"] == 32
    assert r["plot"] == str(out.with_suffix(".png")) and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    for name, draft in [("mtp", 3), ("plain", 0)]:
        rows = r["runs"][name]
        assert [x["concurrency"] for x in rows] == [1, 2] and all(x["draft"] == draft for x in rows)
        for x in rows:
            assert x["output_tokens"] == 4 * x["concurrency"] and x["e2e_tok_s"] > 0 and x["decode_tok_s"] > 0
            assert 0 < x["ttft_ms"]["p50"] <= x["ttft_ms"]["max"] and x["ttft_ms"]["mean"] > 0
            assert x["memory"]["host_peak_rss_bytes"] > 0 and x["tokens_per_round"] >= 1
            assert (x["acceptance"] is None) == (draft == 0)
    x = r["interference"]
    assert x["prompt_tokens"] == 100 and x["prefill_steps"] == 4 and x["ttft_ms"] > 0 and x["ttft_alone_ms"] > 0
    assert set(x["gap_ms"]) == {"before", "during", "after"}
    assert all(g["p50"] <= g["p99"] <= g["max"] and g["n"] > 0 for g in x["gap_ms"].values())


def test_cohort_bench_without_drafts_and_bad_options(tmp_path, capsys, monkeypatch):
    import torch

    assert main(BASE + ["--concurrency", "2", "--draft", "0", "--cohort-repeats", "3", "--json",
                        str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "plain decode (draft 0):" in text and "with MTP" not in text
    (row,) = json.loads((tmp_path / "r.json").read_text())["runs"]["plain"]
    speeds = sorted(x["e2e_tok_s"] for x in row["repeats"])
    assert len(speeds) == 3 and row["e2e_tok_s"] == speeds[1]          # the run of median speed, all three kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in [(["--concurrency", "1,x"], "comma-separated list of integers"),
                          (["--concurrency", "0"], "positive integers"),
                          (["--concurrency", "1", "--accept-prob", "0.8"], "GPU lanes only"),
                          (["--concurrency", "1", "--draft", "0", "--accept-prob", "0.8"], "needs --draft K > 0"),
                          (["--long-prompt", "-3"], "--long-prompt must be"),
                          (["--concurrency", "1", "--cohort-repeats", "0"], "--cohort-repeats must be ≥ 1"),
                          (["--concurrency", "1", "--backend", "gpu"], "CUDA")]:
        assert main(BASE + argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and "Traceback" not in err
