"""cohort_diag: which part of a GPU cohort run parts from each prompt's solo greedy run (session 15: `run --json
--draft 3` with 5 and 8 prompts on the small model gave one request other tokens from token 16–20 on, where 1, 3
and 6 prompts and the reference backend gave equal ones). Runs the same prompts through `run` with the adaptive
draft length (the CLI's default) and with K fixed, and prints, per prompt, the first token that differs.

    python -m lab.cohort_diag --n 5,8
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="5,8", help="comma-separated prompt counts")
    ap.add_argument("--backend", default="gpu")
    args = ap.parse_args(argv)
    import ninfer_gen
    from ninfer_gen.cli.main import main as cli

    model = ninfer_gen.load(None, backend=args.backend, max_context=1024)
    tok = model.tokenizer
    ids = tok.encode((ROOT / "ninfer_gen" / "engine" / "engine.py").read_text())
    for n in (int(x) for x in args.n.split(",")):
        prompts = [tok.decode(ids[200 * i:200 * i + 64]) for i in range(n)]
        solo = [model.generate(tok.encode(p), 64, stop_tokens=model.eos_ids) for p in prompts]
        for label, extra in (("adaptive", []), ("fixed K", ["--fixed-draft"]), ("no drafts", ["--draft", "0"])):
            argv = ["run", "--backend", args.backend, "--json", "--draft", "3", "--max-tokens", "64",
                    "--max-context", "1024", *extra]
            for p in prompts:
                argv += ["--prompt", p]
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                cli(argv)
            rows = sorted((json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")),
                          key=lambda r: r["index"])
            first = []
            for r, s in zip(rows, solo):
                diff = [i for i, (a, b) in enumerate(zip(r["tokens"], s)) if a != b]
                first.append(diff[0] if diff else (None if len(r["tokens"]) == len(s) else min(len(r["tokens"]), len(s))))
            print(f"n = {n}, {label}: first differing token per prompt {first}; errors "
                  f"{[r['error'] for r in rows if r['error']]}", flush=True)


if __name__ == "__main__":
    main()
