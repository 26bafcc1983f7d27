"""emulate: runs a Plan on the CPU — each call's family reference (`emulate(key, buf)` of its module) over the
buffers its bindings name: a byte arena laid out as the plan says (poisoned with NaN bytes first, so a read of
bytes no call wrote shows), step inputs, weight tensors and packed weight planes, constant tables. It checks
what a GPU run would and an interpreter run of the graph cannot: the bindings, the arena's reuse and in-place
writes, the weights' device packing. Families without an `emulate` are refused by name. No CUDA.
"""
from __future__ import annotations

import math

from ._torch import torch
from .kernels import module_of
from .kernels.weight_layout import pack_for_device
from .plan import Arena, Const, Input, Null, Plan, Weight

TORCH = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i32": "int32", "i8": "int8"}
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1}


def weight_planes(plan: Plan, tensors: dict) -> dict:
    """(name, plane) → tensor for every weight binding of the plan: small weights as they are, matrices packed
    for the device (weight_layout.pack_for_device; bf16 with K padded to whole units, as the GEMM reads them)."""
    out = {}
    for c in plan.calls:
        for _, b in c.args:
            if not isinstance(b, Weight) or (b.name, b.plane) in out:
                continue
            t = tensors[b.name]
            if b.plane == "tensor":
                out[b.name, "tensor"] = t
                continue
            packed = pack_for_device(t.reshape(t.shape[0], -1).to(torch.bfloat16), pad_k=True)
            out |= {(b.name, p): v for p, v in packed.items()}
    return out


def run_plan(plan: Plan, inputs: dict, tensors: dict) -> dict:
    """Run `plan`'s calls in order; returns its outputs (copies, in the dtypes the kernels wrote) by name.
    `inputs`: step inputs and step tensors by name; `tensors`: the weights by name (float tensors)."""
    arena = torch.full((plan.arena_bytes,), 0xFF, dtype=torch.uint8)     # bf16/f32 NaN wherever unwritten
    planes = weight_planes(plan, tensors)
    constants: dict = {}

    def view(binding, shape, dtype):
        if isinstance(binding, Null):
            return None
        if isinstance(binding, Arena):
            n = math.prod(shape) * _BYTES[dtype]
            if binding.offset + n > arena.numel():
                raise ValueError(f"{binding}: {n} bytes from offset {binding.offset} overrun the arena")
            return arena[binding.offset:binding.offset + n].view(getattr(torch, TORCH[dtype])).view(shape)
        if isinstance(binding, Input):
            t = inputs[binding.name]
            return t if shape is None else t.reshape(shape)
        if isinstance(binding, Weight):
            t = planes[binding.name, binding.plane]
            return t if shape is None or binding.plane != "tensor" else t.reshape(shape)
        if isinstance(binding, Const):
            if binding not in constants:
                constants[binding] = binding.tensor()
            return constants[binding]
        raise ValueError(f"emulate: no CPU buffer for binding {binding}")

    for c in plan.calls:
        fn = getattr(module_of(c.key), "emulate", None)
        if fn is None:
            raise NotImplementedError(f"emulate: family {c.key.family} has no CPU emulation ({c.key.name})")
        args = dict(c.args)
        fn(c.key, lambda name, shape=None, dtype=None: view(args[name], shape, dtype))
    return {name: view(Arena(o.offset), o.shape, o.dtype).clone() for name, o in plan.outputs.items()}
