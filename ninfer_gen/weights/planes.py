"""planes: a spec's weights as the flat set of device planes the kernels read — names, dtypes and shapes
known from the spec alone (`plane_table`), built one source tensor at a time (`PlanePacker`), and turned
back into canonical float tensors for the reference backend (`canonical_tensors`).

Plane keys are `<device name>#<plane>`, the planes `DeviceWeights.plane` resolves: `lo`/`hi`/`scales` of a
packed matrix (compiler.weights: gate+up fused, a tied head packed from the embedding), `rows`/`row_scales`
of the embedding's gather table, `tensor` of a small weight (kept in its recipe format: norms, conv,
GDN decay). The vision tower's tensors (`vision_plane_table`) are `tensor` planes in the recipe's `vision` format
that only a container carries: no device runs the tower. Device-agnostic: the packer runs where its inputs are.
"""
from __future__ import annotations

import hashlib
from functools import cache
from typing import Callable

import torch

from compiler.kernels.weight_layout import (FORMATS, group_of, pack_for_device, pack_kquant_for_device, padded_rows,
                                            unpack_from_device, unpack_kquant_from_device)
from compiler.kquant import KFORMATS, QK_K, KQTensor
from compiler.kquant import dequantize as dequantize_kquant
from compiler.quant import FLOAT_FORMATS, QTensor, dequantize
from compiler.spec import ModelSpec, format_of, tensor_table, vision_tensor_table
from compiler.weights import NON_MATRIX_ROLES, packed_matrices, plane_bytes

from .safetensors_io import CheckpointError

EMBED = "embed_tokens.weight"
_DTYPE = {"bf16": "BF16", "fp32": "F32"}


def key(name: str, plane: str) -> str:
    return f"{name}#{plane}"


def split_key(k: str) -> tuple[str, str]:
    name, _, plane = k.rpartition("#")
    return name, plane


def device_format(fmt: str) -> str:
    """A packed matrix's device format: its recipe format, bf16 for float recipes (the kernels' only one)."""
    return "bf16" if fmt in FLOAT_FORMATS else fmt


def plane_table(spec: ModelSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, safetensors dtype, shape) of every non-empty plane, in a fixed order: matrices in
    `packed_matrices` order, then the embedding table, then small tensors in tensor-table order."""
    out = []
    for name, infos in packed_matrices(spec):
        fmt = device_format(format_of(spec, infos[0]))
        n, k = sum(i.shape[0] for i in infos), infos[0].shape[1]
        for plane, size in plane_bytes(fmt, n, k).items():
            if size:
                out.append((key(name, plane), "F16" if plane == "scales" else "U8",
                            (size // 2 if plane == "scales" else size,)))
    table = tensor_table(spec)
    for info in table:
        if info.name == EMBED:
            fmt = format_of(spec, info)
            v, h = info.shape
            if fmt in FLOAT_FORMATS:
                out.append((key(EMBED, "rows"), _DTYPE[fmt], (v, h)))
            elif fmt in KFORMATS:                            # the rows' super-blocks as stored
                out.append((key(EMBED, "rows"), "U8", (v, h // QK_K * KFORMATS[fmt].block_bytes)))
            else:
                out += [(key(EMBED, "rows"), "I8", (v, h)), (key(EMBED, "row_scales"), "F16", (v, h // group_of(fmt)))]
    for info in table:
        if info.role in NON_MATRIX_ROLES and info.name != EMBED:
            out.append((key(info.name, "tensor"), _DTYPE[format_of(spec, info)], info.shape))
    return out


def vision_plane_table(spec: ModelSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, safetensors dtype, shape) of the vision tower's planes (one `tensor` plane per tensor, in its
    recipe format, bf16 or fp32), in vision-tensor-table order; empty for a text-only spec."""
    return [(key(t.name, "tensor"), _DTYPE[format_of(spec, t)], t.shape) for t in vision_tensor_table(spec)]


