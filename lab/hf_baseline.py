"""hf_baseline: the HF transformers eager baseline — `Qwen3_5ForCausalLM` with seeded random weights in the
shape of a model spec (default the 27B), timed for decode and prefill on one GPU, so our engine can be
compared with HF "the same day" on the same machine.

Owns: the decode / prefill timing loops, the transformers log capture, the command line, and the JSON +
table it reports. The model itself (config from the spec, meta-device build, parameter check against
`compiler.spec.tensor_table`, seeded random fill, GDN path) is lab/hf_model.py's.
Nothing here imports ninfer_gen or touches real checkpoints; it is a measurement, not a test.

    python -m lab.hf_baseline --out $OUT/hf_baseline.json            # 27B, cuda, bf16, sdpa
    python -m lab.hf_baseline --check-only                           # parameter counts on meta, no device
    python -m lab.hf_baseline --spec model_specs/qwen3.8-tiny.yaml --device cpu --prefill 256 \\
        --decode-tokens 8 --out /tmp/hf.json                          # CPU smoke test

Runs on transformers 5.17 .. 5.24 (the kwarg for the cache is `past_key_values` before ~5.2x and
`cache` after; both are detected from the forward signature). Progress goes to stderr; the table is
the last thing printed on stdout.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from compiler.spec import load_spec
from lab.hf_model import build_meta_model, check_parameters, gdn_path, hf_config_from_spec, materialize

FLOP_FORMULA = ("TFLOP/s = 2 * matrix_params_excl_embedding * tokens / seconds / 1e12, where "
                "matrix_params_excl_embedding counts every 2-D weight except embed_tokens (lm_head included, "
                "although prefill computes logits for the last token only); attention's quadratic term, the "
                "GDN recurrence, conv and norms are not counted")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


def log(msg: str) -> None:
    print(f"[hf_baseline] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- transformers log capture

class _Capture(logging.Handler):
    """Keeps every transformers log record (warnings included) for the JSON; the normal handler still prints."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        try:
            msg = f"{record.levelname} {record.name}: {record.getMessage()}"
        except Exception:  # noqa: BLE001 - a bad format string must not break the benchmark
            msg = f"{record.levelname} {record.name}: {record.msg!r}"
        if msg not in self.messages:
            self.messages.append(msg)


# ---------------------------------------------------------------- measurements

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    raise RuntimeError("the model returned no cache with use_cache=True")


def measure_decode(model, device, batch: int, prompt_len: int, steps: int, warmup: int, seed: int) -> dict:
    """Greedy decode with HF's own cache: prompt forward (untimed), `warmup` untimed steps, then `steps`
    timed single-token forwards, each fed the previous argmax."""
    vocab = model.config.vocab_size
    kw = _cache_kwarg(model)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed + batch))
    ids = ids.to(device)
    _reset_peak(device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, nxt = _out_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(warmup):
        out = model(input_ids=nxt, use_cache=True, **{kw: cache})
        cache, nxt = _out_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = []
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, use_cache=True, **{kw: cache})
        cache, nxt = _out_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
    _sync(device)
    dt = time.perf_counter() - t0
    finite = bool(torch.isfinite(out.logits).all().item())
    row0 = torch.cat(tokens, dim=1)[0, :16].tolist() if tokens else []
    return {"kind": "decode", "batch": batch, "prompt_tokens": prompt_len, "warmup_steps": warmup,
            "steps": steps, "seconds": dt, "tok_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps,
            "peak_mem_bytes": _peak(device), "logits_finite": finite, "first_tokens_row0": row0,
            "cache_class": type(cache).__name__, "cache_kwarg": kw}


