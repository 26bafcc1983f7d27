"""checkpoint: opens an HF safetensors checkpoint of the Qwen3.5 family — canonical tensor names,
validated against the spec's tensor table (names, shapes, dtypes) from the headers alone — loads it into
host tensors, and applies the spec's quantisation recipe on the host. A spec with a vision section carries the
vision tower too (`model.visual.*` → `visual.*`, checked against `vision_tensor_table`), or skips or drops it
(`vision`: what the caller runs).

Owns name mapping (prefixes, the tower's prefix, ignored tensors) and checkpoint errors; never touches a device
(`streaming` reads one tensor at a time onto one).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from compiler.kquant import KFORMATS, KQTensor
from compiler.kquant import dequantize as dequantize_kquant
from compiler.quant import QTensor, convert, dequantize
from compiler.schema import SpecError
from compiler.spec import FLOAT_FORMATS, MTPSpec, ModelSpec, TensorInfo, format_of, tensor_table, vision_tensor_table
from compiler.spec_hf import spec_from_hf_config

from .safetensors_io import CheckpointError, Entry, Reader, read_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Names HF keeps outside the model prefix in every layout.
UNPREFIXED = ("lm_head.", "mtp.")
VISION_PREFIX = "model.visual."     # where HF checkpoints keep the vision tower
TOWER = "visual."                   # the tower's canonical names
# What a load does with the tower of a spec with a vision section: "load" carries it (checked like the text
# tensors; a checkpoint that stores none loads text-only, said once on stderr); "skip" keeps the spec's vision
# section but neither reads nor checks the tower (the GPU's planes: weights.tower reads it apart); "drop" drops
# section and tower.
VISION_MODES = ("load", "skip", "drop")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")    # stored dtypes a weight may have
_MAX_LISTED = 10
__all__ = ["CheckpointError", "Checkpoint", "open_checkpoint", "load_checkpoint", "quantize_weights",
           "dequantized", "read_hf_config", "canonical_name", "without_vision", "weight_table"]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return f"{shown}, … and {more} more" if more > 0 else shown


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    return path


def read_hf_config(path: str | Path) -> dict:
    """The HF `config.json` of checkpoint directory `path`, as a dict."""
    return _read_json(_checkpoint_dir(path) / "config.json", "config.json")


def _shard_files(path: Path) -> list[Path]:
    """model.safetensors, else the shards of the index, else every *.safetensors in the folder."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty `weight_map` object")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard files that do not exist: {_listing(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path} (expected {SINGLE_FILE}, {INDEX_FILE} "
                              f"or *.safetensors)")
    return files


def canonical_name(key: str, spec: ModelSpec) -> str | None:
    """The canonical name of checkpoint key `key`, or None when the spec says to ignore it. The vision tower's
    `model.visual.*` is `visual.*` for a spec with a vision section and ignored for a text-only one, whatever
    `ignore_prefixes` lists (the vision section decides)."""
    ck = spec.checkpoint
    if key.startswith(VISION_PREFIX):
        return TOWER + key[len(VISION_PREFIX):] if spec.vision is not None else None
    if key.startswith(ck.ignore_prefixes):
        return None
    if key.startswith(UNPREFIXED):
        return key
    for prefix in ck.prefixes:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _scan(files: list[Path], spec: ModelSpec) -> dict[str, Entry]:
    """Canonical name → stored entry, reading only the safetensors headers."""
    found: dict[str, Entry] = {}
    for file in files:
        for key, entry in read_header(file).items():
            name = canonical_name(key, spec)
            if name is None:
                continue
            if name in found:
                raise CheckpointError(f"tensor {name!r} is stored twice: as {found[name].key!r} in "
                                      f"{found[name].path.name} and as {key!r} in {file.name}")
            found[name] = entry
    return found


def _without_mtp(spec: ModelSpec) -> ModelSpec:
    model = dataclasses.replace(spec.model, mtp=MTPSpec(num_layers=0))
    return dataclasses.replace(spec, model=model)


def without_vision(spec: ModelSpec) -> ModelSpec:
    """The spec as a text-only model (no vision section): what a load without the tower runs."""
    return spec if spec.vision is None else dataclasses.replace(spec, vision=None)


def weight_table(spec: ModelSpec, tower: bool = True) -> list[TensorInfo]:
    """The tensors a load of `spec` holds: the text model's, then (`tower`) the vision tower's."""
    return tensor_table(spec) + (vision_tensor_table(spec) if tower else [])


def _settle_vision(spec: ModelSpec, found: dict, path: Path, vision: str) -> ModelSpec:
    """Apply `vision` (VISION_MODES) to the tower's entries in `found`; returns the spec the load runs."""
    if vision not in VISION_MODES:
        raise ValueError(f"vision must be one of {', '.join(VISION_MODES)}, got {vision!r}")
    tower = [n for n in found if n.startswith(TOWER)]
    if spec.vision is not None and vision != "drop" and not tower:
        print(f"[{path}: the config has a vision_config but the checkpoint stores no model.visual.* tensors: "
              "loading the text model only (images are refused)]", file=sys.stderr)
    if not tower or vision == "drop":
        spec = without_vision(spec)
    if spec.vision is None or vision == "skip":
        for name in tower:
            del found[name]
    return spec


def _reconcile(spec: ModelSpec, found: dict, path: Path, require_mtp: bool, vision: str = "load") -> ModelSpec:
    """Drop tensors the spec does not use by design, settle the MTP and vision questions; returns the final spec."""
    spec = _settle_vision(spec, found, path, vision)
    has_mtp = any(n.startswith("mtp.") for n in found)
    if not spec.model.mtp.num_layers:
        # A spec without MTP never runs the draft head, so stored MTP weights are simply not loaded.
        for name in [n for n in found if n.startswith("mtp.")]:
            del found[name]
    elif not has_mtp:
        if require_mtp:
            mtp = [t.name for t in tensor_table(spec) if t.name.startswith("mtp.")]
            raise CheckpointError(f"{path}: the spec has an MTP layer but the checkpoint has no mtp.* tensors "
                                  f"(expected {_listing(mtp)}); drafting needs them: decode without drafts "
                                  "(--draft 0), or load with require_mtp=False to run without the MTP layer")
        spec = _without_mtp(spec)
    if spec.model.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # a tied head is the embedding; a stored copy is redundant
    return spec


def _validate(spec: ModelSpec, found: dict, path: Path, tower: bool) -> None:
    table = weight_table(spec, tower)
    expected = {t.name: t.shape for t in table}
    missing = [t.name for t in table if t.name not in found]
    unexpected = sorted(n for n in found if n not in expected)
    wrong = [f"{n} (expected {list(expected[n])}, got {list(found[n].shape)})"
             for n in expected if n in found and found[n].shape != expected[n]]
    dtypes = [f"{found[n].where} has dtype {found[n].dtype}" for n in expected
              if n in found and found[n].dtype not in FLOAT_DTYPES]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {_listing(wrong)}")
    if dtypes:
        problems.append(f"{len(dtypes)} tensor(s) not stored as {', '.join(FLOAT_DTYPES)} (FP8 or integer "
                        f"checkpoints are not supported: use the BF16 release): {_listing(dtypes)}")
    if problems:
        named = missing + unexpected + [n for n in expected if n in found and found[n].shape != expected[n]]
        hint = "" if not any(n.startswith(TOWER) for n in named) else \
            " (the vision tower: load without it — --no-vision, vision=False — to run the text model only)"
        raise CheckpointError(f"checkpoint {path} does not match spec {spec.name!r}: " + "; ".join(problems) + hint)


def _spec_for(path: Path) -> ModelSpec:
    config = read_hf_config(path)
    try:
        return spec_from_hf_config(config, name=path.resolve().name)
    except SpecError as err:
        raise CheckpointError(f"{path / 'config.json'}: {err}") from None


@dataclass(frozen=True)
class Checkpoint:
    """An opened, validated checkpoint: the final spec and, per tensor of its table (and of the vision tower's
    when it was loaded), where it is stored."""
    path: Path
    spec: ModelSpec
    entries: dict[str, Entry]        # canonical name → entry, in tensor-table order, then the tower's

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def in_file_order(self) -> list[tuple[str, Entry]]:
        """(name, entry) sorted by file and offset: sequential reads."""
        return sorted(self.entries.items(), key=lambda kv: (str(kv[1].path), kv[1].offset))


def open_checkpoint(path: str | Path, spec: ModelSpec | None = None, require_mtp: bool = True,
                    vision: str = "load") -> Checkpoint:
    """Validate a checkpoint from its config and headers alone (no tensor data is read).

    The spec defaults to the one derived from `config.json`. With `require_mtp=False` a checkpoint
    without mtp.* tensors opens, and its spec has no MTP layer. `vision` (VISION_MODES) says what becomes
    of the vision tower of a spec with a vision section: loaded, skipped (section kept) or dropped.
    """
    path = _checkpoint_dir(path)
    if spec is None:
        spec = _spec_for(path)
    found = _scan(_shard_files(path), spec)
    spec = _reconcile(spec, found, path, require_mtp, vision)
    tower = vision == "load"
    _validate(spec, found, path, tower)
    return Checkpoint(path, spec, {t.name: found[t.name] for t in weight_table(spec, tower)})


def load_checkpoint(path: str | Path, spec: ModelSpec | None = None, require_mtp: bool = True,
                    vision: str = "load") -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Every tensor the spec needs as a float32 CPU tensor keyed by canonical name (tensor-table
    order, then the vision tower's), read one at a time (see `open_checkpoint` for `spec`, `require_mtp`
    and `vision`)."""
    ckpt = open_checkpoint(path, spec, require_mtp, vision)
    tensors: dict[str, torch.Tensor] = {}
    with Reader("cpu") as reader, tqdm(total=ckpt.nbytes, desc=f"loading {ckpt.path.name}", unit="B",
                                       unit_scale=True, unit_divisor=1024, disable=None, leave=False) as bar:
        for name, entry in ckpt.in_file_order():
            tensors[name] = reader.read(entry).to(torch.float32)
            bar.update(entry.nbytes)
    return ckpt.spec, {name: tensors[name] for name in ckpt.entries}


def quantize_weights(spec: ModelSpec, tensors: dict) -> dict[str, torch.Tensor | QTensor | KQTensor]:
    """Each tensor in the format the spec's recipe gives it: QTensor, KQTensor or a bf16/fp32 tensor. A
    tensor already in that format (a GGUF file's blocks) passes as it is; k-quants have no quantiser."""
    roles = {t.name: t for t in weight_table(spec)}
    out: dict[str, torch.Tensor | QTensor | KQTensor] = {}
    for name, w in tensors.items():
        if name not in roles:
            raise CheckpointError(f"tensor {name!r} is not in the tensor table of spec {spec.name!r}")
        fmt = format_of(spec, roles[name])
        if isinstance(w, (QTensor, KQTensor)):
            if w.fmt != fmt:
                raise CheckpointError(f"tensor {name!r} is stored as {w.fmt} but spec {spec.name!r} gives it "
                                      f"{fmt}: requantising is not supported")
            out[name] = w
            continue
        if fmt in KFORMATS:
            raise CheckpointError(f"tensor {name!r}: the recipe gives it {fmt}, a k-quant format with no "
                                  "quantiser here (k-quant weights come from a GGUF file)")
        if fmt not in FLOAT_FORMATS and w.dim() != 2:
            raise CheckpointError(f"tensor {name!r} of shape {list(w.shape)} cannot take the quantised format "
                                  f"{fmt!r} (role {roles[name].role}): only 2-D matrices are quantised")
        try:
            out[name] = convert(w, fmt)
        except ValueError as err:
            raise CheckpointError(f"cannot convert tensor {name!r} to {fmt}: {err}") from None
    return out


def _float32(w) -> torch.Tensor:
    if isinstance(w, QTensor):
        return dequantize(w)
    return dequantize_kquant(w) if isinstance(w, KQTensor) else w.to(torch.float32)


def dequantized(tensors: dict) -> dict[str, torch.Tensor]:
    """Float32 tensors for the reference backend, QTensors and KQTensors dequantised."""
    return {name: _float32(w) for name, w in tensors.items()}