def is_tower_key(plane_key: str) -> bool:
    """Whether a plane key is one of the vision tower's (`visual.*`)."""
    return plane_key.startswith("visual.")


# Bytes of int64 temporaries pack_for_device may hold per row chunk (~40 bytes per weight): small on the
# host, where they count against the streaming bound; larger on a GPU, where fewer chunks launch less.
PACK_TEMP_BYTES = {"cpu": 16 << 20, "cuda": 1 << 30}


def _pack(parts: list) -> dict[str, torch.Tensor]:
    formats = {p.fmt if isinstance(p, (QTensor, KQTensor)) else "float" for p in parts}
    if len(formats) > 1:            # gate and up are one fused matrix on the device
        raise CheckpointError(f"a fused gate/up matrix needs one format for both halves, got {' and '.join(sorted(formats))}")
    if isinstance(parts[0], KQTensor):
        w = parts[0] if len(parts) == 1 else KQTensor(parts[0].fmt, torch.cat([p.blocks for p in parts]), parts[0].k)
        return pack_kquant_for_device(w, gate_up=len(parts) == 2)
    first = parts[0].codes if isinstance(parts[0], QTensor) else parts[0]
    budget = PACK_TEMP_BYTES.get(first.device.type, PACK_TEMP_BYTES["cpu"])
    chunk_rows = max(16, budget // (40 * first.shape[1]) // 16 * 16)
    if isinstance(parts[0], QTensor):
        w = parts[0] if len(parts) == 1 else QTensor(parts[0].fmt, torch.cat([p.codes for p in parts]),
                                                     torch.cat([p.scales for p in parts]))
    else:
        w = torch.cat([p.to(torch.bfloat16) for p in parts])
    return pack_for_device(w, gate_up=len(parts) == 2, chunk_rows=chunk_rows)


class PlanePacker:
    """Receives a spec's tensors in its recipe formats (canonical names, any order, on one device) and
    calls `emit(key, tensor)` for each plane as soon as its sources are in; gate and up wait for each other.
    With `tower` it takes the vision tower's tensors too (a container's planes), else it refuses them."""

    def __init__(self, spec: ModelSpec, emit: Callable[[str, torch.Tensor], None], tower: bool = False):
        self.spec, self.emit = spec, emit
        self._roles = {t.name: t for t in tensor_table(spec) + (vision_tensor_table(spec) if tower else [])}
        self._uses: dict[str, list[tuple[str, int, int]]] = {}   # source → (device name, part, parts)
        for name, infos in packed_matrices(spec):
            for i, info in enumerate(infos):
                self._uses.setdefault(info.name, []).append((name, i, len(infos)))
        self._waiting: dict[str, list] = {}
        self._seen: set[str] = set()

    def add(self, name: str, value) -> None:
        if name not in self._roles:
            raise CheckpointError(f"tensor {name!r} is not in the tensor table of spec {self.spec.name!r}")
        if name in self._seen:
            raise CheckpointError(f"tensor {name!r} was given twice")
        self._seen.add(name)
        info = self._roles[name]
        if name == EMBED:
            if isinstance(value, KQTensor):
                self.emit(key(EMBED, "rows"), value.blocks.contiguous())
            elif isinstance(value, QTensor):
                self.emit(key(EMBED, "rows"), value.codes.contiguous())
                self.emit(key(EMBED, "row_scales"), value.scales.contiguous())
            else:
                self.emit(key(EMBED, "rows"), value.contiguous())
        elif info.role in NON_MATRIX_ROLES or info.role == "vision":
            self.emit(key(name, "tensor"), value.contiguous())
        for device_name, part, parts in self._uses.get(name, []):
            slots = self._waiting.setdefault(device_name, [None] * parts)
            slots[part] = value
            if all(s is not None for s in slots):
                del self._waiting[device_name]
                for plane, t in _pack(slots).items():
                    if t.numel():
                        self.emit(key(device_name, plane), t)

    def finish(self) -> None:
        missing = [n for n in self._roles if n not in self._seen]
        if missing:
            raise CheckpointError(f"{len(missing)} tensor(s) of spec {self.spec.name!r} never arrived: "
                                  f"{', '.join(missing[:10])}")


def canonical_tensors(spec: ModelSpec, planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float32 tensors by canonical name from a plane set (the inverse of PlanePacker, dequantised):
    what `dequantized(quantize_weights(...))` gives for recipes whose matrices are quantised or bf16. The vision
    tower's tensors follow the text model's where `planes` holds them."""
    out: dict[str, torch.Tensor] = {}
    for name, infos in packed_matrices(spec):
        if name == EMBED and spec.model.tie_word_embeddings:
            continue                                  # the tied head is the embedding, read from its table
        fmt = device_format(format_of(spec, infos[0]))
        n, k = sum(i.shape[0] for i in infos), infos[0].shape[1]
        packed = {p: planes.get(key(name, p), torch.zeros(0)) for p in ("lo", "hi", "scales")}
        if fmt in KFORMATS:
            w = dequantize_kquant(unpack_kquant_from_device(packed, fmt, n, k, gate_up=len(infos) == 2))
        else:
            w = unpack_from_device(packed, fmt, n, k, gate_up=len(infos) == 2)
            w = dequantize(w) if isinstance(w, QTensor) else w.to(torch.float32)
        for info, part in zip(infos, torch.split(w, [i.shape[0] for i in infos])):
            out[info.name] = part.contiguous()
    for info in tensor_table(spec):
        if info.name == EMBED:
            rows = planes[key(EMBED, "rows")]
            fmt = format_of(spec, info)
            if fmt in KFORMATS:
                out[EMBED] = dequantize_kquant(KQTensor(fmt, rows, info.shape[1]))
            else:
                out[EMBED] = rows.to(torch.float32) if fmt in FLOAT_FORMATS else \
                    dequantize(QTensor(fmt, rows, planes[key(EMBED, "row_scales")]))
        elif info.role in NON_MATRIX_ROLES:
            out[info.name] = planes[key(info.name, "tensor")].to(torch.float32)
    text = {t.name: out[t.name] for t in tensor_table(spec)}
    tower = {t.name: planes[key(t.name, "tensor")].to(torch.float32) for t in vision_tensor_table(spec)
             if key(t.name, "tensor") in planes}
    return text | tower


@cache
def layout_fingerprint() -> str:
    """sha256 over fixed probe matrices packed in every device format, k-quants included (plain and gate/up fused):
    changes exactly when `weight_layout` would write different planes, so a container of old planes is refused."""
    h = hashlib.sha256()
    for fmt, (bits, group) in sorted(FORMATS.items()):
        n, k = 32, 2 * group
        ramp = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
        if fmt == "bf16":
            w = ((ramp % 251) - 125).to(torch.bfloat16)
        else:
            span = (1 << bits) - 1 if fmt != "w8g32" else 254
            codes = ((ramp * 7 + ramp // k) % span - span // 2).to(torch.int8)
            w = QTensor(fmt, codes, (torch.arange(n * k // group) % 13 + 1).reshape(n, -1).to(torch.float16))
        for gate_up in (False, True):
            for plane, t in sorted(pack_for_device(w, gate_up=gate_up, chunk_rows=padded_rows(16)).items()):
                h.update(f"{fmt}/{gate_up}/{plane}:".encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    for fmt, kf in sorted(KFORMATS.items()):          # k-quant blocks: a byte ramp, 32 rows of 2 super-blocks
        blocks = (torch.arange(32 * 2 * kf.block_bytes) % 251).to(torch.uint8).reshape(32, -1)
        for gate_up in (False, True):
            t = pack_kquant_for_device(KQTensor(fmt, blocks, 2 * QK_K), gate_up=gate_up)["lo"]
            h.update(f"{fmt}/{gate_up}/lo:".encode() + t.numpy().tobytes())
    return h.hexdigest()
