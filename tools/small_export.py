"""small_export: writes the small model in HF layout — config.json, generation_config.json,
tokenizer.json, bf16 safetensors shards with their index — and reads the shards back.

Owns HF tensor naming and sharding for this tool only; the runtime's loader is ninfer_gen.weights.checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from compiler.spec import ModelSpec, tensor_table

# The GPU machine returns files of at most 16 MB; keep every shard (header included) under 15 MB.
SHARD_LIMIT_BYTES = 15_000_000
INDEX_FILE = "model.safetensors.index.json"
# The GDN decay parameters stay fp32 (MODEL.md §8: the recipe keeps A_log and dt_bias in fp32).
FP32_SUFFIXES = ("A_log", "dt_bias")
UNPREFIXED = ("lm_head.", "mtp.")


def hf_name(canonical: str) -> str:
    """Canonical name → the name a text-only Qwen3_5ForCausalLM save uses."""
    return canonical if canonical.startswith(UNPREFIXED) else "model." + canonical


def canonical_name(hf: str) -> str:
    return hf[len("model."):] if hf.startswith("model.") else hf


def storage_dtype(canonical: str) -> torch.dtype:
    return torch.float32 if canonical.endswith(FP32_SUFFIXES) else torch.bfloat16


def as_stored(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 copies of the weights exactly as they will be saved (bf16-rounded where stored as bf16)."""
    return {k: v.detach().to("cpu", storage_dtype(k)).float() for k, v in params.items()}


def _shard_groups(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Consecutive groups of tensor names whose payload (plus a header allowance) fits the limit."""
    groups, current, size = [], [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size() + 256   # 256: this tensor's share of the JSON header
        if nbytes > limit:
            raise ValueError(f"tensor {name} ({nbytes} bytes) exceeds the shard limit of {limit} bytes")
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def write_weights(out: Path, spec: ModelSpec, params: dict[str, torch.Tensor],
                  limit: int = SHARD_LIMIT_BYTES) -> list[Path]:
    """Sharded safetensors with HF names plus `model.safetensors.index.json`; returns the shard paths."""
    missing = [t.name for t in tensor_table(spec) if t.name not in params]
    if missing:
        raise KeyError(f"parameters missing for the spec: {missing[:5]}")
    tensors = {hf_name(t.name): params[t.name].detach().to("cpu", storage_dtype(t.name)).contiguous()
               for t in tensor_table(spec)}
    groups = _shard_groups(tensors, limit)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / "model.safetensors"]:
        stale.unlink(missing_ok=True)     # a re-run into the same folder may shard differently
    weight_map, paths = {}, []
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        paths.append(out / fname)
        if paths[-1].stat().st_size > limit:
            raise RuntimeError(f"{fname} is {paths[-1].stat().st_size} bytes, over the {limit}-byte limit")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def generation_config(eot_id: int) -> dict:
    """Chat-free, greedy: a completion ends at `<|endoftext|>`."""
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id,
            "do_sample": False, "max_new_tokens": 256}


def write_checkpoint(out: str | Path, config: dict, spec: ModelSpec, params: dict[str, torch.Tensor],
                     tokenizer: Tokenizer) -> list[Path]:
    """Everything a loader needs, in HF layout; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = generation_config(config["eos_token_id"])
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    shards = write_weights(out, spec, params)
    return [out / "config.json", out / "generation_config.json", out / "tokenizer.json", out / INDEX_FILE, *shards]


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Canonical name → fp32 tensor, from the index and its shards."""
    folder = Path(folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        out.update({canonical_name(k): v.float() for k, v in load_file(folder / fname).items()})
    return out
