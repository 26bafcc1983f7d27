"""checkpoint_cases: tiny HF checkpoints in every supported layout (text, VLM, sharded with an index,
tied), built once per test session and shared by the streaming and container tests, and the bitwise
comparison of two device weight sets. Test helpers only: no assertions about loaders live here but
the comparison's."""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_fixtures import SHAPE_A, SHAPE_B, make_hf_checkpoint

LAYOUTS = ("text", "vlm", "sharded", "tied")


def reshard(path: Path, parts: int) -> None:
    """Split a fixture's model.safetensors into `parts` shards plus an index (released checkpoints' layout)."""
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names, weight_map = sorted(tensors), {}
    for i in range(parts):
        shard = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        save_file({n: tensors[n] for n in names[i::parts]}, path / shard)
        weight_map.update(dict.fromkeys(names[i::parts], shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@cache
def hf_layouts() -> dict[str, Path]:
    """One tiny random HF checkpoint per layout (read-only for tests: copy before editing)."""
    root = Path(tempfile.mkdtemp(prefix="ninfer-layouts-"))
    atexit.register(shutil.rmtree, root, True)
    out = {"text": make_hf_checkpoint(root / "text", SHAPE_A, 11).path,
           "vlm": make_hf_checkpoint(root / "vlm", SHAPE_A, 12, layout="vlm").path,
           "sharded": make_hf_checkpoint(root / "sharded", SHAPE_A, 13).path,
           "tied": make_hf_checkpoint(root / "tied", SHAPE_B, 14).path}
    reshard(out["sharded"], 3)
    return out


def assert_same_device_weights(a, b) -> None:
    """Every plane, small tensor and format of two DeviceWeights equal, dtype and bits."""
    assert set(a.matrices) == set(b.matrices) and a.formats == b.formats
    for name, planes in a.matrices.items():
        assert set(planes) == set(b.matrices[name]), name
        for plane, t in planes.items():
            u = b.matrices[name][plane]
            assert t.dtype == u.dtype and torch.equal(t, u), (name, plane)
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        assert t.dtype == b.tensors[name].dtype and torch.equal(t, b.tensors[name]), name
    assert a.embed_codes.dtype == b.embed_codes.dtype and torch.equal(a.embed_codes, b.embed_codes)
    assert (a.embed_scales is None) == (b.embed_scales is None)
    assert a.embed_scales is None or torch.equal(a.embed_scales, b.embed_scales)


def on_cpu(weights):
    """A DeviceWeights' tensors copied to the host (to compare a GPU load with a CPU one)."""
    weights.matrices = {n: {p: t.cpu() for p, t in planes.items()} for n, planes in weights.matrices.items()}
    weights.tensors = {n: t.cpu() for n, t in weights.tensors.items()}
    weights.embed_codes = weights.embed_codes.cpu()
    weights.embed_scales = None if weights.embed_scales is None else weights.embed_scales.cpu()
    return weights
