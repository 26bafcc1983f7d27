"""train_small: trains the small Qwen3.5-family model (Gated DeltaNet + gated attention 3:1, a jointly
trained one-layer MTP head) on the running Python's standard library, evaluates it on the held-out
json/ and email/ sources, and saves it in HF layout.

    python -m tools.train_small --out models/qwen3.8-small-py            # GPU: ~8 min budget
    python -m tools.train_small --smoke --out /tmp/small-smoke           # CPU: < 60 s

The model math is `compiler.model.reference_forward`; this tool only orchestrates.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from .small_data import EOT, BatchSampler, build_data, collect_corpus, encode_docs, slice_docs, split_validation
from .small_eval import build_evalset, evaluate, greedy_sample
from .small_export import as_stored, write_checkpoint
from .small_model import hf_config, init_params, model_spec, parameter_count
from .small_trainer import Trainer, TrainConfig

# Defaults for a full run (sized for one H200) and for the CPU smoke run. On an H200 the data (~3 M
# tokens), not compute, is the limit: the run stops at max_epochs or the time budget, whichever comes
# first, and keeps the weights with the best validation bits per byte.
FULL = dict(preset="small", vocab=8192, seq_len=512, batch=64, minutes=8.0, max_epochs=32.0, max_steps=0,
            lr=1.5e-3, min_lr_ratio=0.1, warmup=100, weight_decay=0.1, mtp_weight=0.3, clip=1.0,
            eval_every=30.0, eval_batch=32, log_every=20, tokenizer_sample_mb=4.0, device="auto",
            train_bytes=0, eval_bytes=0, threads=0, sample_tokens=96)
SMOKE = dict(FULL, preset="tiny", vocab=512, seq_len=64, batch=8, minutes=0.75, max_epochs=0.0, max_steps=30,
             lr=3e-3, warmup=5, eval_every=0.0, eval_batch=64, log_every=5, tokenizer_sample_mb=1.0,
             device="cpu", train_bytes=300_000, eval_bytes=6_000, threads=1,
             sample_tokens=16)
# threads: CPU intra-op threads (0: torch's default). The smoke run uses one: on a small shared machine,
# OpenMP threads that spin against other processes made it ~10× slower (141 s vs 14 s).


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (HF layout)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run over a small corpus slice (< 60 s)")
    p.add_argument("--merged-log", action="store_true",
                   help="write metrics and curve into one training_log.json (keeps the folder at ≤ 8 files)")
    p.add_argument("--seed", type=int, default=0)
    for key, value in FULL.items():   # None → the FULL or SMOKE default
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                       help=f"default {value} (smoke: {SMOKE[key]})")
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name} asked for, but torch sees no CUDA device")
    return torch.device(name)


def prepare_data(args) -> dict:
    """Corpus → tokenizer → training stream and the validation / held-out evaluation sets."""
    corpus = collect_corpus()
    train_docs, valid_docs = split_validation(corpus.train)
    heldout_docs = corpus.heldout
    if args.train_bytes:
        train_docs = slice_docs(train_docs, args.train_bytes, args.seed)
    if args.eval_bytes:
        valid_docs = slice_docs(valid_docs, args.eval_bytes, args.seed)
        heldout_docs = slice_docs(heldout_docs, args.eval_bytes, args.seed)
    tok, stream, timings = build_data(train_docs, args.vocab, int(args.tokenizer_sample_mb * 1e6), args.seed)
    eot = tok.token_to_id(EOT)
    evalsets = {name: build_evalset(name, encode_docs(tok, docs), sum(d.n_bytes for d in docs), eot, args.seq_len)
                for name, docs in (("valid", valid_docs), ("heldout", heldout_docs))}
    stats = {"stdlib": corpus.root, "python": platform.python_version(),
             "train_files": len(train_docs), "train_bytes": sum(d.n_bytes for d in train_docs),
             "train_tokens": int(stream.numel()), "valid_files": len(valid_docs),
             "heldout_files": len(heldout_docs), "heldout_bytes": evalsets["heldout"].n_bytes,
             "heldout_tokens": evalsets["heldout"].n_tokens, **timings}
    return {"tokenizer": tok, "stream": stream, "evalsets": evalsets, "stats": stats, "eot": eot}


def train_config(args) -> TrainConfig:
    return TrainConfig(minutes=args.minutes, max_epochs=args.max_epochs, max_steps=args.max_steps, lr=args.lr,
                       min_lr_ratio=args.min_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay,
                       mtp_weight=args.mtp_weight, clip=args.clip, eval_every_s=args.eval_every,
                       eval_batch=args.eval_batch, log_every=args.log_every)


SAMPLE_PROMPT = "def fibonacci(n):"


def final_metrics(spec, weights: dict, data: dict, args, device: torch.device) -> dict:
    """Evaluation in fp32 of the weights exactly as saved (bf16-rounded matrices), plus a greedy sample."""
    torch.set_float32_matmul_precision("highest")
    params = {k: v.to(device) for k, v in as_stored(weights).items()}
    out = {name: evaluate(spec, params, es, args.eval_batch, device) for name, es in data["evalsets"].items()}
    out["sample"] = greedy_sample(spec, params, data["tokenizer"], SAMPLE_PROMPT, args.sample_tokens,
                                  data["eot"], device)
    return out


def write_logs(out: Path, metrics: dict, curve: list, merged: bool) -> list[Path]:
    if merged:
        path = out / "training_log.json"
        path.write_text(json.dumps({"metrics": metrics, "curve": curve}, indent=1) + "\n")
        return [path]
    (out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "training_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    return [out / "training_metrics.json", out / "training_curve.json"]


def run_training(args, data: dict, device: torch.device):
    """(config, spec, trainer) after training within the budget."""
    config = hf_config(args.preset, data["tokenizer"].get_vocab_size(), data["eot"])
    spec = model_spec(config)
    print(f"model {args.preset}: {parameter_count(spec):,} parameters, layers {list(spec.model.layers.kinds)}",
          flush=True)
    params = {k: v.to(device).requires_grad_(True) for k, v in init_params(spec, args.seed).items()}
    sampler = BatchSampler(data["stream"], args.seq_len, args.batch, device, args.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")   # TF32 for the fp32 GDN chunk math while training
    trainer = Trainer(train_config(args), spec, params, sampler, data["evalsets"], device,
                      epoch_tokens=int(data["stream"].numel()))
    trainer.run()
    return config, spec, trainer


def collect_metrics(args, config: dict, spec, trainer: Trainer, data: dict, evals: dict, device) -> dict:
    train_logs = [r for r in trainer.curve if "train_loss" in r]
    first, last = train_logs[0], train_logs[-1]
    return {
        "heldout": evals["heldout"], "valid": evals["valid"], "sample": evals["sample"], "corpus": data["stats"],
        "model": {"preset": args.preset, "parameters": parameter_count(spec), "vocab_size": config["vocab_size"]},
        "training": {"device": str(device), "steps": trainer.step, "tokens": trainer.tokens,
                     "epochs": trainer.tokens / data["stream"].numel(), "train_seconds": round(trainer.seconds, 1),
                     "tokens_per_s": round(trainer.tokens / trainer.seconds), "best_step": trainer.best["step"],
                     "first_train_loss": first["train_loss"], "last_train_loss": last["train_loss"],
                     "first_mtp_loss": first["mtp_loss"], "last_mtp_loss": last["mtp_loss"],
                     "torch": torch.__version__, "args": vars(args)},
    }


def report(metrics: dict, files: list[Path]) -> None:
    sizes = {f.name: f.stat().st_size for f in files}
    print("files", sizes, f"total {sum(sizes.values()) / 1e6:.1f} MB in {len(sizes)} files", flush=True)
    h, t = metrics["heldout"], metrics["training"]
    print("sample:\n" + metrics["sample"], flush=True)
    print(f"RESULT held-out bits/byte {h['bits_per_byte']:.4f}  MTP agreement {h['mtp_agreement']:.4f}  "
          f"train loss {t['first_train_loss']:.3f} → {t['last_train_loss']:.3f}  "
          f"MTP loss {t['first_mtp_loss']:.3f} → {t['last_mtp_loss']:.3f}  "
          f"{t['tokens']:,} tokens ({t['epochs']:.2f} epochs) at {t['tokens_per_s']:,} tok/s  "
          f"{t['total_seconds']} s total", flush=True)


def _main(args) -> dict:
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    data = prepare_data(args)
    print("corpus", data["stats"], flush=True)
    config, spec, trainer = run_training(args, data, device)
    weights = trainer.best_params or trainer.params
    out = Path(args.out)
    files = write_checkpoint(out, config, spec, weights, data["tokenizer"])
    evals = final_metrics(spec, weights, data, args, device)
    metrics = collect_metrics(args, config, spec, trainer, data, evals, device)
    metrics["training"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    files += write_logs(out, metrics, trainer.curve, args.merged_log)
    report(metrics, files)
    return metrics


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
