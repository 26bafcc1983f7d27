"""hf_fixtures: tiny random Qwen3.5 checkpoints built with HF transformers, plus HF-side oracles
(logits, greedy generation, an MTP head assembled from HF's own layer classes).

Test helpers only: no assertions about ninfer_gen live here, and nothing here imports ninfer_gen.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

LIN, FULL = "linear_attention", "full_attention"

# 3 value heads per key head (the 27B grouping), untied head. Every matrix K-dim is a multiple of 64.
SHAPE_A = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
               layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32,
               linear_value_head_dim=32, tie_word_embeddings=False)
# Tied embeddings, two attention layers, 2 value heads per key head.
SHAPE_B = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
               layer_types=[LIN, LIN, LIN, FULL] * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
               linear_value_head_dim=32, tie_word_embeddings=True)

# Text RoPE of the family; mrope_section is scaled to the tiny rotary width (16 dims → 8 frequencies)
# and has no effect on text, whose three position rows are equal.
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True}
WEIGHTS_FILE = "model.safetensors"


class HFCheckpoint(NamedTuple):
    path: Path | None                         # None for a model built in memory only
    model: Qwen3_5ForCausalLM                 # fp32, eval, same weights as the files
    mtp: dict[str, torch.Tensor]              # the `mtp.*` tensors written to the file


def text_config(shape: dict) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**shape, rope_parameters=dict(ROPE), rms_norm_eps=1e-6,
                             max_position_embeddings=4096, hidden_act="silu", dtype="float32",
                             eos_token_id=None, bos_token_id=None, pad_token_id=None,
                             mtp_num_hidden_layers=1)


# ---------------------------------------------------------------- random O(1) weights

def _init_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor at O(1) scale (MODEL.md: HF's default init gives flat logits that hide bugs)."""
    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if name.endswith("A_log"):
        # A in [0.5, 4] keeps the GDN state alive across tokens, so fp32 rounding is not amplified.
        return torch.empty(shape).uniform_(0.5, 4.0, generator=gen).log()
    if name.endswith("dt_bias"):
        # softplus(a + dt_bias) from ~0.13 down to ~0.02: with A in [0.5, 4] some heads forget within a
        # few tokens and some keep ~50% of their state over a 64-token chunk, so a chunked-prefill bug
        # in the state carried between chunks moves logits by O(0.1–1), not by the 7e-3 that
        # dt_bias ≈ −2 alone gives. HF fp32 vs fp64 stays ≤ 1e-4 either way.
        return torch.empty(shape).uniform_(-4.0, -2.0, generator=gen)
    if name.endswith("conv1d.weight"):
        return randn(0.5)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + randn(0.1)      # the gated norm multiplies by w directly (not 1 + w)
    if "norm" in name and len(shape) == 1:
        return randn(0.1)            # zero-centred RMSNorm: the scale is 1 + w
    if name.endswith("embed_tokens.weight"):
        return randn(1.0)
    if name.endswith("lm_head.weight"):
        return randn(2.0 / math.sqrt(shape[1]))   # logit std ≈ 2 on unit-RMS hidden states
    if name.endswith("in_proj_a.weight"):
        return randn(0.5 / math.sqrt(shape[1]))   # softplus(a + dt_bias) stays near 0.13: moderate decay
    if len(shape) == 2:
        return randn(1.0 / math.sqrt(shape[1]))   # unit-variance outputs for unit-RMS inputs
    raise ValueError(f"no init rule for {name} {shape}")


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter in place, in name order so the result depends on the seed only."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):   # tied weights are listed once
            p.copy_(_init_value(name, tuple(p.shape), gen))


def build_hf_model(shape: dict, seed: int) -> Qwen3_5ForCausalLM:
    with torch.random.fork_rng():   # HF's own init draws from the global RNG; its values are all overwritten
        model = Qwen3_5ForCausalLM(text_config(shape)).float().eval()
    randomize_(model, seed)
    if model.config.tie_word_embeddings:
        # The tied head reuses E, so logit std = σ·sqrt(hidden): σ = 0.5 gives ≈ 4 at hidden 64, large
        # enough for clear greedy choices, small enough that fp32 rounding stays ~1e-4 absolute.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.5)
    return model


