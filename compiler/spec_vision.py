"""spec_vision: the spec's optional `vision` section — the Qwen3.5-family vision tower (patch embedding, learned
position grid, pre-norm blocks, 2×2 patch merger), its image token ids and the text model's interleaved M-RoPE
split — and its derivation from an HF config.json's `vision_config`. Data and validation only; `compiler.spec`
holds the section in ModelSpec and checks it against the text model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .schema import require

# HF Qwen3_5VisionConfig's defaults, used for keys a config.json leaves out (as transformers does).
HF_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
               "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
               "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}
HF_TOKEN_DEFAULTS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                     "vision_end_token_id": 248054}


@dataclass(frozen=True)
class VisionSpec:
    """The vision encoder: `depth` blocks of width `hidden_size` with `num_heads` heads over patches of
    `patch_size`² pixels × `temporal_patch_size` frames; a learned `num_position_embeddings` = side² position
    grid resampled bilinearly per image; every `spatial_merge_size`² neighbouring patches merged into one token
    of `out_hidden_size` (the text model's width). `mrope_section`: how many of the text RoPE's frequencies
    follow the temporal, height and width position (interleaved: frequency j takes axis j mod 3 while that
    axis has frequencies left, else the temporal one)."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    in_channels: int = 3
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    mrope_section: tuple[int, ...] = (11, 11, 10)

    def __post_init__(self):
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                     "spatial_merge_size", "num_position_embeddings", "out_hidden_size", "in_channels"):
            require(getattr(self, name) > 0, name, f"expected a positive integer, got {getattr(self, name)}")
        require(self.hidden_size % self.num_heads == 0, "num_heads",
                f"expected a divisor of hidden_size ({self.hidden_size}), got {self.num_heads}")
        require(self.head_dim % 4 == 0, "num_heads", f"the head width {self.head_dim} must be a multiple of 4 "
                "(2-D rotary: a quarter of the frequencies per axis, rotated in halves)")
        require(self.grid_side ** 2 == self.num_position_embeddings, "num_position_embeddings",
                f"expected a square number (a side × side grid), got {self.num_position_embeddings}")
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]
        require(min(ids) >= 0 and len(set(ids)) == 4, "image_token_id",
                f"the image, video, vision start and end token ids must be distinct and ≥ 0, got {ids}")
        require(len(self.mrope_section) == 3 and min(self.mrope_section) >= 0, "mrope_section",
                f"expected three counts ≥ 0 (temporal, height, width), got {list(self.mrope_section)}")
        require(self.rope_theta > 1, "rope_theta", "expected a number > 1")
        require(0 < self.layer_norm_eps < 1, "layer_norm_eps", "expected a small positive number")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        """Values per patch row: channels × frames × pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per output token."""
        return self.spatial_merge_size ** 2


def mrope_axis(j: int, section: tuple[int, ...]) -> int:
    """The position axis (0 temporal, 1 height, 2 width) that RoPE frequency j follows: interleaved, j mod 3
    while that axis has frequencies left in `section`, else the temporal axis (HF's Qwen3.5 rule)."""
    if j % 3 == 1 and j < 3 * section[1]:
        return 1
    if j % 3 == 2 and j < 3 * section[2]:
        return 2
    return 0


def effective_mrope_section(section, frequencies: int) -> list[int]:
    """The section that HF's rule actually applies over `frequencies` RoPE frequencies (a config's section may
    cover more than the model has; HF then uses the first ones)."""
    axes = [mrope_axis(j, tuple(section)) for j in range(frequencies)]
    return [axes.count(a) for a in range(3)]


def vision_from_hf_config(config: dict, rope_frequencies: int) -> dict | None:
    """The `vision` section as plain data from an HF Qwen3.5 config (None without a `vision_config`); keys the
    file leaves out take transformers' defaults, as loading it in transformers would, and the M-RoPE section is
    the one HF applies over the text model's `rope_frequencies` (rotary dims / 2)."""
    vc = config.get("vision_config")
    if not vc:
        return None
    data = {k: vc.get(k, d) for k, d in HF_DEFAULTS.items()}
    data |= {k: config.get(k, d) for k, d in HF_TOKEN_DEFAULTS.items()}
    rope = dict(vc.get("rope_parameters") or {})
    data["rope_theta"] = float(rope.get("rope_theta", vc.get("rope_theta", 10000.0)))
    text = config.get("text_config") or config
    text_rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    data["mrope_section"] = effective_mrope_section(text_rope.get("mrope_section", (11, 11, 10)), rope_frequencies)
    return data
