"""precision: how far bf16 activations move a model's logits, per position, and where the GPU backend
sits in that spread. Four logit sets over the same teacher-forced tokens — the reference interpreter in
fp32 (the oracle), the interpreter in bf16 (activations rounded at every graph value), the floor (fp32
with only the activations entering a linear rounded to bf16: the rounding any backend with bf16 GEMM
inputs must do), the GPU backend (whole prefill, and one decode step per token) — compared pairwise by
rel-L2 per position (max, 99th percentile, mean and the worst positions).

The tiny spec's random weights amplify rounding at a few positions (NOTES.md 2026-12-02 session 7: a
GDN head whose output is a small sum of near-orthogonal terms, made unit-scale again by the gated
norm), so the interpreter's own bf16 mode is the yardstick for what bf16 activations can reach there,
and the floor shows how much of it the bf16 GEMM inputs alone cause.

    python -m lab.precision                        # tiny spec, random weights, seeds as the GPU tier
    python -m lab.precision --model models/qwen3.8-small-py --positions 256
    python -m lab.precision --no-gpu               # the interpreter's modes only (any machine)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ninfer_gen
from compiler.spec import load_spec


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: ‖a − b‖ / ‖b‖ (in fp64)."""
    return (a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1)


def summary(err: torch.Tensor, worst: int = 5) -> dict:
    top = err.topk(min(worst, len(err)))
    return {"max": err.max().item(), "p99": err.quantile(0.99).item(), "mean": err.mean().item(),
            "worst": [(int(i), round(float(v), 4)) for v, i in zip(top.values, top.indices)]}


def decode_steps(be, ids: list[int]) -> torch.Tensor:
    """The GPU backend's logits with one decode step per token (the GPU tier's teacher-forced decode)."""
    seq = be.new_sequence()
    try:
        return torch.stack([be.run("step", [seq], [[t]])[0][-1].float().cpu() for t in ids])
    finally:
        be.release(seq)


def load(model: str | None, seed: int):
    """(spec, quantised weights): a checkpoint directory, or a spec with seeded random weights."""
    from ninfer_gen.weights.checkpoint import load_checkpoint, quantize_weights
    from ninfer_gen.weights.random_weights import random_weights
    if model and not model.endswith((".yaml", ".yml")):
        spec, tensors = load_checkpoint(model, require_mtp=False)
        return spec, quantize_weights(spec, tensors)
    spec = load_spec(model or "model_specs/qwen3.8-tiny.yaml")
    return spec, quantize_weights(spec, random_weights(spec, seed=seed))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="spec YAML (random weights) or checkpoint dir (default: tiny spec)")
    ap.add_argument("--weight-seed", type=int, default=0)
    ap.add_argument("--positions", type=int, default=256, help="teacher-forced tokens per run")
    ap.add_argument("--token-seeds", default="1,2", help="comma-separated seeds of the random token runs")
    ap.add_argument("--no-gpu", action="store_true",
                    help="only the interpreter's modes: fp32, bf16 and the floor (CPU is enough)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from ninfer_gen.weights.checkpoint import dequantized
    from ninfer_gen.reference import ReferenceBackend
    spec, q = load(args.model, args.weight_seed)
    deq = dequantized(q)
    device = "cpu" if args.no_gpu or not torch.cuda.is_available() else "cuda"
    ctx = args.positions + 64
    models = {name: ninfer_gen.Model(spec, ReferenceBackend(spec, deq, device=device, dtype=dt, kv_dtype="int8",
                                                                max_context=ctx, bf16_matmul_inputs=floor), None, name)
              for name, dt, floor in (("ref-f32", "float32", False), ("ref-bf16", "bfloat16", False),
                                      ("floor", "float32", True))}
    if device == "cuda":
        from ninfer_gen.executor.device_weights import from_host
        from ninfer_gen.executor.gpu_backend import GpuBackend
        from ninfer_gen.cli.env import build_root
        gpu = GpuBackend(spec, from_host(spec, q), max_context=ctx, all_logits=True, build_root=build_root())
        models["gpu"] = ninfer_gen.Model(spec, gpu, None, "gpu")
    pairs = [("ref-bf16", "ref-f32"), ("floor", "ref-f32"), ("gpu", "ref-f32"), ("gpu", "ref-bf16"),
             ("gpu-step", "ref-f32"), ("gpu-step", "ref-bf16")]
    out = {"model": spec.name, "positions": args.positions, "runs": {}}
    for seed in (int(s) for s in args.token_seeds.split(",")):
        ids = torch.randint(0, spec.model.vocab_size, (args.positions,),
                            generator=torch.Generator().manual_seed(seed)).tolist()
        logits = {name: torch.from_numpy(m.forward_logits(ids)) for name, m in models.items()}
        if "gpu" in models:
            logits["gpu-step"] = decode_steps(models["gpu"].backend, ids)
        run = out["runs"][seed] = {}
        for a, b in pairs:
            if a in logits and b in logits:
                s = run[f"{a} vs {b}"] = summary(rel_l2(logits[a], logits[b]))
                print(f"tokens seed {seed}: {a:8s} vs {b:8s} rel-L2 max {s['max']:.4f} p99 {s['p99']:.4f} "
                      f"mean {s['mean']:.4f}  worst (position, rel-L2) {s['worst']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
