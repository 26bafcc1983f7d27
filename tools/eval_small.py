"""eval_small: held-out bits per byte and MTP agreement of a saved small model, computed through the
public API (`ninfer_gen.load(path).forward_logits` / `.mtp_logits`) — the engine's own numbers,
not the trainer's. Same windows as training-time evaluation (`tools.small_eval.build_evalset`).

    python -m tools.eval_small [--model models/qwen3.8-small-py] [--max-windows N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import ninfer_gen
from tools.small_data import collect_corpus
from tools.small_eval import build_evalset, progress_bar


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def score(model, evalset, max_windows: int | None) -> dict:
    n = len(evalset.windows) if max_windows is None else min(max_windows, len(evalset.windows))
    ce = count = agree = mtp_count = 0.0
    for w in progress_bar(range(n), desc="held-out windows"):
        window, mask = evalset.windows[w].tolist(), evalset.mask[w].numpy()
        inputs, targets = window[:-1], np.array(window[1:])
        logits = model.forward_logits(inputs)
        lp = log_softmax(logits)[np.arange(len(targets)), targets]
        ce -= float((lp * mask).sum())
        count += float(mask.sum())
        mtp_top = model.mtp_logits(inputs)[:-1].argmax(-1)          # row i predicts token i+2
        main_next = logits[1:].argmax(-1)                            # main model's own choice at i+1
        m1 = mask[1:]
        agree += float(((mtp_top == main_next) & m1).sum())
        mtp_count += float(m1.sum())
    n_bytes = evalset.n_bytes * (count / evalset.n_tokens)
    return {"bits_per_byte": ce / math.log(2) / n_bytes, "mtp_agreement": agree / max(mtp_count, 1),
            "tokens": int(count), "bytes": int(round(n_bytes)), "windows": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "models" / "qwen3.8-small-py"))
    p.add_argument("--seq-len", type=int, default=512, help="window length (the trained context)")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    model = ninfer_gen.load(args.model)
    tok = model.tokenizer
    eot = next(iter(model.eos_ids))
    corpus = collect_corpus()
    docs = [tok.encode(d.text) for d in corpus.heldout]
    evalset = build_evalset("heldout", docs, sum(d.n_bytes for d in corpus.heldout), eot, args.seq_len)
    t0 = time.perf_counter()
    result = {"model": args.model, "stdlib": corpus.root, "python": sys.version.split()[0],
              "device": str(model.backend.device), **score(model, evalset, args.max_windows),
              "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
