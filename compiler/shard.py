"""shard: tensor parallelism as a transformation of the spec and the weights — one rank's share of the model.

Megatron-style, in the model's own head structure (MODEL.md §3–4):
- column-parallel (each rank its heads / columns, no communication): the GDN `in_proj_qkv` rows and conv
  channels of the rank's key and value heads, `in_proj_z`, `in_proj_a/b`, `A_log`, `dt_bias` of its value
  heads; attention `q_proj` (per head [query | gate]), `k_proj`, `v_proj` of its query heads and the KV
  heads they read (a KV head is replicated when a rank's query heads are fewer than a group); MLP gate and
  up rows;
- row-parallel (each rank its input columns, then `all_reduce` in the model program): GDN `out_proj`,
  attention `o_proj`, MLP `down_proj`;
- vocab-parallel LM head (its rows; the model program gathers the logits), a tied head cut from the
  embedding;
- replicated: the embedding, every norm weight, the MTP's `fc` and norms.
A rank's GDN state and KV cache hold only its heads, so per-card state shrinks with the ranks. Value head h
reads key head ⌊h / group⌋ and query head j KV head ⌊j / group⌋, so a rank's heads are contiguous blocks.
The shard is exact: concatenating the ranks' column shards, or summing their row-parallel products,
gives the whole model's (tests/test_tensor_parallel.py).
"""
from __future__ import annotations

from dataclasses import replace

from .spec import ModelSpec, ParallelSpec, SpecError, format_of, tensor_table


def _blocks(heads: int, readers: int, tp: int, what: str, reader: str) -> tuple[int, int]:
    """(readers per rank, heads per rank) when `readers` heads read `heads` in contiguous groups: each rank
    takes readers / tp of them and the heads they read (replicated when fewer than one per rank)."""
    if readers % tp:
        raise SpecError("parallel.tp", f"{readers} {reader} do not split over {tp} ranks")
    per_rank = readers // tp
    group = readers // heads
    if per_rank % group == 0:
        return per_rank, per_rank // group
    if group % per_rank == 0:
        return per_rank, 1                    # a rank's readers all read one head: it is replicated
    raise SpecError("parallel.tp", f"{what}: {per_rank} {reader} per rank straddle groups of {group}")


def shard_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """One rank's spec (every rank's is the same): the head counts, MLP width and LM head rows of a share."""
    if spec.parallel.tp != 1:
        raise ValueError(f"{spec.name} is already one rank's share of {spec.parallel.tp}")
    if tp == 1:
        return spec
    a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
    if g.out_head_order != "grouped":       # a rank's value heads would not be contiguous out_proj columns
        raise SpecError("parallel.tp", f"{spec.name}: out_proj columns in {g.out_head_order} head order (a GGUF "
                                       "file's) do not shard; tensor parallelism needs grouped order")
    heads, kv = _blocks(at.num_kv_heads, at.num_heads, tp, "attention", "query heads")
    values, keys = _blocks(g.num_key_heads, g.num_value_heads, tp, "GDN", "value heads")
    for n, what in ((a.intermediate_size, "MLP columns"), (a.vocab_size, "vocabulary rows of the LM head")):
        if n % tp:
            raise SpecError("parallel.tp", f"{n} {what} do not split over {tp} ranks")
    model = replace(a, intermediate_size=a.intermediate_size // tp, tie_word_embeddings=False,
                    attention=replace(at, num_heads=heads, num_kv_heads=kv),
                    linear_attention=replace(g, num_key_heads=keys, num_value_heads=values))
    return replace(spec, name=f"{spec.name}.tp{tp}", model=model, parallel=ParallelSpec(tp))


def check_quantised_shares(rank: ModelSpec) -> None:
    """A rank's quantised matrices must hold whole quantisation groups along their input columns (the
    row-parallel projections are cut there), else the GPU kernels cannot read its share."""
    from .kernels.weight_layout import FORMATS

    for t in tensor_table(rank):
        fmt = format_of(rank, t)
        if len(t.shape) == 2 and fmt in FORMATS and fmt != "bf16" and t.shape[1] % FORMATS[fmt][1]:
            raise SpecError("parallel.tp", f"{t.name}: {t.shape[1]} input columns per rank are not a multiple of its "
                            f"{fmt} group ({FORMATS[fmt][1]}): a quantised share must hold whole groups")


def shard_weights(spec: ModelSpec, weights: dict, tp: int, rank: int) -> dict:
    """Rank `rank`'s tensors (canonical names, as `spec.tensor_table` of its spec) out of the whole model's
    `weights` of `spec`: slices (views where they are contiguous), never new values."""
    import torch

    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not one of {tp} ranks")
    a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
    local = shard_spec(spec, tp)
    la, lat, lg = local.model, local.model.attention, local.model.linear_attention
    out = {}

    q0 = rank * lat.num_heads                                   # this rank's first query head,
    kv0 = q0 // at.group                                         # the KV head it reads,
    v0 = rank * lg.num_value_heads                               # its first value head,
    k0 = v0 // g.group                                           # the key head it reads
    f0 = rank * la.intermediate_size
    vocab = a.vocab_size // tp
    values = slice(v0 * g.value_head_dim, (v0 + lg.num_value_heads) * g.value_head_dim)   # its value channels
    keys = slice(k0 * g.key_head_dim, (k0 + lg.num_key_heads) * g.key_head_dim)

    def gdn_channels(t):                                         # [q | k | v] rows of in_proj_qkv / conv1d
        q, k, v = t[:g.key_dim], t[g.key_dim:2 * g.key_dim], t[2 * g.key_dim:]
        return torch.cat([q[keys], k[keys], v[values]])

    q_width = at.head_dim * (2 if at.output_gate else 1)        # q_proj rows per head ([query | gate])
    for name, t in weights.items():
        if name.endswith("linear_attn.in_proj_qkv.weight") or name.endswith("linear_attn.conv1d.weight"):
            out[name] = gdn_channels(t)
        elif name.endswith("linear_attn.in_proj_z.weight"):
            out[name] = t[values]
        elif name.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                            "linear_attn.dt_bias")):
            out[name] = t[v0:v0 + lg.num_value_heads]
        elif name.endswith("linear_attn.out_proj.weight"):
            out[name] = t[:, values]
        elif name.endswith("self_attn.q_proj.weight"):
            out[name] = t[q0 * q_width:(q0 + lat.num_heads) * q_width]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            out[name] = t[kv0 * at.head_dim:(kv0 + lat.num_kv_heads) * at.head_dim]
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = t[:, q0 * at.head_dim:(q0 + lat.num_heads) * at.head_dim]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[name] = t[f0:f0 + la.intermediate_size]
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = t[:, f0:f0 + la.intermediate_size]
        elif name == "lm_head.weight":
            out[name] = t[rank * vocab:(rank + 1) * vocab]
        else:                                                    # embedding, norms, the MTP's fc: replicated
            out[name] = t
    if a.tie_word_embeddings:
        out["lm_head.weight"] = weights["embed_tokens.weight"][rank * vocab:(rank + 1) * vocab]
    return out
