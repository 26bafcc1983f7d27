"""sizes: the sizes that drive the design (MODEL.md §7) and the memory plan — bytes of weights,
state, ReplaySSM records and KV — computed from a spec. Pure arithmetic."""
from __future__ import annotations

from .spec import ModelSpec, TensorInfo, format_of, tensor_table

FORMAT_BITS = {"q4g64": 4 + 16 / 64, "q5g64": 5 + 16 / 64, "q6g64": 6 + 16 / 64, "w8g32": 8 + 16 / 32,
               "q4_k": 144 * 8 / 256, "q5_k": 176 * 8 / 256, "q6_k": 210 * 8 / 256,   # compiler.kquant
               "bf16": 16, "fp32": 32}


def weight_bytes(spec: ModelSpec) -> int:
    """Every tensor in its recipe format: what the weights occupy on the device."""
    return int(sum(t.numel * FORMAT_BITS[format_of(spec, t)] / 8 for t in tensor_table(spec)))


def record_bytes_per_token(spec: ModelSpec) -> int:
    """ReplaySSM record per verify token over all GDN layers: raw k and v (bf16), g and beta (fp32),
    the pre-conv column (bf16)."""
    g = spec.model.linear_attention
    n_gdn = sum(k == "linear_attention" for k in spec.model.layers.kinds)
    return n_gdn * (2 * g.key_dim + 2 * g.value_dim + 2 * 4 * g.num_value_heads + 2 * g.conv_dim)


def snapshot_bytes_per_token(spec: ModelSpec) -> int:
    """Snapshot mode per verify token over all GDN layers: a copy of the fp32 state, plus the pre-conv
    column (bf16) the conv history is folded from."""
    g = spec.model.linear_attention
    n_gdn = sum(k == "linear_attention" for k in spec.model.layers.kinds)
    return n_gdn * (4 * g.num_value_heads * g.key_head_dim * g.value_head_dim + 2 * g.conv_dim)


def summary(spec: ModelSpec) -> dict:
    """Sizes that drive the design (MODEL.md §7), computed from the spec."""
    a, g, at = spec.model, spec.model.linear_attention, spec.model.attention
    table = tensor_table(spec)
    params = sum(t.numel for t in table)
    main = [t for t in table if not t.name.startswith("mtp.") and t.role != "embed"]
    if a.tie_word_embeddings:  # the tied head is streamed through the embedding's format
        main.append(TensorInfo("lm_head(tied)", (a.vocab_size, a.hidden_size), "embed"))
    fwd_bytes = sum(t.numel * FORMAT_BITS[format_of(spec, t)] / 8 for t in main)
    mtp_bytes = sum(t.numel * FORMAT_BITS[format_of(spec, t)] / 8 for t in table if t.name.startswith("mtp."))
    n_gdn = sum(k == "linear_attention" for k in a.layers.kinds)
    n_attn = a.layers.count - n_gdn
    kv_values = 2 * at.num_kv_heads * at.head_dim
    return {
        "name": spec.name,
        "parameters": params,
        "layers": {"linear_attention": n_gdn, "full_attention": n_attn, "mtp": a.mtp.num_layers},
        "bytes_per_forward": int(fwd_bytes),
        "mtp_bytes_per_draft": int(mtp_bytes),
        "gdn_state_bytes_per_sequence": n_gdn * g.num_value_heads * g.key_head_dim * g.value_head_dim * 4,
        "conv_history_bytes_per_sequence": n_gdn * g.conv_dim * (g.conv_kernel - 1) * 2,
        "kv_bytes_per_token_bf16": (n_attn + a.mtp.num_layers) * kv_values * 2,
        "kv_bytes_per_token_int8": (n_attn + a.mtp.num_layers) * (kv_values + kv_values // 64 * 2),
        "weight_bytes": weight_bytes(spec),
        "record_bytes_per_token": record_bytes_per_token(spec),
    }
