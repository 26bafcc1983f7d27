"""gguf_file: opens a llama.cpp GGUF file of the Qwen3.5/3.6/3.8 hybrid (`general.architecture` qwen35):
its metadata as our ModelSpec (recipe = the file's own formats, tensor by tensor), its tensor table mapped
to canonical names and checked against the spec, and one tensor at a time in its stored format.

Owns GGUF errors (`GGUFError`: one line naming the file and what is wrong) and the undoing of
llama.cpp's conversion (gguf_names: norms stored as 1 + w, A_log as −exp(A_log), conv1d squeezed, GDN
value heads tiled over the key heads — put back in grouped order except out_proj's columns in k-quant
blocks, which span heads: then the spec says `out_head_order: tiled`). The header is parsed by the `gguf`
package's GGUFReader over a memory map; tensor data is read by pread, one tensor at a time, never the
whole file. Never touches a device.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compiler.kquant import KQTensor
from compiler.quant import QTensor
from compiler.schema import SpecError
from compiler.spec import ModelSpec, MTPSpec, QuantRecipe, TensorFormat, spec_from_dict, tensor_table

from . import gguf_names as names
from .safetensors_io import CheckpointError

ARCH = "qwen35"
OTHER_ARCHS = {   # what we say about the family's other GGUF architectures
    "qwen3next": "Qwen3-Next (fused in_proj_qkvz, mixture of experts)",
    "qwen35moe": "Qwen3.5-MoE (mixture of experts)",
}
# GGML type id → (its name, our format for a matrix, our format for a vector)
STORED = {0: ("F32", "fp32", "fp32"), 1: ("F16", "fp32", "fp32"), 30: ("BF16", "bf16", "bf16"),
          8: ("Q8_0", "w8g32", None), 12: ("Q4_K", "q4_k", None), 13: ("Q5_K", "q5_k", None),
          14: ("Q6_K", "q6_k", None)}
_FLOAT_IDS = (0, 1, 30)


class GGUFError(CheckpointError):
    """A GGUF file that cannot be run: the message names the file and the architecture, tensor, type or
    shape at fault."""


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def names_gguf(path: str | Path) -> bool:
    """A path the GGUF loader takes: a file that starts with the GGUF magic, or any path named *.gguf — so a missing,
    truncated or mislabelled one gets the reader's own error, not "expected a checkpoint"."""
    return is_gguf(path) or Path(path).suffix.lower() == ".gguf"


def _reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        raise GGUFError(f"{path} is not a GGUF file (its first bytes are not the magic 'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as err:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({err})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}"
                            f" of a {size}-byte file")
    return reader


class _Meta:
    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def one(self, key: str, default=None) -> int | float:
        """A scalar, or a per-layer array whose non-zero entries agree (hybrid files give 0 for GDN layers)."""
        value = self.get(key, default) if default is not None else self.need(key)
        if isinstance(value, list):
            used = sorted({v for v in value if v})
            if len(used) != 1:
                raise GGUFError(f"{self.path}: metadata {key!r} varies across layers ({used}); ninfer-gen runs "
                                "one value for every layer")
            return used[0]
        return value


