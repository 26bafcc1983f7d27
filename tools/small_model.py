"""small_model: the small trained model's HF config (the single source of its shape), the spec derived
from it, and its initial weights in canonical names.

Writes no model math: the forward is `compiler.model.reference_forward`.
"""
from __future__ import annotations

import math

import torch

from compiler.spec import ModelSpec, tensor_table
from compiler.spec_hf import spec_from_hf_config

LIN, FULL = "linear_attention", "full_attention"
MODEL_NAME = "qwen3.8-small-py"

# Shapes of the Qwen3.5 family at small sizes: 3:1 GDN/attention, 2 value heads per key head,
# partial RoPE (0.25), conv 4, one MTP layer, tied embeddings. Every matrix K-dim is a multiple of 64.
PRESETS = {
    # ~21 M parameters: fits three 15 MB bf16 shards.
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=128, linear_value_head_dim=128),
    # CPU smoke test and tests: same structure, tiny widths.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=32, linear_value_head_dim=32),
}
INIT_STD = 0.02
# Residual-branch outputs start smaller (GPT-2 style) so the residual stream does not grow with depth.
OUTPUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def hf_config(preset: str, vocab_size: int, eot_id: int, max_positions: int = 8192) -> dict:
    """A flat `qwen3_5_text` config.json with every Qwen3_5TextConfig field, plus the MTP layer."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    shape = PRESETS[preset]
    n = shape["num_hidden_layers"]
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        **shape,
        "layer_types": [FULL if (i + 1) % 4 == 0 else LIN for i in range(n)],
        "full_attention_interval": 4,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def model_spec(config: dict) -> ModelSpec:
    """The spec of a saved config; training uses exactly this, so file and model cannot disagree."""
    spec = spec_from_hf_config(config, name=MODEL_NAME)
    bad = [f"{t.name} {t.shape}" for t in tensor_table(spec) if len(t.shape) == 2 and t.shape[1] % 64]
    if bad:
        raise ValueError(f"every matrix K-dim must be a multiple of 64; not so for: {', '.join(bad)}")
    return spec


def parameter_count(spec: ModelSpec) -> int:
    return sum(t.numel for t in tensor_table(spec))


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def _init_tensor(name: str, shape: tuple[int, ...], n_layers: int, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):           # A ~ U[1, 16]
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):         # softplus(dt_bias) = dt, dt log-uniform in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return _inverse_softplus(dt)
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)         # the gated norm multiplies by its weight directly
    if len(shape) == 1 and "norm" in name:
        return torch.zeros(shape)        # zero-centred RMSNorms (incl. the MTP pre-fc norms): 1 + w
    if name.endswith("conv1d.weight"):   # nn.Conv1d's default: U(±1/sqrt(fan_in)), fan_in = width
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if len(shape) == 2:
        std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(OUTPUT_PROJ) else INIT_STD
        return torch.randn(shape, generator=gen) * std
    raise ValueError(f"no init rule for tensor {name} {shape}")


def init_params(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Fresh fp32 weights in canonical names, in tensor_table order."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = spec.model.layers.count + spec.model.mtp.num_layers
    return {t.name: _init_tensor(t.name, t.shape, n_layers, gen) for t in tensor_table(spec)}
