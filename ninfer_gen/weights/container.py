"""container: reads the converted-weights folder `ninfer-gen convert` writes (`convert`): the device planes
as safetensors shards, `spec.yaml` (the spec with its quantisation recipe), the tokenizer, chat template
and generation config as copied, and `ninfer-manifest.json` (format version, spec hash, device-layout
fingerprint, sha256 per tensor and per copied file).

Owns the checks that refuse a container of another format version, spec or device layout (saying what
differs) or with missing, truncated or altered data, and the two ways out: planes onto a device as
stored (hashes verified by default), or canonical float tensors for the reference backend. The vision tower's
planes (bf16/fp32, never quantised) are loaded, skipped or dropped as `checkpoint.VISION_MODES` says.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from compiler.schema import SpecError
from compiler.spec import ModelSpec, load_spec

from .checkpoint import VISION_MODES, without_vision
from .planes import canonical_tensors, is_tower_key, layout_fingerprint, plane_table, vision_plane_table
from .safetensors_io import CheckpointError, Entry, Reader, read_header
from .streaming import DEVICE_INFLIGHT, HOST_INFLIGHT, prefetch, progress_bar, workers_for

MANIFEST = "ninfer-manifest.json"
SPEC_FILE = "spec.yaml"
FORMAT = "ninfer-gen converted weights"
FORMAT_VERSION = 1
WEIGHT_SECTIONS = ("model", "quantization")     # the spec sections the stored planes depend on
_LISTED = 8
_ADDED_KEYS = (("", "vision", None), ("quantization", "vision", "bf16"))     # (section, key, default)


def spec_dict(spec: ModelSpec) -> dict:
    """The spec as plain JSON data (`compiler.spec.spec_from_dict` reads it back), its layers always
    listed one by one, so a pattern and the same layers spelled out compare equal."""
    data = json.loads(json.dumps(dataclasses.asdict(spec)))
    data["model"]["layers"] = {"count": spec.model.layers.count, "pattern": None, "types": list(spec.model.layers.kinds)}
    # Keys added to the spec after containers were first written appear only where they say something, so a
    # spec that does not use them keeps the dict and hash its containers were converted with.
    for section, key, default in _ADDED_KEYS:
        where = data.get(section, {}) if section else data
        if key in where and where[key] == default:
            del where[key]
    return data


def spec_hash(spec: ModelSpec | dict) -> str:
    data = spec if isinstance(spec, dict) else spec_dict(spec)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def spec_differences(a: dict, b: dict, sections: tuple[str, ...] | None = None, path: str = "") -> list[str]:
    """'key.path: a vs b' for every leaf where spec dicts differ (only `sections` at the top level)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if not path and sections is not None and k not in sections:
            continue
        where = f"{path}.{k}" if path else k
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += spec_differences(x, y, None, where)
        elif x != y:
            out.append(f"{where}: {x!r} vs {y!r}")
    return out


def is_container(path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


@dataclass(frozen=True)
class Container:
    path: Path
    spec: ModelSpec
    manifest: dict
    entries: dict[str, Entry]           # plane key → where it is stored, in plane-table order

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def _manifest(path: Path) -> dict:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path / MANIFEST} cannot be read as JSON ({err}): not a usable container") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST} is not a ninfer-gen container manifest (format "
                              f"{data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is a container of format version {data.get('format_version')!r}; this "
                              f"ninfer-gen reads version {FORMAT_VERSION}: convert the checkpoint again")
    if data.get("layout") != layout_fingerprint():
        raise CheckpointError(f"{path} holds planes packed for another device layout (fingerprint "
                              f"{str(data.get('layout'))[:12]}, this build packs {layout_fingerprint()[:12]}: "
                              "compiler/kernels/weight_layout.py changed): convert the checkpoint again")
    return data


def _spec(path: Path, manifest: dict, expected: ModelSpec | None) -> ModelSpec:
    try:
        spec = load_spec(path / SPEC_FILE)
    except SpecError as err:
        raise CheckpointError(f"{path / SPEC_FILE}: {err}") from None
    if spec_hash(spec) != manifest.get("spec_hash"):
        diff = spec_differences(spec_dict(spec), manifest.get("spec") or {})
        raise CheckpointError(f"{path / SPEC_FILE} is not the spec this container was converted for "
                              f"(spec.yaml vs manifest): {'; '.join(diff[:_LISTED]) or 'hash differs'}")
    if expected is not None:
        diff = spec_differences(spec_dict(expected), spec_dict(spec), WEIGHT_SECTIONS)
        if diff:
            raise CheckpointError(f"{path} was converted for spec {spec.name!r}, not {expected.name!r} "
                                  f"(expected vs container): {'; '.join(diff[:_LISTED])}")
    return spec


def _settle_tower(path: Path, spec: ModelSpec, manifest: dict, vision: str) -> ModelSpec:
    """The spec the load runs: without its vision section for `vision` "drop" or a container that holds no
    tower (converted from a checkpoint without one; said on stderr)."""
    if vision not in VISION_MODES:
        raise ValueError(f"vision must be one of {', '.join(VISION_MODES)}, got {vision!r}")
    stored = any(is_tower_key(k) for k in manifest.get("tensors") or {})
    if spec.vision is not None and vision != "drop" and not stored:
        print(f"[{path}: the spec has a vision section but the container holds no vision tower: loading the text "
              "model only (images are refused)]", file=sys.stderr)
    return without_vision(spec) if vision == "drop" or not stored else spec