def _layer_kinds(tensors: dict, n_layers: int, interval, path: Path) -> list[str]:
    kinds = []
    for i in range(n_layers):
        attn, gdn = f"blk.{i}.attn_q.weight" in tensors, f"blk.{i}.ssm_out.weight" in tensors
        if attn == gdn:
            raise GGUFError(f"{path}: block {i} has {'both' if attn else 'neither'} attention (attn_q) and "
                            "Gated DeltaNet (ssm_out) tensors")
        kinds.append("full_attention" if attn else "linear_attention")
    if interval and any((k == "full_attention") != ((i + 1) % interval == 0) for i, k in enumerate(kinds)):
        raise GGUFError(f"{path}: the blocks' tensors do not follow full_attention_interval = {interval}")
    return kinds


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _arch_dict(meta: _Meta, tensors: dict, path: Path) -> dict:
    arch = meta.need("general.architecture")
    if arch != ARCH:
        known = OTHER_ARCHS.get(arch, "not a Qwen3.5-family hybrid")
        raise GGUFError(f"{path}: GGUF architecture {arch!r} ({known}) is not supported; ninfer-gen runs "
                        f"{ARCH!r} (the dense Qwen3.5/3.6/3.8 hybrid)")
    k = lambda name: f"{arch}.{name}"                                     # noqa: E731
    nextn = int(meta.get(k("nextn_predict_layers"), 0))
    n_layers = int(meta.need(k("block_count"))) - nextn
    if nextn not in (0, 1):
        raise GGUFError(f"{path}: {nextn} MTP (nextn) layers; ninfer-gen runs 0 or 1")
    head_dim = int(meta.one(k("attention.key_length")))
    if int(meta.one(k("attention.value_length"), head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention key and value lengths differ; ninfer-gen runs equal ones")
    n_heads, v_heads = int(meta.one(k("attention.head_count"))), int(meta.need(k("ssm.time_step_rank")))
    attn = [i for i in range(n_layers) if f"blk.{i}.attn_q.weight" in tensors]
    if not attn:
        raise GGUFError(f"{path}: no block has attention tensors (blk.N.attn_q.weight)")
    q_rows = tensors[f"blk.{attn[0]}.attn_q.weight"].shape[1]
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    vocab, hidden = (int(d) for d in reversed(tensors["token_embd.weight"].shape))
    rotary = int(meta.need(k("rope.dimension_count")))
    return {
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(meta.one(k("feed_forward_length"))),
        "rms_norm_eps": _f32(meta.need(k("attention.layer_norm_rms_epsilon"))),
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": int(meta.need(k("context_length"))),
        "layers": {"count": n_layers, "types": _layer_kinds(tensors, n_layers, meta.get(k("full_attention_interval")), path)},
        "attention": {"num_heads": n_heads, "num_kv_heads": int(meta.one(k("attention.head_count_kv"))),
                      "head_dim": head_dim, "rope_theta": _f32(meta.need(k("rope.freq_base"))),
                      "partial_rotary_factor": rotary / head_dim,
                      "output_gate": int(q_rows) == 2 * n_heads * head_dim},
        "linear_attention": {"num_key_heads": int(meta.need(k("ssm.group_count"))), "num_value_heads": v_heads,
                             "key_head_dim": int(meta.need(k("ssm.state_size"))),
                             "value_head_dim": int(meta.need(k("ssm.inner_size"))) // v_heads,
                             "conv_kernel": int(meta.need(k("ssm.conv_kernel")))},
        "mtp": {"num_layers": nextn},
    }


def file_recipe(spec: ModelSpec, types: dict[str, int]) -> QuantRecipe:
    """The file's formats (GGML type id by canonical name) as a recipe: each role the commonest format of its
    tensors, the rest by name."""
    table = tensor_table(spec)
    fmt = {t.name: stored_format(types[t.name], len(t.shape), names.transformed(t.name)) for t in table}
    by_role: dict[str, Counter] = {}
    for t in table:
        by_role.setdefault(t.role, Counter())[fmt[t.name]] += 1
    base = QuantRecipe()
    roles = {role: c.most_common(1)[0][0] for role, c in by_role.items()}
    roles = {r: f for r, f in roles.items() if getattr(base, r) != f}
    chosen = dataclasses.replace(base, **roles)
    rest = tuple(TensorFormat(t.name, fmt[t.name]) for t in table if fmt[t.name] != getattr(chosen, t.role))
    return dataclasses.replace(chosen, tensors=rest)


def stored_format(type_id: int, ndim: int, transformed: bool) -> str:
    """Our weight format of a tensor stored with GGML type `type_id` (float values we change on load, like
    a norm's 1 + w, become fp32)."""
    name, matrix, vector = STORED[type_id]
    if transformed and type_id in _FLOAT_IDS:
        return "fp32"
    return matrix if ndim == 2 else vector


@dataclass
class GGUFFile:
    """An opened, validated GGUF file: the spec, and per canonical tensor name its stored tensor."""
    path: Path
    spec: ModelSpec
    meta: _Meta
    entries: dict            # canonical name → gguf ReaderTensor (its data a view of the mapped file)

    @property
    def nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.entries.values())

    def read(self, name: str):
        """Tensor `name` in canonical layout and its stored format: a KQTensor (k-quants), a QTensor
        (Q8_0 → w8g32, the same numbers), or a float tensor (fp32, or bf16 as stored)."""
        return names.to_canonical(self.spec, name, _stored_value(self.entries[name], self.path))


def q8_0_as_w8g32(raw: np.ndarray, k: int, what: str) -> QTensor:
    """Q8_0 blocks (fp16 d, 32 int8 codes: w = d·q) uint8 [rows, k/32 · 34] as the same numbers in w8g32."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, k // 32, 34)
    scales = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).reshape(rows, k // 32))
    codes = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(rows, k))
    if codes.numel() and int(codes.min()) < -127:
        raise GGUFError(f"{what} holds the code −128, outside the −127..127 that llama.cpp writes and "
                        "ninfer-gen's 8-bit format (w8g32) runs")
    return QTensor("w8g32", codes, scales)


def _read_bytes(path: Path, t) -> np.ndarray:
    """Tensor `t`'s bytes by pread: one tensor in host memory at a time and no page of the file mapped
    into the process (RSS grows by what is kept, not by what was read)."""
    n, buf = int(t.n_bytes), np.empty(int(t.n_bytes), dtype=np.uint8)     # read straight into the one copy kept
    got = 0
    with open(path, "rb") as f:
        while got < n:
            step = os.preadv(f.fileno(), [memoryview(buf)[got:]], int(t.data_offset) + got)
            if step <= 0:
                break
            got += step
    if got != n:
        raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name} has {got} of its {n} bytes")
    return buf


def _stored_value(t, path: Path):
    n_rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    k = int(t.shape[0])
    raw = _read_bytes(path, t)
    tid = int(t.tensor_type)
    if tid in (12, 13, 14):
        return KQTensor(STORED[tid][1], torch.from_numpy(raw.reshape(n_rows, -1)), k)
    if tid == 8:
        return q8_0_as_w8g32(raw.reshape(n_rows, -1), k, f"{path}: Q8_0 tensor {t.name}")
    shape = tuple(int(d) for d in reversed(t.shape))
    if tid == 30:
        return torch.from_numpy(raw.view(np.int16).reshape(shape)).view(torch.bfloat16)
    return torch.from_numpy(raw.view(np.float16 if tid == 1 else np.float32).astype(np.float32).reshape(shape))


def open_gguf(path: str | Path, require_mtp: bool = False) -> GGUFFile:
    """Validate a GGUF file from its metadata and tensor infos alone (no tensor data is read). Without
    MTP tensors the spec has no MTP layer, unless `require_mtp` (drafting needs one): then an error."""
    path = Path(path)
    reader = _reader(path)
    meta = _Meta(reader, path)
    stored = {t.name: t for t in reader.tensors}
    try:
        model = _arch_dict(meta, stored, path)
        runtime = {"max_context": min(32768, model["max_position_embeddings"])}     # as from an HF config
        spec = spec_from_dict({"name": path.stem, "model": model, "runtime": runtime})
    except SpecError as err:
        raise GGUFError(f"{path}: its metadata do not make a valid model: {err}") from None
    if require_mtp and not spec.model.mtp.num_layers:
        raise GGUFError(f"{path}: the file has no MTP (nextn) layer, which drafting needs: decode without drafts "
                        "(--draft 0)")
    gguf_of = names.gguf_names(spec)
    _validate(spec, stored, gguf_of, path)
    entries = {name: stored[g] for name, g in gguf_of.items()}
    spec = dataclasses.replace(spec, quantization=file_recipe(spec, {n: int(t.tensor_type) for n, t in entries.items()}))
    la = spec.model.linear_attention
    outs = [int(t.tensor_type) for n, t in entries.items() if n.endswith("linear_attn.out_proj.weight")]
    if la.group > 1 and not all(names.columns_movable(tid, la.value_head_dim) for tid in outs):
        la = dataclasses.replace(la, out_head_order="tiled")
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, linear_attention=la))
    return GGUFFile(path, spec, meta, entries)


def _validate(spec: ModelSpec, stored: dict, gguf_of: dict[str, str], path: Path) -> None:
    want = {t.name: t for t in tensor_table(spec)}
    missing = [g for n, g in gguf_of.items() if g not in stored]
    unexpected = sorted(set(stored) - set(gguf_of.values()))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {names.listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {names.listing(unexpected)}")
    for name, g in gguf_of.items():
        t = stored.get(g)
        if t is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        expected = names.stored_shape(want[name].shape, name)
        if shape != expected:
            problems.append(f"tensor {g} has shape {list(shape)}, expected {list(expected)}")
        elif int(t.tensor_type) not in STORED:
            problems.append(f"tensor {g} has type {t.tensor_type.name}, which ninfer-gen does not run "
                            f"(supported: {', '.join(v[0] for v in STORED.values())})")
        elif STORED[int(t.tensor_type)][2 if len(expected) == 1 else 1] is None:
            problems.append(f"tensor {g} of shape {list(shape)} is stored as {t.tensor_type.name}; "
                            "ninfer-gen runs quantised matrices only")
    if problems:
        raise GGUFError(f"{path} does not match {spec.name!r} ({ARCH}): " + "; ".join(problems))
