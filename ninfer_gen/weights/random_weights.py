"""random_weights: seeded random weights for any spec at O(1) scale (MODEL.md: logits not flat,
GDN decay moderate), so a spec with no checkpoint still gives a meaningful, non-trivial model.
`draw_tensor` draws one of them on its generator's device (tools/synth_checkpoint.py draws full-size
checkpoints on a GPU; the GPU backend draws the small tensors of a streamed random model)."""
from __future__ import annotations

import math

import torch

from compiler.spec import ModelSpec, tensor_table, vision_tensor_table


def draw_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Tensor `name` of `shape` as `random_weights` draws it (before the head's ×2), on `gen`'s device."""
    def normal(std):
        return torch.randn(shape, generator=gen, device=gen.device) * std

    if name.startswith("visual."):
        return _draw_vision(name, shape, normal)
    if name.endswith("A_log"):  # A in [0.5, 4]: the state survives several tokens
        return torch.log(torch.rand(shape, generator=gen, device=gen.device) * 3.5 + 0.5)
    if name.endswith("dt_bias"):
        return -2.0 + normal(0.3)
    if name.endswith("linear_attn.norm.weight"):  # gated norm: the weight multiplies directly
        return 1.0 + normal(0.1)
    if name.endswith("conv1d.weight"):
        return normal(0.5)
    if len(shape) == 1:  # zero-centred RMSNorm weights
        return normal(0.1)
    if name == "embed_tokens.weight":
        return normal(1.0)
    return normal(1.0 / math.sqrt(shape[-1]))


def _draw_vision(name: str, shape: tuple[int, ...], normal) -> torch.Tensor:
    """The vision tower at O(1) scale: near-unit LayerNorms, small biases, a unit-variance position grid and
    unit-gain matrices (an HF-style init of 0.02 matrices makes the tower's output nearly constant)."""
    if "norm" in name:
        return 1.0 + normal(0.1) if name.endswith("weight") else normal(0.1)
    if name.endswith("bias"):
        return normal(0.1)
    if name.endswith("pos_embed.weight"):
        return normal(1.0)
    return normal(1.0 / math.sqrt(math.prod(shape[1:])))


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The text model's tensors, then (a spec with a vision section) the vision tower's, drawn after them so
    the text weights of a seed are the same with or without a tower."""
    gen = torch.Generator().manual_seed(seed)
    out = {t.name: draw_tensor(t.name, t.shape, gen) for t in tensor_table(spec)}
    head = "embed_tokens.weight" if spec.model.tie_word_embeddings else "lm_head.weight"
    out[head] = out[head] * 2.0  # logit std ≈ 2 on normed hidden states
    out |= {t.name: draw_tensor(t.name, t.shape, gen) for t in vision_tensor_table(spec)}
    return out