def _entries(path: Path, spec: ModelSpec, manifest: dict, tower: bool) -> dict[str, Entry]:
    stored = manifest.get("tensors") or {}
    if not tower:                                   # the tower's planes, if any, stay unread and unchecked
        stored = {k: v for k, v in stored.items() if not is_tower_key(k)}
    table = plane_table(spec) + (vision_plane_table(spec) if tower else [])
    missing = [k for k, _, _ in table if k not in stored]
    extra = sorted(set(stored) - {k for k, _, _ in table})
    if missing or extra:
        raise CheckpointError(f"{path / MANIFEST} does not list the planes of its spec: {len(missing)} missing "
                              f"({', '.join(missing[:_LISTED])}), {len(extra)} unexpected ({', '.join(extra[:_LISTED])})")
    headers: dict[str, dict[str, Entry]] = {}
    entries = {}
    for k, dtype, shape in table:
        info = stored[k]
        if (info.get("dtype"), tuple(info.get("shape", ()))) != (dtype, shape):
            raise CheckpointError(f"{path / MANIFEST}: plane {k!r} is listed as {info.get('dtype')} "
                                  f"{info.get('shape')}, its spec needs {dtype} {list(shape)}")
        file = str(info.get("file"))
        if file not in headers:
            if not (path / file).is_file():
                raise CheckpointError(f"{path}: shard {file!r} (holding {k!r}) is missing")
            headers[file] = read_header(path / file)
        e = headers[file].get(k)
        if e is None or (e.dtype, e.shape) != (dtype, shape):
            raise CheckpointError(f"{path / file}: plane {k!r} is absent or not {dtype} {list(shape)}: corrupt shard")
        entries[k] = e
    return entries


def open_container(path, spec: ModelSpec | None = None, require_mtp: bool = False, vision: str = "load") -> Container:
    """Check a container from its manifest, spec and shard headers (no tensor data is read). `spec`,
    when given, must equal the container's in its model and quantisation sections. `vision`
    (checkpoint.VISION_MODES): the vision tower's planes loaded, skipped (spec kept) or dropped."""
    path = Path(path)
    if not is_container(path):
        raise CheckpointError(f"{path} is not a converted container (no {MANIFEST})")
    manifest = _manifest(path)
    spec = _spec(path, manifest, spec)
    if require_mtp and not spec.model.mtp.num_layers:
        raise CheckpointError(f"{path} holds no MTP layer (its source checkpoint had no mtp.* tensors), which "
                              "drafting needs: decode without drafts (--draft 0)")
    spec = _settle_tower(path, spec, manifest, vision)
    return Container(path, spec, manifest, _entries(path, spec, manifest, vision == "load"))


def file_hash(path: Path) -> str:
    """sha256 of a file (hex), read in 1 MiB pieces: what the manifest records for each copied file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_files(box: Container) -> None:
    """The copied files (tokenizer, configs, chat template, draft vocabulary) against their hashes."""
    for name, want in (box.manifest.get("files") or {}).items():
        if not (box.path / name).is_file():
            raise CheckpointError(f"{box.path}: {name} is listed in the manifest but missing")
        if file_hash(box.path / name) != want:
            raise CheckpointError(f"{box.path / name}: sha256 does not match the manifest: the file was modified")


def read_planes(box: Container, device="cpu", verify: bool = True, progress: bool = False,
                workers: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(plane key, tensor on `device`) as stored, in file order; with `verify` each tensor's sha256 is
    checked while it is read (a mismatch names the tensor and file) and so are the copied files."""
    device = torch.device(device)
    if verify:
        verify_files(box)
    hashes = box.manifest["tensors"]

    def load(k: str) -> torch.Tensor:
        h = hashlib.sha256() if verify else None
        t = reader.read(box.entries[k], h)
        if h is not None and h.hexdigest() != hashes[k].get("sha256"):
            raise CheckpointError(f"{box.entries[k].where}: sha256 {h.hexdigest()[:16]}… does not match the "
                                  f"manifest's {str(hashes[k].get('sha256'))[:16]}…: the shard is corrupt or was "
                                  "modified (convert again; --no-verify skips this check)")
        return t

    keys = sorted(box.entries, key=lambda k: (str(box.entries[k].path), box.entries[k].offset))
    budget = HOST_INFLIGHT if device.type == "cpu" else DEVICE_INFLIGHT
    with Reader(device) as reader, progress_bar(box.nbytes, f"loading {box.path.name}", progress) as bar:
        for k, t in prefetch(keys, load, lambda k: box.entries[k].nbytes, workers or workers_for(device), budget):
            bar.update(box.entries[k].nbytes)
            yield k, t


def load_host(path, verify: bool = True, spec: ModelSpec | None = None, require_mtp: bool = False,
              vision: str = "load") -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The container's weights as float32 CPU tensors by canonical name (dequantised), for the
    reference backend: equal to `dequantized(quantize_weights(...))` of its source checkpoint, the vision
    tower's tensors after the text model's (`vision`: as open_container)."""
    box = open_container(path, spec, require_mtp, vision)
    planes = dict(read_planes(box, "cpu", verify))
    return box.spec, canonical_tensors(box.spec, planes)
