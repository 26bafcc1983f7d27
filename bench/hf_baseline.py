"""hf_baseline: the HF transformers eager baseline — `Qwen3_5ForCausalLM` with seeded random weights in the
shape of a model spec (default the 27B), timed for decode and prefill on one GPU, so our engine can be
compared with HF "the same day" on the same machine.

Owns: building an HF `Qwen3_5TextConfig` from a `ModelSpec` (no MTP: HF has none), creating the model
on the meta device and materialising it directly on the target device (no minutes of CPU init), filling
it with seeded random values, the decode / prefill timing loops, and the JSON + table it reports.
It checks that HF's parameters match `compiler.spec.tensor_table` (mtp.* excluded) name by name.
Nothing here imports ninfer_gen or touches real checkpoints; it is a measurement, not a test.

    python -m bench.hf_baseline --out $OUT/hf_baseline.json           # 27B, cuda, bf16, sdpa
    python -m bench.hf_baseline --check-only                          # parameter counts on meta, no device
    python -m bench.hf_baseline --spec model_specs/qwen3.8-tiny.yaml --device cpu --prefill 256 \\
        --decode-tokens 8 --out /tmp/hf.json                          # CPU smoke test

Runs on transformers 5.17 .. 5.24 (the kwarg for the cache is `past_key_values` before ~5.2x and
`cache` after; both are detected from the forward signature). Progress goes to stderr; the table is
the last thing printed on stdout.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import logging
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from compiler.spec import ModelSpec, load_spec, tensor_table

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


# ---------------------------------------------------------------- spec -> HF config / model

def _mrope_section(rotary_dim: int) -> list[int]:
    """[11, 11, 10] scaled to the rotary width (32 frequencies at 27B). Text positions are equal in all
    three rows, so the split has no effect on text; it only has to sum to rotary_dim / 2."""
    n = rotary_dim // 2
    a = round(n * 11 / 32)
    return [a, a, n - 2 * a]


def hf_config_from_spec(spec: ModelSpec, dtype: torch.dtype, attn_implementation: str):
    from transformers import Qwen3_5TextConfig

    a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
    if not at.output_gate:
        raise ValueError("HF Qwen3_5 always has the attention output gate; the spec has output_gate: false")
    rope = {"rope_type": "default", "rope_theta": float(at.rope_theta),
            "partial_rotary_factor": float(at.partial_rotary_factor),
            "mrope_section": _mrope_section(at.rotary_dim), "mrope_interleaved": True}
    return Qwen3_5TextConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers.count, layer_types=list(a.layers.kinds),
        num_attention_heads=at.num_heads, num_key_value_heads=at.num_kv_heads, head_dim=at.head_dim,
        linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
        linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
        linear_conv_kernel_dim=g.conv_kernel, rms_norm_eps=a.rms_norm_eps,
        tie_word_embeddings=a.tie_word_embeddings, max_position_embeddings=a.max_position_embeddings,
        rope_parameters=rope, hidden_act="silu", use_cache=True,
        dtype=str(dtype).removeprefix("torch."), attn_implementation=attn_implementation,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)


def build_meta_model(config, dtype: torch.dtype):
    """The model on the meta device: parameters in `dtype` (via the default dtype, as from_pretrained
    does), buffers that HF creates explicitly in fp32 (RoPE inv_freq) stay fp32. No memory, no init cost."""
    from transformers import Qwen3_5ForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def check_parameters(model, spec: ModelSpec) -> dict:
    """HF's parameters against tensor_table(spec) without mtp.*: counts, and names/shapes one by one."""
    ours = {t.name: tuple(t.shape) for t in tensor_table(spec) if not t.name.startswith("mtp.")}
    hf = {}
    for name, p in model.named_parameters():
        hf[name.removeprefix("model.")] = tuple(p.shape)
    missing = sorted(set(ours) - set(hf))
    extra = sorted(set(hf) - set(ours))
    shape_diff = sorted(f"{n}: hf {hf[n]} spec {ours[n]}" for n in set(ours) & set(hf) if hf[n] != ours[n])
    hf_count = sum(math.prod(s) for s in hf.values())
    spec_count = sum(math.prod(s) for s in ours.values())
    matrix = sum(math.prod(s) for n, s in hf.items() if len(s) == 2 and n != "embed_tokens.weight")
    lm_head = math.prod(hf["lm_head.weight"]) if "lm_head.weight" in hf else 0
    return {"hf_parameters": hf_count, "spec_parameters_excl_mtp": spec_count, "equal": hf_count == spec_count
            and not (missing or extra or shape_diff), "hf_tensors": len(hf), "spec_tensors": len(ours),
            "missing_in_hf": missing[:20], "extra_in_hf": extra[:20], "shape_mismatch": shape_diff[:20],
            "matrix_params_excl_embedding": matrix, "matrix_params_excl_embedding_and_lm_head": matrix - lm_head}