def measure_prefill(model, device, length: int, seed: int, matrix_params: int) -> dict:
    """One forward over `length` random tokens with use_cache=True (KV and GDN state are produced, as a
    real prefill must) and logits for the last token only."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed + length))
    ids = ids.to(device)
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    _sync(device)
    dt = time.perf_counter() - t0
    return {"kind": "prefill", "tokens": length, "seconds": dt, "tok_s": length / dt,
            "tflop_s": 2 * matrix_params * length / dt / 1e12, "peak_mem_bytes": _peak(device),
            "logits_shape": list(out.logits.shape), "logits_finite": bool(torch.isfinite(out.logits).all().item())}


def guarded(entry: dict, fn, *args) -> dict:
    """Run one measurement; on any failure (OOM included) record the error and carry on."""
    try:
        entry.update(fn(*args))
    except Exception as err:  # noqa: BLE001 - every failure is data here
        entry.update(error=f"{type(err).__name__}: {str(err)[:800]}", traceback=traceback.format_exc()[-2000:])
        log(f"{entry.get('name')} failed: {entry['error'][:200]}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return entry


# ---------------------------------------------------------------- report

def _gib(b):
    return "-" if b is None else f"{b / 2**30:.1f}"


def table(result: dict) -> str:
    env, c = result["environment"], result["config_summary"]
    n = c["parameters_hf"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    lines = [f"HF baseline: {c['spec_name']} ({size} params)  transformers "
             f"{env['transformers']}  torch {env['torch']}  {result['dtype']}  attn={result['attn_implementation']}"
             f"  GDN={result['gdn']['path'].split(' ')[0]}  device={env['device_name']}",
             f"{'measurement':<18}{'tokens':>8}{'seconds':>10}{'tok/s':>11}{'ms/step':>10}{'TFLOP/s':>9}"
             f"{'peak GiB':>10}  note"]
    for m in result["measurements"]:
        if "error" in m:
            lines.append(f"{m['name']:<18}{'':>58}  ERROR {m['error'][:90]}")
            continue
        if m["kind"] == "decode":
            lines.append(f"{m['name']:<18}{m['batch'] * m['steps']:>8}{m['seconds']:>10.3f}{m['tok_s']:>11.2f}"
                         f"{m['ms_per_step']:>10.1f}{'-':>9}{_gib(m['peak_mem_bytes']):>10}"
                         f"  {m['steps']} steps after {m['prompt_tokens']}-token prompt")
        else:
            lines.append(f"{m['name']:<18}{m['tokens']:>8}{m['seconds']:>10.3f}{m['tok_s']:>11.1f}{'-':>10}"
                         f"{m['tflop_s']:>9.1f}{_gib(m['peak_mem_bytes']):>10}  logits_to_keep=1")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lab.hf_baseline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--spec", default="model_specs/qwen3.8-27b.yaml", help="model spec YAML giving the shape")
    p.add_argument("--device", default="cuda", help="torch device to run on (cuda, cuda:1, cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="parameter/activation dtype")
    p.add_argument("--attn", default="sdpa", help="HF attn_implementation for the full-attention layers")
    p.add_argument("--batch", default="1", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length before decode")
    p.add_argument("--decode-tokens", type=int, default=64, help="timed greedy decode steps per batch size")
    p.add_argument("--decode-warmup", type=int, default=4, help="untimed decode steps before the timed ones")
    p.add_argument("--prefill", default="8192,32768", help="comma-separated prefill lengths (one forward each)")
    p.add_argument("--prefill-warmup", type=int, default=256, help="length of the untimed warm-up prefill (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and token ids")
    p.add_argument("--out", default=None, help="write the full JSON result here")
    p.add_argument("--check-only", action="store_true",
                   help="build on the meta device, compare parameter counts with the spec, print them, exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    capture = _Capture()
    logging.getLogger("transformers").addHandler(capture)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())   # set_device() needs an index
    spec = load_spec(args.spec)
    t_start = time.perf_counter()
    config = hf_config_from_spec(spec, dtype, args.attn)
    model = build_meta_model(config, dtype)
    params = check_parameters(model, spec)
    counts = (f"parameters: HF model {params['hf_parameters']:,}  spec tensor_table (excl. mtp.*) "
              f"{params['spec_parameters_excl_mtp']:,}  names and shapes equal: {params['equal']}")
    log(counts)
    if not params["equal"]:
        log(f"parameter mismatch: {json.dumps({k: params[k] for k in ('missing_in_hf', 'extra_in_hf', 'shape_mismatch')})}")
    if args.check_only:
        print(json.dumps(params, indent=2))
        print(counts)
        return 0 if params["equal"] else 1

    cuda = device.type == "cuda"
    env = {"transformers": transformers.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "device": str(device), "device_name": platform.processor() or "cpu",
           "device_total_mem_bytes": None}
    if cuda:
        try:
            env["device_name"] = torch.cuda.get_device_name(device)
            env["device_total_mem_bytes"] = torch.cuda.get_device_properties(device).total_memory
        except Exception as err:  # noqa: BLE001 - reported as the build error below
            env["device_name"] = f"unavailable ({type(err).__name__}: {err})"
    a = spec.model
    result = {
        "tool": "lab.hf_baseline", "spec": args.spec, "dtype": str(dtype).removeprefix("torch."),
        "device": str(device), "seed": args.seed, "environment": env,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "config_summary": {
            "spec_name": spec.name, "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size, "layers": a.layers.count,
            "full_attention_layers": [i for i, k in enumerate(a.layers.kinds) if k == "full_attention"],
            "attention": vars(a.attention), "linear_attention": vars(a.linear_attention),
            "tie_word_embeddings": a.tie_word_embeddings, "rope_parameters": config.rope_parameters,
            "mtp": "not built (HF has no MTP head)", "parameters_hf": params["hf_parameters"]},
        "parameter_check": params, "flop_formula": FLOP_FORMULA,
        "weights": "seeded random: matrices/embedding N(0,0.02), zero-centred norms 0, GDN gated norm 1, "
                   "conv N(0,0.5), A_log=log U(0.5,4), dt_bias=-2+N(0,0.3)",
        "measurements": [],
    }
    t0 = time.perf_counter()
    try:
        if cuda:
            torch.cuda.set_device(device)
        log(f"recomputed buffers: {materialize(model, config, device, args.seed)}")
        _sync(device)
        result["materialize_seconds"] = time.perf_counter() - t0
        result["weights_mem_bytes"] = int(torch.cuda.memory_allocated(device)) if cuda else None
        log(f"model on {device} in {result['materialize_seconds']:.1f} s")
        build_error = None
    except Exception as err:  # noqa: BLE001
        build_error = f"{type(err).__name__}: {str(err)[:800]}"
        result["build_error"] = build_error
        log(f"model build failed: {build_error}")
    result["gdn"] = gdn_path(model)

    if build_error is None:
        with torch.inference_mode():
            if args.prefill_warmup > 0:
                w = guarded({"name": f"warmup prefill {args.prefill_warmup}"}, measure_prefill, model, device,
                            args.prefill_warmup, args.seed, params["matrix_params_excl_embedding"])
                result["prefill_warmup"] = w
            for b in _ints(args.batch):
                log(f"decode batch {b} ...")
                result["measurements"].append(guarded(
                    {"name": f"decode b={b}"}, measure_decode, model, device, b, args.prompt_tokens,
                    args.decode_tokens, args.decode_warmup, args.seed))
            for n in _ints(args.prefill):
                log(f"prefill {n} ...")
                result["measurements"].append(guarded(
                    {"name": f"prefill {n}"}, measure_prefill, model, device, n, args.seed,
                    params["matrix_params_excl_embedding"]))
    result["transformers_log"] = capture.messages
    result["gdn"]["fallback_log"] = [m for m in capture.messages
                                     if any(s in m.lower() for s in ("fall", "fast path", "fla", "causal_conv1d"))]
    result["total_seconds"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {args.out}")
    print(counts)
    if build_error:
        print(f"model build failed: {build_error}")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
