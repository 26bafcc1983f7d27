"""hf_model: the HF transformers model of a model spec for the baseline — `Qwen3_5ForCausalLM` in the
spec's shape (no MTP: HF has none), built on the meta device and materialised directly on the target
device with seeded random values (no minutes of CPU init).

Owns: the `Qwen3_5TextConfig` of a `ModelSpec`, the meta-device model, the name-by-name check of its
parameters against `compiler.spec.tensor_table` (mtp.* excluded), the seeded random fill, and which GDN
implementation HF resolves to. Timing and reporting are lab/hf_baseline.py's.
"""
from __future__ import annotations

import importlib.util
import math

import torch

from compiler.spec import ModelSpec, tensor_table


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


def materialize(model, config, device: torch.device, seed: int) -> list[str]:
    """meta -> `device` (uninitialised storage), then every parameter drawn on the device from a seeded
    generator and the RoPE buffers recomputed. Values: matrices and embedding N(0, 0.02); zero-centred
    RMSNorm weights 0 (scale 1); GDN gated-norm weight 1 (it multiplies directly); conv N(0, 0.5);
    A_log = log U(0.5, 4) and dt_bias = -2 + N(0, 0.3) as in ninfer_gen/weights/random_weights.py. Returns the
    names of the buffers it recomputed."""
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
    return sorted(rebuilt)


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
