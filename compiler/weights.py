"""weights: the device weight names and planes that plans bind and the runtime provides — which
matrices are packed (MLP gate and up fused into one `…mlp.gate_up.weight`; a tied LM head packed from
the embedding), the planes of each format and their sizes. Layouts themselves: kernels.weight_layout.
"""
from __future__ import annotations

from .kernels.weight_layout import FORMATS, padded_rows
from .kquant import KFORMATS, QK_K
from .model import lm_head_name
from .spec import ModelSpec, TensorInfo, tensor_table

NON_MATRIX_ROLES = ("embed", "norm", "conv", "gdn_decay")
__all__ = ["NON_MATRIX_ROLES", "gate_up_name", "lm_head_name", "packed_matrices", "plane_bytes", "planes_of"]


def gate_up_name(gate_name: str) -> str:
    """The fused [gate; up] matrix of the MLP whose gate projection is `gate_name`."""
    return gate_name.replace("mlp.gate_proj.weight", "mlp.gate_up.weight")


def packed_matrices(spec: ModelSpec) -> list[tuple[str, list[TensorInfo]]]:
    """(device name, source tensors) of every packed matrix, gate+up fused; the LM head of a tied model
    is packed from the embedding."""
    table = tensor_table(spec)
    by_name = {t.name: t for t in table}
    out = []
    for t in table:
        if t.role in NON_MATRIX_ROLES or len(t.shape) != 2 or t.name.endswith("mlp.up_proj.weight"):
            continue
        if t.name.endswith("mlp.gate_proj.weight"):
            out.append((gate_up_name(t.name), [t, by_name[t.name.replace("gate_proj", "up_proj")]]))
        else:
            out.append((t.name, [t]))
    if spec.model.tie_word_embeddings:
        out.append(("embed_tokens.weight", [by_name["embed_tokens.weight"]]))
    return out


def plane_bytes(fmt: str, n: int, k: int) -> dict[str, int]:
    """Bytes of each packed plane of an [n, k] matrix (what weight_layout.pack_for_device produces; a
    k-quant's `lo` is its super-blocks as stored, rows padded like every format's)."""
    if fmt in KFORMATS:
        return {"lo": padded_rows(n) * (k // QK_K) * KFORMATS[fmt].block_bytes, "hi": 0, "scales": 0}
    bits, group = FORMATS[fmt]
    n_pad = padded_rows(n)
    lo = n_pad * k * (2 if fmt == "bf16" else 1 if fmt == "w8g32" else 0.5)
    hi = {"q5g64": n_pad * k // 8, "q6g64": n_pad * k // 4}.get(fmt, 0)
    scales = 0 if fmt == "bf16" else n_pad * (k // group) * 2
    return {"lo": int(lo), "hi": hi, "scales": scales}


def planes_of(fmt: str) -> tuple[str, ...]:
    """The planes a packed matrix of `fmt` has (q4g64: lo and scales; q5g64/q6g64 also hi; bf16 and the
    k-quants: lo)."""
    k = QK_K if fmt in KFORMATS else FORMATS[fmt][1]
    return tuple(p for p, n in plane_bytes(fmt, 16, k).items() if n)
