"""sources: where a loaded model's weights come from — the shipped small model, a spec's seeded random weights, an
HF checkpoint, a converted container or a llama.cpp GGUF — as host tensors for the reference backend
(`host_weights`), or as the GPU's planes with the vision tower's host tensors beside them (`device_weights`).
Part of the composition root (ninfer_gen.api calls it); decides nothing about backends.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from compiler.schema import SpecError
from compiler.spec import ModelSpec, load_spec

from ninfer_gen.weights.random_weights import random_weights

REPO = Path(__file__).resolve().parents[1]          # ninfer_gen/sources.py → the repository
DEFAULT_MODEL = REPO / "models" / "qwen3.8-small-py"
TINY_SPEC = REPO / "model_specs" / "qwen3.8-tiny.yaml"


def host_weights(path_or_spec, verify: bool = True, require_mtp: bool = False,
             vision: bool = True) -> tuple[ModelSpec, dict, Path | None, str]:
    """(spec, float32 host tensors, folder, source); `vision` False: a text model, without the spec's vision
    section and the tower's `visual.*` tensors (which a checkpoint or container then never reads)."""
    def own(spec: ModelSpec) -> ModelSpec:          # random weights draw the tower after the text model's
        return spec if vision else dataclasses.replace(spec, vision=None)

    tower = "load" if vision else "drop"
    if path_or_spec is None:
        if (DEFAULT_MODEL / "config.json").is_file():
            path_or_spec = DEFAULT_MODEL
        else:
            spec = own(load_spec(TINY_SPEC))
            return spec, random_weights(spec), None, f"{spec.name} (random weights, seed 0)"
    if isinstance(path_or_spec, ModelSpec):
        spec = own(path_or_spec)
        return spec, random_weights(spec), None, f"{spec.name} (random weights)"
    path = Path(path_or_spec)
    from ninfer_gen.weights.gguf_load import load_gguf, names_gguf
    if names_gguf(path):              # a llama.cpp GGUF: its own formats, dequantised for the reference
        from ninfer_gen.weights.checkpoint import dequantized
        g = load_gguf(path, require_mtp=require_mtp)
        return g.spec, dequantized(g.weights), g.folder, g.source
    if path.is_dir():
        from ninfer_gen.weights.checkpoint import load_checkpoint
        from ninfer_gen.weights.container import is_container, load_host

        if is_container(path):
            spec, tensors = load_host(path, verify=verify, require_mtp=require_mtp, vision=tower)
            return spec, tensors, path, f"{path} (converted)"
        spec, tensors = load_checkpoint(path, require_mtp=require_mtp, vision=tower)
        return spec, tensors, path, str(path)
    if path.suffix in (".yaml", ".yml"):
        spec = own(load_spec(path))
        return spec, random_weights(spec), None, f"{spec.name} (random weights, seed 0)"
    if not path.exists():
        raise SpecError("", f"{path}: no such file or directory (--weights takes an HF checkpoint directory, a "
                            "converted container, a .gguf file or a model spec .yaml file)")
    raise SpecError("", f"{path}: expected an HF checkpoint directory, a converted container, a .gguf file or a model spec "
                        ".yaml file")


def device_weights(path_or_spec, progress: bool, verify: bool, require_mtp: bool, vision: bool = True):
    """(spec, GPU weights, the vision tower's host tensors or None, folder, source). The text model: a
    container's planes copied as stored, an HF checkpoint streamed and quantised on the GPU one tensor at a time,
    or host tensors (random weights of a spec) quantised, then copied. The tower (a spec with a vision section,
    `vision` True) is read apart from them, as stored (weights.tower: the GPU runs it in torch, bf16)."""
    from ninfer_gen.executor.device_weights import from_checkpoint, from_container, from_host
    from ninfer_gen.weights.checkpoint import quantize_weights
    from ninfer_gen.weights.container import is_container

    path = DEFAULT_MODEL if path_or_spec is None and (DEFAULT_MODEL / "config.json").is_file() else path_or_spec
    from ninfer_gen.weights.gguf_load import folder_of, iter_tensors, names_gguf, open_gguf
    if isinstance(path, (str, Path)) and names_gguf(path):   # one tensor at a time, formats as stored
        from ninfer_gen.executor.device_weights import from_stream
        g = open_gguf(path, require_mtp=require_mtp)
        return g.spec, from_stream(g.spec, iter_tensors(g, progress)), None, folder_of(g), f"{path} (GGUF)"
    if isinstance(path, (str, Path)) and Path(path).is_dir():
        from ninfer_gen.weights.tower import read_tower
        path = Path(path)
        mode = "skip" if vision else "drop"
        if is_container(path):
            weights = from_container(path, verify=verify, require_mtp=require_mtp, progress=progress, vision=mode)
            source = f"{path} (converted)"
        else:
            weights = from_checkpoint(path, require_mtp=require_mtp, progress=progress, vision=mode)
            source = str(path)
        spec, tower = weights.spec, None
        if spec.vision is not None:
            tower_spec, tower = read_tower(path, verify)
            spec = spec if tower_spec.vision is not None else tower_spec
        return spec, weights, tower or None, path, source
    spec, tensors, folder, source = host_weights(path_or_spec, vision=vision)
    text = {k: v for k, v in tensors.items() if not k.startswith("visual.")}      # the planes are the text model's
    tower = {k: v for k, v in tensors.items() if k.startswith("visual.")} or None
    return spec, from_host(spec, quantize_weights(spec, text), progress=progress), tower, folder, source
