"""vision_encoder: the vision tower on the GPU — the model's encoder (compiler.vision_model, written once against
compiler.ops) run eagerly with torch on the device in bf16, one image per call, over the tower's bf16 tensors.

No compiled kernels yet: the tower runs as torch operations (cuBLAS matmuls, torch's fused attention per image),
the reference's own code at the device's speed; its memory is the tower's weights plus one image's activations,
which the memory plan counts (executor.memory_plan.vision_bytes). Its output rows are the image tokens a prompt
piece's `images` input takes (executor.device_state.StepInputs.set_images).
"""
from __future__ import annotations

import torch

from compiler.spec import ModelSpec, vision_tensor_table

DEFAULT_PATCHES = 4096      # the largest image the memory plan holds by default: one megapixel on 16-pixel patches


def tower_tensors(spec: ModelSpec, tensors: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The tower's tensors of `spec` from `tensors` (canonical `visual.*` names), bf16 on `device`; a clear
    error when the spec has no tower or the checkpoint lacks some of it."""
    if spec.vision is None:
        raise ValueError(f"model {spec.name} has no vision section")
    names = [t.name for t in vision_tensor_table(spec)]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"the vision tower lacks {len(missing)} tensors ({', '.join(missing[:3])}, ...)")
    return {n: tensors[n].to(device, torch.bfloat16) for n in names}


class VisionEncoder:
    def __init__(self, spec: ModelSpec, tensors: dict, device):
        """`tensors`: the tower's tensors by canonical name (`visual.*`), any float dtype, host or device."""
        self.spec, self.device = spec, torch.device(device)
        self.weights = tower_tensors(spec, tensors, self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @torch.inference_mode()
    def __call__(self, pixels, grids) -> torch.Tensor:
        """A request's images (preprocessed pixels [Σ patches, C·T·P·P], one grid per image) → image tokens
        [Σ tokens, hidden] bf16, each image encoded alone (its activations are one image's)."""
        from compiler.vision_model import encode

        x = torch.as_tensor(pixels)
        out, at = [], 0
        for t, h, w in grids:
            rows = x[at:at + t * h * w].to(self.device, torch.bfloat16)
            out.append(encode(self.spec, self.weights, rows, [(t, h, w)]))
            at += t * h * w
        return torch.cat(out)
