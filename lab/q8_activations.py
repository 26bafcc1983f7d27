"""q8_activations: what int8 activations would do to a model's logits — the numerics question of issue 34's
second structural option (k-quant GEMVs on integer MMA: the codes as int8 A fragments, the activations quantised to
int8 with one scale per 32 columns, as llama.cpp's q8_1). Three reference-interpreter runs over the same
teacher-forced tokens: fp32 (the oracle), the bf16 floor (fp32 with only the activations entering a linear rounded
to bf16 — what every bf16-input GEMM does today) and the q8 floor (those activations rounded to bf16, then to int8
with a per-32-column absmax scale: x' = round(x·127/amax)·amax/127). Compared by rel-L2 per position and argmax
agreement against fp32. Every linear is quantised, an upper bound: in a Q4_K_M GGUF only the k-quant matrices would
be. CPU is enough.

    python -m lab.q8_activations --model models/qwen3.8-small-py --text compiler/interpret.py --positions 256
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ninfer_gen
import ninfer_gen.api
from compiler import interpret
from lab.precision import load, rel_l2, summary

GROUP = 32


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """bf16(x), then int8 codes with one absmax scale per GROUP columns of the last dim, as values of x's dtype."""
    b = x.to(torch.bfloat16).float()
    g = b.reshape(*b.shape[:-1], b.shape[-1] // GROUP, GROUP)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(g / scale).clamp(-127, 127) * scale).reshape(x.shape).to(x.dtype)


def _q8_linear(reference):
    def linear(x, w):
        return reference(q8_rounded(x), w)
    return linear


def tokens(spec, args) -> list[list[int]]:
    """The teacher-forced token runs: the text file's tokens (in-distribution for a trained model), then seeded
    random ids."""
    runs = []
    if args.text:
        tokenizer, _ = ninfer_gen.api.resolve_tokenizer(args.model)
        runs.append(list(tokenizer.encode(Path(args.text).read_text()))[:args.positions])
    for seed in (int(s) for s in args.token_seeds.split(",") if s):
        runs.append(torch.randint(0, spec.model.vocab_size, (args.positions,),
                                  generator=torch.Generator().manual_seed(seed)).tolist())
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qwen3.8-small-py", help="checkpoint dir or spec YAML (random weights)")
    ap.add_argument("--text", default=None, help="a text file whose first --positions tokens are one run")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--token-seeds", default="1", help="comma-separated seeds of random-token runs ('' for none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from ninfer_gen.reference import ReferenceBackend
    from ninfer_gen.weights.checkpoint import dequantized
    spec, q = load(args.model, 0)
    deq = dequantized(q)
    ctx = args.positions + 64

    def model(name: str, floor: bool):
        return ninfer_gen.Model(spec, ReferenceBackend(spec, deq, device="cpu", dtype="float32", kv_dtype="int8",
                                                       max_context=ctx, bf16_matmul_inputs=floor), None, name)

    oracle, bf16 = model("ref-f32", False), model("floor-bf16", True)
    rounding = interpret._rounded_to_bf16
    interpret._rounded_to_bf16 = _q8_linear             # the floor's rounding, replaced for the q8 model's programs
    try:
        q8 = model("floor-q8", True)
        runs = tokens(spec, args)
        logits = [{"q8": torch.from_numpy(q8.forward_logits(ids))} for ids in runs]
    finally:
        interpret._rounded_to_bf16 = rounding
    out = {"model": spec.name, "positions": args.positions, "group": GROUP, "runs": []}
    for ids, got in zip(runs, logits):
        got["f32"] = torch.from_numpy(oracle.forward_logits(ids))
        got["bf16"] = torch.from_numpy(bf16.forward_logits(ids))
        run = {"tokens": len(ids)}
        for name in ("bf16", "q8"):
            s = run[name] = summary(rel_l2(got[name], got["f32"]))
            s["argmax_agree"] = (got[name].argmax(-1) == got["f32"].argmax(-1)).float().mean().item()
            print(f"{len(ids)} tokens ({'text' if args.text and ids is runs[0] else 'random'}): floor {name:4s} vs "
                  f"fp32 rel-L2 max {s['max']:.4f} p99 {s['p99']:.4f} mean {s['mean']:.4f}, argmax agreement "
                  f"{s['argmax_agree']:.4f}")
        out["runs"].append(run)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
