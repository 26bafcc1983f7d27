"""vision_plan: the vision tower on the GPU through the compiler — the encoder's bucket plans (compiler.buckets_vision:
one per image-token count) bound to device memory and launched, one image per call like executor.vision_encoder's
torch tower, whose contract it keeps (`__call__(pixels, grids)` → image tokens). Opt-in (`GpuBackend(...,
vision_kernels=True)`); the torch tower stays the default until this path is measured on a GPU.

Bindings resolve by kind as executor.executable does (arena bytes, step inputs, weight planes and tensors,
constant tables, null); this module knows no kernel family. The tower's matrices are packed once for the GEMM
(compiler.emulate.weight_planes); the arena is sized for the largest bucket and shared by all.
"""
from __future__ import annotations

import math

import torch

from compiler.buckets_vision import bucket_for, plan_vision, vision_buckets
from compiler.emulate import weight_planes
from compiler.plan import Arena, Const, Input, Null, Plan, Weight
from compiler.spec import ModelSpec
from compiler.targets import Target
from compiler.vision_model import encoder_inputs

from ninfer_gen.executor.device_state import TORCH_DTYPES, ExecutableError
from ninfer_gen.executor.vision_encoder import tower_tensors


def encoder_bytes(spec: ModelSpec, target: Target, max_patches: int) -> int:
    """The device memory a CompiledVisionEncoder of `max_patches` holds (executor.memory_plan counts it for a load
    with `vision_kernels`): the tower's weights as the plans bind them — matrices packed bf16 with rows padded to
    16 and K to whole units (weight_layout), other tensors bf16 as they are — and the arena of the largest plan."""
    from compiler.kernels.weight_layout import padded_k, padded_rows
    from compiler.spec import vision_tensor_table

    plans = [plan_vision(spec, target, t) for t in vision_buckets(spec, max_patches)]
    shapes = {t.name: t.shape for t in vision_tensor_table(spec)}
    bound = {(b.name, b.plane == "tensor") for c in plans[-1].calls for _, b in c.args if isinstance(b, Weight)}
    weights = 0
    for name, whole in bound:
        n, k = shapes[name][0], math.prod(shapes[name][1:])
        weights += 2 * (n * k if whole or len(shapes[name]) == 1 else padded_rows(n) * padded_k("bf16", k))
    return weights + max(p.arena_bytes for p in plans)


class CompiledVisionEncoder:
    def __init__(self, spec: ModelSpec, tensors: dict, device, target: Target, kernels, max_patches: int):
        """`tensors`: the tower's tensors by canonical name (`visual.*`); `kernels`: an executor KernelCache;
        `max_patches`: the largest image (in patches) it encodes (its largest bucket)."""
        self.spec, self.device, self.target, self.kernels = spec, torch.device(device), target, kernels
        tensors = tower_tensors(spec, tensors, self.device)
        self.buckets = vision_buckets(spec, max_patches)
        self.plans: dict[int, Plan] = {t: plan_vision(spec, target, t) for t in self.buckets}
        self.kernels.build([k for p in self.plans.values() for k in p.keys()])
        spilled = set(self.kernels.spilled()) & {k.name for p in self.plans.values() for k in p.keys()}
        if spilled:
            raise ExecutableError(f"vision kernels spill registers: {', '.join(sorted(spilled))}")
        self.planes = weight_planes(self.plans[self.buckets[-1]], tensors)     # the matrices packed: the planes
        del tensors                                # are the tower now (memory_plan.vision_bytes: weights + arena)
        self.arena = torch.empty(max(p.arena_bytes for p in self.plans.values()), dtype=torch.uint8,
                                 device=self.device)
        self.constants: dict[Const, torch.Tensor] = {}
        self.inputs = {t: self._inputs(p) for t, p in self.plans.items()}
        self.launchers = {t: [self.kernels.bind(c.key, [self._resolve(b, self.inputs[t]) for _, b in c.args],
                                                programmatic=c.programmatic) for c in p.calls]
                          for t, p in self.plans.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values()) + self.arena.numel()

    def _inputs(self, plan: Plan) -> dict[str, torch.Tensor]:
        _, images, patches = plan.shape
        out = {name: torch.zeros(shape, dtype=TORCH_DTYPES[dt], device=self.device)
               for name, (shape, dt) in plan.step_tensors().items()}
        return out | {"coords": torch.zeros(patches, 4, dtype=torch.int32, device=self.device),
                      "cu_seqlens": torch.zeros(images + 1, dtype=torch.int32, device=self.device)}

    def _resolve(self, b, inputs: dict) -> int:
        if isinstance(b, Arena):
            return self.arena.data_ptr() + b.offset
        if isinstance(b, Input):
            return inputs[b.name].data_ptr()
        if isinstance(b, Weight):
            return self.planes[b.name, b.plane].data_ptr()
        if isinstance(b, Const):
            if b not in self.constants:
                self.constants[b] = b.tensor().to(self.device).contiguous()
            return self.constants[b].data_ptr()
        if isinstance(b, Null):
            return 0
        raise ExecutableError(f"the vision plans bind no {type(b).__name__} ({b})")

    def run(self, tokens: int, pixels: torch.Tensor, grids) -> torch.Tensor:
        """One call of bucket `tokens` over images `grids` whose patches are `pixels`: their image tokens."""
        plan, inputs = self.plans[tokens], self.inputs[tokens]
        _, images, patches = plan.shape
        coords, cu = encoder_inputs(grids, self.spec.vision.spatial_merge_size, patches, images)
        inputs["pixels"].zero_()
        inputs["pixels"][:pixels.shape[0]].copy_(pixels)
        inputs["coords"].copy_(coords)
        inputs["cu_seqlens"].copy_(cu)
        for launcher in self.launchers[tokens]:
            launcher.launch()
        out = plan.outputs["embeds"]
        n = sum(t * h * w for t, h, w in grids) // self.spec.vision.merge_unit
        flat = self.arena[out.offset:out.offset + out.shape[0] * out.shape[1] * 2].view(torch.bfloat16)
        return flat.view(out.shape)[:n].clone()

    @torch.inference_mode()
    def __call__(self, pixels, grids) -> torch.Tensor:
        """A request's images (preprocessed pixels [Σ patches, C·T·P·P], one grid per image) → image tokens
        [Σ tokens, hidden] bf16, each image in the smallest bucket that holds it."""
        x = torch.as_tensor(pixels)
        out, at = [], 0
        for t, h, w in grids:
            rows = x[at:at + t * h * w].to(self.device, torch.bfloat16)
            out.append(self.run(bucket_for(t * h * w // self.spec.vision.merge_unit, self.buckets), rows, [(t, h, w)]))
            at += t * h * w
        return torch.cat(out)