def mtp_layer_index(config: Qwen3_5TextConfig) -> int:
    """A full-attention layer index, so HF's Qwen3_5DecoderLayer builds gated attention for the MTP."""
    return config.layer_types.index(FULL)


def make_mtp_state(config: Qwen3_5TextConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors (MODEL.md §6), the decoder layer's names taken from HF's own class."""
    h = config.hidden_size
    gen = torch.Generator().manual_seed(seed + 7919)
    state = {name: _init_value(name, shape, gen) for name, shape in [
        ("mtp.fc.weight", (h, 2 * h)), ("mtp.pre_fc_norm_embedding.weight", (h,)),
        ("mtp.pre_fc_norm_hidden.weight", (h,)), ("mtp.norm.weight", (h,))]}
    with torch.random.fork_rng():
        layer = Qwen3_5DecoderLayer(config, mtp_layer_index(config))
    randomize_(layer, seed + 7920)
    state.update({f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
    return state


# ---------------------------------------------------------------- checkpoint folders

def make_hf_checkpoint(path, shape: dict, seed: int, layout: str = "text", with_mtp: bool = True) -> HFCheckpoint:
    """Write config.json + model.safetensors for a random model; layout "text" or "vlm"."""
    if layout not in ("text", "vlm"):
        raise ValueError(f"layout must be 'text' or 'vlm', got {layout!r}")
    path = Path(path)
    model = build_hf_model(shape, seed)
    model.save_pretrained(path)
    # No eos anywhere: generation must run to max_new_tokens on both sides.
    (path / "generation_config.json").unlink(missing_ok=True)
    mtp = make_mtp_state(model.config, seed) if with_mtp else {}
    tensors = load_file(path / WEIGHTS_FILE)
    config = json.loads((path / "config.json").read_text())
    if layout == "vlm":
        tensors, config = _to_vlm(tensors, config)
    tensors.update(mtp)
    config.get("text_config", config)["mtp_num_hidden_layers"] = 1 if with_mtp else 0
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return HFCheckpoint(path, model, mtp)


# A minimal vision tower (a real VLM checkpoint carries one, which the loader checks and loads).
VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64, "intermediate_size": 64,
          "num_heads": 1, "in_channels": 3, "patch_size": 2, "temporal_patch_size": 2,
          "spatial_merge_size": 2, "num_position_embeddings": 16}


def _to_vlm(tensors: dict, text: dict) -> tuple[dict, dict]:
    """Rename to the real VLM layout (`model.language_model.*`), nest the text settings and add a random vision
    tower (`model.visual.*`) of the config's vision_config."""
    from compiler.spec import vision_tensor_table
    from compiler.spec_hf import spec_from_hf_config

    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in tensors.items()}
    text = {k: val for k, val in text.items() if k not in ("architectures", "transformers_version")}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text, "vision_config": dict(VISION, out_hidden_size=text["hidden_size"]),
              "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": text["vocab_size"] - 4,
              "video_token_id": text["vocab_size"] - 3, "vision_start_token_id": text["vocab_size"] - 2,
              "vision_end_token_id": text["vocab_size"] - 1}
    gen = torch.Generator().manual_seed(len(out))
    for t in vision_tensor_table(spec_from_hf_config(config, vision="require")):
        out["model." + t.name] = torch.randn(t.shape, generator=gen) * 0.1
    return out, config


def load_mtp_state(path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(Path(path) / WEIGHTS_FILE).items() if k.startswith("mtp.")}


# ---------------------------------------------------------------- HF-side oracles

def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