def materialize(model, config, device: torch.device, seed: int) -> None:
    """meta -> `device` (uninitialised storage), then every parameter drawn on the device from a seeded
    generator and the RoPE buffers recomputed. Values: matrices and embedding N(0, 0.02); zero-centred
    RMSNorm weights 0 (scale 1); GDN gated-norm weight 1 (it multiplies directly); conv N(0, 0.5);
    A_log = log U(0.5, 4) and dt_bias = -2 + N(0, 0.3) as in ninfer_gen/random_weights.py."""
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.uniform_(0.5, 4.0, generator=gen).log_()
            elif name.endswith("dt_bias"):
                p.normal_(-2.0, 0.3, generator=gen)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        rebuilt = set()
        for mod_name, module in model.named_modules():
            own = dict(module.named_buffers(recurse=False))
            if not own:
                continue
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(config=config)          # on CPU, fp32 inv_freq, as HF computes it
                for bname, buf in own.items():
                    buf.copy_(getattr(fresh, bname).to(buf.dtype))
                    rebuilt.add(f"{mod_name}.{bname}")
            else:
                raise RuntimeError(f"don't know how to initialise buffers {list(own)} of {mod_name} "
                                   f"({type(module).__name__}) after to_empty")
    log(f"recomputed buffers: {sorted(rebuilt)}")


# ---------------------------------------------------------------- which GDN path HF uses

def _describe(fn) -> str:
    if fn is None:
        return "None"
    code = getattr(fn, "__code__", None)
    if code is not None and fn.__closure__:   # 5.2x hub-kernel wrapper: the resolved implementation lives in the closure
        cells = dict(zip(code.co_freevars, fn.__closure__))
        if "implementation" in cells:
            try:
                fn = cells["implementation"].cell_contents
            except ValueError:
                pass
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def gdn_path(model) -> dict:
    """Best-effort: which packages exist and what the GDN kernels resolve to (module-level functions and,
    for older transformers, the attributes stored on the layer). 'torch' means HF's own torch fallback."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "chunk_gated_delta_rule",
             "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
    resolved = {f"module.{n}": _describe(getattr(mq, n)) for n in names if hasattr(mq, n)}
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is not None:
        for n in names:
            if n in vars(layer) or hasattr(type(layer), n):
                resolved[f"layer.{n}"] = _describe(getattr(layer, n))
    if hasattr(mq, "is_fast_path_available"):
        resolved["module.is_fast_path_available"] = repr(mq.is_fast_path_available)
    packages = {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d", "kernels")}
    fast = any(v.startswith(("fla.", "causal_conv1d", "kernels")) for v in resolved.values())
    return {"path": "fla/causal_conv1d kernels" if fast else "torch fallback (transformers' own torch code)",
            "packages_importable": packages, "resolved": resolved}


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
    p = argparse.ArgumentParser(prog="python -m bench.hf_baseline", description=__doc__.split("\n\n")[0],
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
        "tool": "bench.hf_baseline", "spec": args.spec, "dtype": str(dtype).removeprefix("torch."),
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
        materialize(model, config, device, args.seed)
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
