"""CLI: check, inspect and run work, and bad input gives one `error:` line and exit code 2."""
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_gen.cli import main

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "model_specs" / "qwen3.8-tiny.yaml")


def test_check_prints_the_27b_sizes(capsys):
    assert main(["check", str(ROOT / "model_specs" / "qwen3.8-27b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "27.321 B" in out and "144.0 MiB" in out and "48 linear_attention, 16 full_attention" in out


def test_inspect_prints_the_graph(capsys):
    assert main(["inspect", TINY, "--entry", "step", "--batch", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph qwen3.8-tiny.step") and "gdn_recurrence" in out


def test_run_on_a_spec_streams_a_completion(capsys):
    assert main(["run", "--weights", TINY, "--prompt", "abc", "--max-tokens", "5", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("abc")
    assert "5 new tokens" in captured.err and "tok/s" in captured.err


@pytest.mark.parametrize("context", [20, 37])
def test_max_context_is_the_limit_asked_not_its_pages(capsys, context):
    """--max-context between page boundaries (64-token pages): a request stops at that many tokens in context, with
    drafts on (the KV pages round up; the limit does not)."""
    import json

    assert main(["run", "--weights", TINY, "--prompt", "abc", "--max-tokens", "200", "--max-context", str(context),
                 "--draft", "3", "--json", "--device", "cpu"]) == 0
    r = json.loads(capsys.readouterr().out.splitlines()[0])
    assert r["finish"] == "length" and r["error"] is None
    assert r["prompt_tokens"] + len(r["tokens"]) == context + 1     # the last token is emitted, not yet in context


@pytest.mark.parametrize("argv,message", [
    (["check", "missing.yaml"], "spec file not found"),
    (["run", "--weights", "no/such/dir.yaml", "--prompt", "x"], "spec file not found"),
    (["run", "--weights", TINY, "--prompt", "x", "--random-weights", "--backend", "reference"], "use it with --backend gpu"),
    (["run", "--weights", TINY, "--prompt", "x", "--arch-path", "sm_86", "--backend", "reference"],
     "--arch-path sm_86 chooses the GPU's code path: use it with --backend gpu"),
    (["run", "--weights", TINY, "--prompt", "x", "--top-p", "0"], "top_p"),
    (["run", "--weights", TINY, "--prompt", "x", "--vision-kernels"], "use it with backend 'gpu'"),
    (["build", TINY, "--target", "gtx1080"], "unknown target 'gtx1080'"),
    (["build", TINY, "--arch", "sm_75"], "unsupported arch 'sm_75'"),
    (["build", TINY, "--cohorts", "1,x"], "comma-separated list of integers"),
    (["run", "--weights", "no/such/model.gguf", "--prompt", "x"], "GGUF file not found: no/such/model.gguf"),
    (["run", "--weights", "no/such/checkpoint", "--prompt", "x"], "no/such/checkpoint: no such file or directory"),
    (["convert", "no/such/model.gguf", "out"], "GGUF file not found"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,option", [
    (["run", "--prompt", "x", "--max-tokens", "-1"], "--max-tokens"),          # once: a run of no tokens, exit 0
    (["run", "--prompt", "x", "--max-context", "0"], "--max-context"),         # once: silently the spec's context
    (["serve", "--max-context", "-5"], "--max-context"),
    (["plan", TINY, "--max-context", "0"], "--max-context"),
    (["bench", "--output-tokens", "0"], "--output-tokens"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["run", "--prompt", "x", "--max-tokens", "many"], "--max-tokens"),
])
def test_counts_that_must_be_positive_are_refused_before_loading(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: argument {option}: expected a positive integer" in err
    assert "Traceback" not in err


def test_a_file_named_gguf_gets_the_gguf_readers_error(capsys, tmp_path):
    """A *.gguf path that is not a GGUF (no magic) is refused by the GGUF reader, by name, not as "expected a
    checkpoint" (run and convert)."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    for argv in (["run", "--weights", str(bad), "--prompt", "x"], ["convert", str(bad), str(tmp_path / "out")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "is not a GGUF file" in err and err.count("\n") == 1


def test_gpu_commands_without_a_gpu_say_so(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["run", "--weights", TINY, "--prompt", "x", "--backend", "gpu"], ["bench", TINY]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "CUDA" in err and "Traceback" not in err


def test_console_script_help_explains_commands():
    out = subprocess.run([sys.executable, "-m", "ninfer_gen.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    for word in ("check", "inspect", "run", "examples"):
        assert word in out


def test_compile_only_commands_do_not_import_torch():
    """check, plan and inspect (and build, which traces and lowers the same way) run without torch:
    `import torch` would be most of a warm `ninfer-gen build` (compiler/_torch.py)."""
    code = ("import sys; from ninfer_gen.cli import main; "
            "assert main(['check', 'model_specs/qwen3.8-27b.yaml']) == 0; "
            "assert main(['plan', 'model_specs/qwen3.8-27b.yaml', '--cohorts', '8', "
            "'--max-context', '16384', '--kv-pool-tokens', '100000']) == 0; "
            "assert main(['plan', 'model_specs/qwen3.8-27b.yaml', '--cohorts', '8', "
            "'--max-context', '16384', '--no-vision']) == 0; "
            "assert main(['inspect', 'model_specs/qwen3.8-tiny.yaml', '--entry', 'step', '--batch', '2', "
            "'--tokens', '4']) == 0; "
            "assert main(['inspect', 'model_specs/qwen3.8-tiny.yaml', '--entry', 'prefill', '--tokens', '64', "
            "'--plan']) == 0; "
            "from compiler.buckets import plan_profile, profile_of; from compiler.spec import load_spec; "
            "from compiler.targets import lookup; spec = load_spec('model_specs/qwen3.8-tiny.yaml'); "
            "plan_profile(spec, lookup('rtx3090'), profile_of(spec)); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
