"""vision_fixtures: HF-side helpers for the vision tests — an HF Qwen3.5 config of a spec with a vision section,
O(1)-scale random weights for the vision tower, its tensors under our canonical names, and generated images.

Test helpers only: no assertions about ninfer_gen live here.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3_5Config

from ninfer_gen.vision.preprocess import ImageConfig


def hf_config(spec) -> Qwen3_5Config:
    """The HF Qwen3.5 config of a spec with a vision section (fp32, no eos; the text RoPE's mrope_section is
    the spec's)."""
    v, a = spec.vision, spec.model
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, in_channels=v.in_channels, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                  out_hidden_size=v.out_hidden_size, num_position_embeddings=v.num_position_embeddings,
                  hidden_act=v.hidden_act, rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    text = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                num_hidden_layers=a.layers.count, layer_types=list(a.layers.kinds),
                num_attention_heads=a.attention.num_heads, num_key_value_heads=a.attention.num_kv_heads,
                head_dim=a.attention.head_dim, linear_num_key_heads=a.linear_attention.num_key_heads,
                linear_num_value_heads=a.linear_attention.num_value_heads,
                linear_key_head_dim=a.linear_attention.key_head_dim,
                linear_value_head_dim=a.linear_attention.value_head_dim, linear_conv_kernel_dim=4,
                tie_word_embeddings=a.tie_word_embeddings, max_position_embeddings=a.max_position_embeddings,
                rms_norm_eps=a.rms_norm_eps, hidden_act="silu", dtype="float32", eos_token_id=None,
                bos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": a.attention.rope_theta,
                                 "partial_rotary_factor": a.attention.partial_rotary_factor,
                                 "mrope_section": list(v.mrope_section), "mrope_interleaved": True})
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=v.image_token_id,
                         video_token_id=v.video_token_id, vision_start_token_id=v.vision_start_token_id,
                         vision_end_token_id=v.vision_end_token_id, tie_word_embeddings=a.tie_word_embeddings)


def image_config(spec) -> ImageConfig:
    """Preprocessing for the spec's patch grid, with pixel bounds small enough for tiny test images."""
    v = spec.vision
    f = v.patch_size * v.spatial_merge_size
    return ImageConfig(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                       merge_size=v.spatial_merge_size, min_pixels=(2 * f) ** 2, max_pixels=(6 * f) ** 2)


def vision_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One vision tensor at O(1) scale: HF's init (unit norms, zero biases, 0.02 matrices) makes the tower's
    output nearly constant, and a wrong rotary or position grid would then go unseen."""
    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if "norm" in name:
        return 1.0 + randn(0.1) if name.endswith("weight") else randn(0.1)
    if name.endswith("bias"):
        return randn(0.1)
    if name.endswith("pos_embed.weight"):
        return randn(1.0)
    return randn(1.0 / math.sqrt(math.prod(shape[1:])))      # unit-variance outputs for unit-RMS inputs


def randomize_vision_(tower: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(tower.named_parameters()):
            p.copy_(vision_init(name, tuple(p.shape), gen))


def vision_params(tower: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tower's tensors under our canonical names (`visual.*`)."""
    return {f"visual.{k}": v.detach().clone() for k, v in tower.state_dict().items()}


def make_images(seed: int = 0) -> list[Image.Image]:
    """Two images of different sizes and modes: noise over a gradient, so resizing and position both show."""
    rng = np.random.default_rng(seed)

    def pattern(h, w, c):
        grad = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, c))
        return np.clip(grad * 0.6 + rng.integers(0, 100, (h, w, c)), 0, 255).astype(np.uint8)

    return [Image.fromarray(pattern(70, 120, 3), "RGB"), Image.fromarray(pattern(100, 50, 4), "RGBA")]
