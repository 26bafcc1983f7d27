"""reference_speed: decode speed of the reference backend (the interpreter on torch, CPU) on the shipped
small model — warm in-process tok/s per draft length, the CLI end to end, a per-primitive profile, and
a fingerprint of the logits to compare two trees bit for bit.

    python -m lab.reference_speed --threads 2                 # warm in-process, plain and K = 3
    python -m lab.reference_speed --threads 2 --cli 3         # also `ninfer-gen run --max-tokens 64`, 3 runs
    python -m lab.reference_speed --threads 2 --profile       # where a plain decode's time goes, per primitive
    python -m lab.reference_speed --fingerprint               # sha1 of the logits of a fixed decode (bits)

Run it pinned to two cores (`taskset -c 0,1`) to mimic the 2-core CI box. Other processes on the same
cores distort every figure here, the 2-thread ones most (each parallel region waits for both threads):
look at `uptime` first and repeat.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"
LONG_PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
               "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Stack:\n")


def decode_rate(model, ids: list[int], tokens: int, draft: int) -> tuple[float, float, float]:
    """(decode tok/s, TTFT s, CPU s per decoded token) of one stream, as `ninfer-gen run` counts them: the
    tokens after the first over the time after the first."""
    t0 = time.perf_counter()
    first = c_first = None
    n = 0
    for _ in model.stream(ids, tokens, draft=draft):
        if first is None:
            first, c_first = time.perf_counter(), time.process_time()
        n += 1
    end, c_end = time.perf_counter(), time.process_time()
    return (n - 1) / (end - first), first - t0, (c_end - c_first) / max(n - 1, 1)


def warm(model, ids, tokens: int, drafts: list[int], repeats: int) -> None:
    for draft in drafts:
        decode_rate(model, ids, tokens, draft)          # first use: graphs traced, torch kernels warmed
        runs = [decode_rate(model, ids, tokens, draft) for _ in range(repeats)]
        rates = [r[0] for r in runs]
        print(f"warm, draft {draft}: decode {statistics.median(rates):6.1f} tok/s median, {max(rates):6.1f} best "
              f"of {repeats}; TTFT {statistics.median(r[1] for r in runs) * 1e3:5.1f} ms; "
              f"CPU {statistics.median(r[2] for r in runs) * 1e3:5.2f} ms per token", flush=True)


def cli(runs: int, tokens: int, threads: int | None) -> None:
    """`ninfer-gen run --max-tokens N --backend reference`, end to end, as a user starts it (the spec's draft
    length, then plain decode); the CLI of this tree (the one `lab` sits in), whatever the venv installed."""
    cmd = [sys.executable, "-c", "import sys; from ninfer_gen.cli import main; sys.exit(main())",
           "run", "--max-tokens", str(tokens), "--backend", "reference", "--prompt", PROMPT]
    env = None
    if threads:
        import os
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for draft in ("default", "0"):
        walls, rates = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            done = subprocess.run(cmd + ([] if draft == "default" else ["--draft", draft]), capture_output=True,
                                  text=True, env=env, cwd=REPO, check=True)
            walls.append(time.perf_counter() - t0)
            rates.append(float(re.search(r"decode ([\d.]+) tok/s", done.stderr).group(1)))
        print(f"cli, draft {draft}: wall {statistics.median(walls):.2f} s median (best {min(walls):.2f}); "
              f"reported decode {statistics.median(rates):.1f} tok/s median (best {max(rates):.1f}) over {runs} runs",
              flush=True)


def profile(model, ids, tokens: int, draft: int) -> None:
    """One greedy decode with every equation timed (wall) by the interpreter; per primitive and entry."""
    times: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    be = model.backend
    be.profile = (times, counts)
    try:
        t0 = time.perf_counter()
        model.generate(ids, tokens, draft=draft)
        total = time.perf_counter() - t0
    finally:
        be.profile = None
    inside = sum(times.values())
    print(f"profile, draft {draft}: {total * 1e3:.1f} ms for {tokens} tokens, {inside * 1e3:.1f} ms inside equations "
          f"({(total - inside) / tokens * 1e3:.2f} ms per token outside them)")
    for key, t in sorted(times.items(), key=lambda kv: -kv[1])[:24]:
        print(f"  {key[0]:>8} {key[1]:<18} {t * 1e3:8.1f} ms {counts[key]:6d} calls {t / counts[key] * 1e6:8.1f} us/call"
              f" {t / tokens * 1e3:6.2f} ms/token")


def fingerprint(model, ids) -> str:
    """sha1 over the logits of a prefill, 16 greedy steps, and a verify + commit + MTP draft: equal across two
    trees (same machine, same threads) iff their numbers are identical."""
    be = model.backend
    digest = hashlib.sha1()
    seq = be.new_sequence()
    try:
        logits, hidden = be.prefill(seq, ids)
        digest.update(logits.numpy().tobytes())
        token = int(logits[-1].argmax())
        for _ in range(16):
            logits, hidden = be.run("step", [seq], [[token]])
            digest.update(logits.numpy().tobytes())
            token = int(logits[-1].argmax())
        draft, _ = be.run("mtp", [seq], [[token]], hidden[-1:], starts=[seq.length - 1])
        digest.update(draft.numpy().tobytes())
        logits, _ = be.verify(seq, [token, 1, 2, 3])
        digest.update(logits.numpy().tobytes())
        be.commit(seq, 2)
        logits, _ = be.run("step", [seq], [[5]])
        digest.update(logits.numpy().tobytes())
    finally:
        be.release(seq)
    return digest.hexdigest()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draft", default="0,3", help="draft lengths to time warm, comma-separated")
    p.add_argument("--cli", type=int, default=0, metavar="RUNS", help="also time `ninfer-gen run` RUNS times")
    p.add_argument("--profile", action="store_true", help="per-primitive times of one decode per draft length")
    p.add_argument("--fingerprint", action="store_true", help="print the logits' sha1 only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import ninfer_gen
    t0 = time.perf_counter()
    model = ninfer_gen.load(backend="reference", device="cpu")
    load_s = time.perf_counter() - t0
    ids = model.tokenizer.encode(PROMPT)
    if args.fingerprint:
        long_ids = model.tokenizer.encode(LONG_PROMPT)
        print(f"fingerprint ({torch.get_num_threads()} threads, {len(long_ids)} prompt tokens): "
              f"{fingerprint(model, long_ids)}")
        return
    print(f"{model.source}: torch {torch.__version__}, {torch.get_num_threads()} threads; load {load_s:.2f} s; "
          f"{len(ids)} prompt tokens, {args.tokens} new")
    drafts = [int(d) for d in args.draft.split(",") if d]
    warm(model, ids, args.tokens, drafts, args.repeats)
    for draft in drafts if args.profile else []:
        profile(model, ids, args.tokens, draft)
    if args.cli:
        cli(args.cli, args.tokens, args.threads)


if __name__ == "__main__":
    main()
