"""gguf_load: `load_gguf(path)` — a llama.cpp GGUF file of the Qwen3.5 hybrid as what `load()` needs: the
spec (recipe = the file's formats), every tensor in canonical names and its stored format (KQTensor for
k-quants, QTensor w8g32 for Q8_0, float tensors), and the folder of its tokenizer and chat template.

Reads one tensor at a time from the memory-mapped file (host memory grows by the tensors kept, never by
the file); the reference backend dequantises them (`checkpoint.dequantized`). Never touches a device.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from compiler.spec import ModelSpec

from .gguf_file import GGUFError, GGUFFile, is_gguf, names_gguf, open_gguf
from .gguf_tokenizer import tokenizer_folder

__all__ = ["GGUFError", "GGUFModel", "folder_of", "is_gguf", "iter_tensors", "load_gguf", "names_gguf", "open_gguf"]


@dataclass
class GGUFModel:
    spec: ModelSpec
    weights: dict            # canonical name → KQTensor | QTensor | torch.Tensor, in tensor-table order
    folder: Path | None      # tokenizer.json, tokenizer_config.json (chat template), generation_config.json
    source: str


def iter_tensors(g: GGUFFile, progress: bool = False):
    """(canonical name, value in its stored format), one tensor at a time, in file order."""
    order = sorted(g.entries, key=lambda n: g.entries[n].data_offset)
    with tqdm(total=g.nbytes, desc=f"loading {g.path.name}", unit="B", unit_scale=True, unit_divisor=1024,
              disable=None if progress else True, leave=False) as bar:
        for name in order:
            yield name, g.read(name)
            bar.update(int(g.entries[name].n_bytes))


def folder_of(g: GGUFFile, cache_dir: str | Path | None = None) -> Path | None:
    """The folder of the file's tokenizer and chat template (`gguf_tokenizer`), None without a vocabulary."""
    return tokenizer_folder(g, cache_dir) if "tokenizer.ggml.tokens" in g.meta.reader.fields else None


def load_gguf(path: str | Path, require_mtp: bool = False, cache_dir: str | Path | None = None,
              progress: bool = False) -> GGUFModel:
    """Open, validate and read a GGUF file (see `gguf_file.open_gguf` for `require_mtp`). The tokenizer
    folder goes under `cache_dir` (default ~/.cache/ninfer-gen/gguf); None when the file has no vocabulary."""
    g = open_gguf(path, require_mtp=require_mtp)
    weights = dict(iter_tensors(g, progress))
    return GGUFModel(g.spec, {name: weights[name] for name in g.entries}, folder_of(g, cache_dir), f"{g.path} (GGUF)")