@torch.no_grad()
def hf_logits(hf_model: Qwen3_5ForCausalLM, token_ids: list[int]) -> np.ndarray:
    """Fresh-sequence logits [T, V] (HF's chunked GDN path, no cache)."""
    return hf_model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def hf_generate(hf_model: Qwen3_5ForCausalLM, token_ids: list[int], n: int) -> list[int]:
    """HF greedy decoding with its cache (recurrent GDN path), exactly n new tokens, no eos stop."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0, use_cache=True)
    ids = torch.tensor([token_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    new = out[0, len(token_ids):].tolist()
    if len(new) != n:
        raise RuntimeError(f"HF generated {len(new)} tokens, expected {n}")
    return new


def top2_gaps(logits: np.ndarray) -> np.ndarray:
    """Per row, the best logit minus the runner-up: how firmly greedy decoding picks its token."""
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def hf_decode_gaps(hf_model: Qwen3_5ForCausalLM, prompt: list[int], generated: list[int]) -> np.ndarray:
    """Top-2 gap at each decode step, from one teacher-forced forward over prompt + generated."""
    logits = hf_logits(hf_model, prompt + generated[:-1])
    return top2_gaps(logits[len(prompt) - 1:])


def safe_prefix(gaps: np.ndarray, margin: float) -> int:
    """Number of leading steps whose greedy choice is unambiguous (gap ≥ margin)."""
    below = np.flatnonzero(gaps < margin)
    return int(below[0]) if below.size else len(gaps)


def _zc_norm(config: Qwen3_5TextConfig, weight: torch.Tensor) -> Qwen3_5RMSNorm:
    norm = Qwen3_5RMSNorm(weight.shape[0], eps=config.rms_norm_eps)
    norm.weight.data.copy_(weight)
    return norm


def _mtp_decoder_layer(config: Qwen3_5TextConfig, mtp: dict[str, torch.Tensor]) -> Qwen3_5DecoderLayer:
    with torch.random.fork_rng():   # its random init is replaced by the checkpoint's tensors
        layer = Qwen3_5DecoderLayer(config, mtp_layer_index(config)).float().eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({k[len(prefix):]: v for k, v in mtp.items() if k.startswith(prefix)}, strict=True)
    return layer


def _causal_mask(t: int) -> torch.Tensor:
    """Additive [1, 1, T, T] mask; an explicit mask works under both eager and sdpa attention."""
    upper = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.zeros(t, t).masked_fill(upper, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def hf_mtp_reference(hf_model: Qwen3_5ForCausalLM, mtp: dict[str, torch.Tensor],
                     token_ids: list[int]) -> np.ndarray:
    """MTP logits [T, V] per MODEL.md §5, built from HF's layer classes: row i predicts x_{i+2} from the
    final-norm hidden y_i and the true next token x_{i+1} at position i; row T−1 takes the main
    model's own argmax as its next token."""
    cfg = hf_model.config
    ids = torch.tensor([token_ids])
    y = hf_model.model(input_ids=ids, use_cache=False).last_hidden_state   # already after the final norm
    last = hf_model.lm_head(y[:, -1:]).argmax(-1)
    nxt = torch.cat([ids[:, 1:], last], dim=1)
    e = _zc_norm(cfg, mtp["mtp.pre_fc_norm_embedding.weight"])(hf_model.get_input_embeddings()(nxt))
    n = _zc_norm(cfg, mtp["mtp.pre_fc_norm_hidden.weight"])(y)
    u = torch.cat([e, n], dim=-1) @ mtp["mtp.fc.weight"].T        # order [embedding, hidden]
    pos = torch.arange(len(token_ids))[None]
    rope = Qwen3_5TextRotaryEmbedding(cfg)(u, pos)
    u = _mtp_decoder_layer(cfg, mtp)(u, position_embeddings=rope, attention_mask=_causal_mask(len(token_ids)),
                                      position_ids=pos)
    out = _zc_norm(cfg, mtp["mtp.norm.weight"])(u)
    return hf_model.get_output_embeddings()(out)[0].numpy()
