"""convert: `ninfer-gen convert <HF dir | model.gguf> <out>` — an HF checkpoint streamed once through the
spec's recipe (quantised and packed on the GPU when there is one), or a GGUF file's tensors in their own
formats (nothing requantised), into a container folder (`container` reads it):
planes in safetensors shards (the vision tower's too, where the checkpoint has one: in the recipe's `vision`
format, bf16 or fp32, never quantised), spec.yaml, the copied tokenizer / chat template / generation config /
draft vocabulary, and the manifest, written last. Built in a temporary sibling folder and renamed into
place, so a failed conversion leaves nothing that looks like a container.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from compiler.spec import ModelSpec

from .checkpoint import open_checkpoint
from .gguf_file import names_gguf, open_gguf
from .gguf_load import folder_of, iter_tensors
from .gguf_tokenizer import metadata_digest
from .container import FORMAT, FORMAT_VERSION, MANIFEST, SPEC_FILE, file_hash, spec_dict, spec_hash
from .planes import PlanePacker, layout_fingerprint, plane_table, vision_plane_table
from .safetensors_io import CheckpointError, ShardWriter
from .streaming import stream_formatted

SHARD_BYTES = 4 << 30
# Files of an HF folder a run needs beside the weights (tokenizer, chat template, generation settings),
# plus any draft vocabulary (a reduced proposal head's id map) whose name starts with "draft_vocab".
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
          "chat_template.json", "preprocessor_config.json")
DRAFT_VOCAB = "draft_vocab*"


def copied_files(source: Path) -> list[Path]:
    files = [source / n for n in COPIED if (source / n).is_file()]
    return files + sorted(p for p in source.glob(DRAFT_VOCAB) if p.is_file())


def _spec_yaml(spec: ModelSpec) -> str:
    head = (f"# The spec this container was converted for (its planes follow the quantization recipe below).\n"
            f"# Written by ninfer-gen convert; {MANIFEST} holds its hash: edit nothing.\n")
    return head + yaml.safe_dump(spec_dict(spec), sort_keys=False)


def _prepare(source: Path, out: Path, overwrite: bool) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"{out} already exists and is not empty: choose another folder or overwrite it "
                              "(--force)")
    if out.resolve() == source.resolve():
        raise CheckpointError(f"the container must go to another folder than its source {source}")


def _write_container(out: Path, spec: ModelSpec, items, files: list[Path], source: dict,
                     shard_bytes: int) -> tuple[int, dict, dict]:
    """Planes of (canonical name, value in the spec's format) `items`, the copied `files`, spec.yaml and the
    manifest, into a temporary sibling folder renamed to `out`; returns (written bytes, manifest, copied)."""
    tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writer = ShardWriter(tmp, plane_table(spec) + vision_plane_table(spec), shard_bytes, stem="weights",
                             metadata={"format": FORMAT})
        try:
            packer = PlanePacker(spec, writer.write, tower=True)
            for name, value in items:
                packer.add(name, value)
            packer.finish()
        except BaseException:
            writer.close(check=False)
            raise
        writer.close()
        copied = {}
        for f in files:
            shutil.copyfile(f, tmp / f.name)
            copied[f.name] = file_hash(tmp / f.name)
        (tmp / SPEC_FILE).write_text(_spec_yaml(spec))
        tensors = {k: {"file": file, "dtype": dtype, "shape": list(shape), "sha256": writer.hashes[k]}
                   for k, (file, dtype, shape, _, _) in writer.plan.items()}
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "spec_hash": spec_hash(spec),
            "layout": layout_fingerprint(), "mtp": bool(spec.model.mtp.num_layers), "source": source,
            "spec": spec_dict(spec), "shards": writer.files, "files": copied, "tensors": tensors,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(os.path.getsize(out / f) for f in writer.files), manifest, copied


def convert_checkpoint(source, out, spec: ModelSpec | None = None, device=None, shard_bytes: int = SHARD_BYTES,
                       overwrite: bool = False, progress: bool = False) -> dict:
    """Convert HF checkpoint `source` into container `out`; returns a summary (bytes, seconds, shards).
    `spec` (default: derived from config.json) chooses the recipe; `device` the quantiser's (default
    cuda when available). A GGUF file `source` keeps its own formats (`convert_gguf`)."""
    source, out = Path(source), Path(out)
    if names_gguf(source):
        if spec is not None:
            raise CheckpointError(f"{source} is a GGUF file: it carries its own spec and formats (no --spec)")
        return convert_gguf(source, out, shard_bytes, overwrite, progress)
    _prepare(source, out, overwrite)
    t0 = time.perf_counter()
    ckpt = open_checkpoint(source, spec, require_mtp=False)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"path": str(source.resolve()), "bytes": ckpt.nbytes,
            "config_sha256": hashlib.sha256((source / "config.json").read_bytes()).hexdigest()}
    written, manifest, files = _write_container(out, ckpt.spec, stream_formatted(ckpt, device, progress),
                                                copied_files(source), info, shard_bytes)
    return {"source": str(source), "out": str(out), "spec": ckpt.spec.name, "device": str(device),
            "read_bytes": ckpt.nbytes, "written_bytes": written, "shards": len(manifest["shards"]),
            "tensors": len(manifest["tensors"]), "mtp": manifest["mtp"], "files": sorted(files),
            "vision": ckpt.spec.vision is not None, "seconds": time.perf_counter() - t0}


def convert_gguf(source, out, shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
                 progress: bool = False, cache_dir=None) -> dict:
    """A GGUF file as a container, its tensors in their stored formats (k-quant blocks, Q8_0 as w8g32,
    floats): nothing is requantised; its tokenizer and chat template folder is copied beside the planes."""
    source, out = Path(source), Path(out)
    _prepare(source, out, overwrite)
    t0 = time.perf_counter()
    g = open_gguf(source)
    folder = folder_of(g, cache_dir)
    info = {"path": str(source.resolve()), "bytes": g.nbytes, "gguf_header_digest": metadata_digest(g)}
    written, manifest, files = _write_container(out, g.spec, iter_tensors(g, progress),
                                                copied_files(folder) if folder else [], info, shard_bytes)
    return {"source": str(source), "out": str(out), "spec": g.spec.name, "device": "none (formats kept)",
            "read_bytes": g.nbytes, "written_bytes": written, "shards": len(manifest["shards"]),
            "tensors": len(manifest["tensors"]), "mtp": manifest["mtp"], "files": sorted(files),
            "vision": g.spec.vision is not None, "seconds": time.perf_counter() - t0}
