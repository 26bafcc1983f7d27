"""tower: the vision tower's tensors alone, for a runtime that keeps the text model in its own formats
elsewhere (the GPU backend's planes) — read from an HF checkpoint or a converted container without touching
the text model's tensors, or drawn at random for a spec. Float tensors by canonical name (`visual.*`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from compiler.spec import ModelSpec, vision_tensor_table

from .checkpoint import open_checkpoint
from .container import is_container, open_container, read_planes
from .planes import is_tower_key, split_key
from .random_weights import draw_tensor
from .safetensors_io import Reader

TOWER_SEED = 7919           # random towers drawn apart from the text model (a device draw of the 27B has no host copy)


def read_tower(path, verify: bool = True) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(the spec the checkpoint or container loads with its tower, the tower's tensors as stored on the host).
    A source that holds no tower gives a spec without a vision section and no tensors."""
    path = Path(path)
    if is_container(path):
        box = open_container(path, vision="load")
        tower = {k: e for k, e in box.entries.items() if is_tower_key(k)}
        planes = read_planes(type(box)(box.path, box.spec, box.manifest, tower), "cpu", verify)
        return box.spec, {split_key(k)[0]: t for k, t in planes}
    ckpt = open_checkpoint(path, require_mtp=False, vision="load")
    with Reader("cpu") as reader:
        return ckpt.spec, {name: reader.read(e) for name, e in ckpt.in_file_order() if name.startswith("visual.")}


def random_tower(spec: ModelSpec, seed: int = TOWER_SEED) -> dict[str, torch.Tensor]:
    """A spec's tower at random_weights' scales, drawn on the host from its own seed."""
    gen = torch.Generator().manual_seed(seed)
    return {t.name: draw_tensor(t.name, t.shape, gen) for t in vision_tensor_table(spec)}
