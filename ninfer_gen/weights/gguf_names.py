"""gguf_names: llama.cpp's qwen35 tensor names ↔ our canonical names, and the undoing of what its
converter did to each tensor (MODEL.md §6 names; llama.cpp's `Qwen3_5TextModel` conversion):

  zero-centred norms (all but the GDN gated norm) are stored as 1 + w   → w = stored − 1
  A_log is stored as ssm_a = −exp(A_log)                                → A_log = log(−ssm_a)
  conv1d [C, 1, K] is stored squeezed [C, K]                            → unsqueezed
  GDN value heads are tiled over the key heads (head j·nk + kh = grouped kh·g + j) in the rows of
  in_proj_qkv's v part, in_proj_z, in_proj_a/b, A_log, dt_bias and conv1d's v channels → put back in
  grouped order (rows are whole blocks); so are out_proj's columns where its blocks do not span heads
  (float, Q8_0), else they stay tiled (k-quants: the spec says out_head_order tiled)
  the MTP layer is block n_layers: nextn.{eh_proj, enorm, hnorm, shared_head_norm} and a decoder layer

Pure name and tensor arithmetic on host values (torch tensors, QTensor, KQTensor); reads no file.
"""
from __future__ import annotations

import torch

from compiler.kquant import KQTensor
from compiler.quant import QTensor
from compiler.spec import ModelSpec, tensor_table

_MAX_LISTED = 10
_GLOBAL = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {   # canonical suffix within a decoder layer → llama.cpp's suffix within its block
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_MTP = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown}, … and {more} more" if more > 0 else shown


def gguf_name(name: str, n_layers: int) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    if name in _MTP:
        return f"blk.{n_layers}.{_MTP[name]}"
    head, _, rest = name.partition(".")
    if head == "layers":
        i, _, suffix = rest.partition(".")
        return f"blk.{i}.{_LAYER[suffix]}"
    if name.startswith("mtp.layers.0."):
        return f"blk.{n_layers}.{_LAYER[name[len('mtp.layers.0.'):]]}"
    raise KeyError(name)


def gguf_names(spec: ModelSpec) -> dict[str, str]:
    """Canonical name → the GGUF tensor name of every tensor of the spec's table."""
    n = spec.model.layers.count
    return {t.name: gguf_name(t.name, n) for t in tensor_table(spec)}


def zero_centred(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def transformed(name: str) -> bool:
    """Whether loading changes the tensor's values (not only their order)."""
    return zero_centred(name) or name.endswith("linear_attn.A_log")


def stored_shape(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1) if name.endswith("conv1d.weight") else tuple(shape)


def grouped_heads(spec: ModelSpec, head_dim: int) -> torch.Tensor | None:
    """Row index (into tiled rows) of each grouped value-head row; None when the orders agree."""
    g = spec.model.linear_attention
    if g.group == 1:
        return None
    h = torch.arange(g.num_value_heads)
    src_head = (h % g.group) * g.num_key_heads + h // g.group          # grouped kh·g + j ← tiled j·nk + kh
    return (src_head.view(-1, 1) * head_dim + torch.arange(head_dim).view(1, -1)).reshape(-1)


def _rows(value, index: torch.Tensor):
    if isinstance(value, KQTensor):
        return value.rows(index)
    if isinstance(value, QTensor):
        return QTensor(value.fmt, value.codes[index].contiguous(), value.scales[index].contiguous())
    return value[index].contiguous()


def _columns(value, index: torch.Tensor):
    """Columns in `index` order: a float matrix, or a QTensor whose groups `index` moves whole."""
    if isinstance(value, KQTensor):
        raise ValueError("k-quant super-blocks span heads: their columns cannot be reordered")
    if isinstance(value, QTensor):
        group = value.format.group
        groups = index.view(-1, group)[:, 0] // group
        return QTensor(value.fmt, value.codes[:, index].contiguous(), value.scales[:, groups].contiguous())
    return value[:, index].contiguous()


def columns_movable(type_id: int, head_dim: int) -> bool:
    """Whether whole value heads of out_proj's columns can move in a tensor of GGML type `type_id`:
    float types, and Q8_0 when its 32-value blocks tile a head."""
    return type_id in (0, 1, 30) or (type_id == 8 and head_dim % 32 == 0)


def _tail_rows(value, start: int, index: torch.Tensor):
    """Rows [start:] taken in `index` order (relative to start), rows before kept."""
    return _rows(value, torch.cat([torch.arange(start), start + index]))


def to_canonical(spec: ModelSpec, name: str, value):
    """A stored GGUF tensor as the canonical tensor `name` (module docstring), in its stored format."""
    g = spec.model.linear_attention
    if zero_centred(name):
        return value.to(torch.float32) - 1.0
    if name.endswith("linear_attn.A_log"):
        value = torch.log(-value.to(torch.float32))
    if name.endswith("conv1d.weight"):
        value = value.unsqueeze(1)
    if name.endswith("out_proj.weight") and g.out_head_order == "grouped":
        index = grouped_heads(spec, g.value_head_dim)
        return value if index is None else _columns(value, index)
    if ".linear_attn." not in name or name.endswith(("out_proj.weight", "norm.weight")):
        return value
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        index, start = grouped_heads(spec, g.value_head_dim), 2 * g.key_dim
    elif name.endswith("in_proj_z.weight"):
        index, start = grouped_heads(spec, g.value_head_dim), 0
    else:                                                   # in_proj_a, in_proj_b, A_log, dt_bias: one per head
        index, start = grouped_heads(spec, 1), 0
    return value if index is None else _tail_rows(value, start, index)
