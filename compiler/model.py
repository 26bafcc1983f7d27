"""model: the Qwen3.5-family hybrid model written ONCE against `compiler.ops` (MODEL.md §2–5).

Traced into Graphs per entry point, or run eagerly on torch tensors (`reference_forward`, used by
training). Activations flow as [N, hidden] with N = B·T rows; per-call values come from `Batch`. A prompt with
images (compiler.multimodal) adds image tokens in place of its placeholders and 3-axis M-RoPE positions; without
them the program, and so every text-only graph, is what it always was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .ops import EagerOps, Ops
from .spec import ModelSpec


@dataclass
class Batch:
    """Per-call values of a forward: B rows × T tokens starting at positions `pos` (i32[B]).
    `state(name)` returns a state tensor/Var, or `state` is None for a stateless fresh forward."""
    B: int
    T: int
    pos: Any
    block_table: Any = None
    slots: Any = None
    state: Callable[[str], Any] | None = None
    page_size: int = 64
    kv_int8: bool = True
    records: Callable[[str], Any] | None = None     # verify (ReplaySSM): GDN layers log, never write state
    snapshots: bool = False                         # verify/commit in snapshot mode: K+1 state copies per row
    mrope: Any = None                               # i32[N, 3] M-RoPE positions (prompts with images); None: 1-D
    fold: Any = None                                # verify: (the previous round's records, commit counts): folded
                                                    # into the state before this verify reads it (REPLAYSSM.md)

    def kv(self, layer: str) -> tuple:
        if self.kv_int8:
            return (self.state(f"kv.{layer}.codes"), self.state(f"kv.{layer}.scales"))
        return (self.state(f"kv.{layer}.values"),)


def row_parallel(ops: Ops, spec: ModelSpec, y):
    """After a row-parallel projection of a rank's share (compiler.shard): the sum over the ranks."""
    return ops.all_reduce(y, spec.parallel.tp) if spec.parallel.tp > 1 else y


def vocab_parallel(ops: Ops, spec: ModelSpec, logits):
    """The LM head's logits of a rank's rows (compiler.shard): every rank's, side by side."""
    return ops.all_gather(logits, spec.parallel.tp) if spec.parallel.tp > 1 else logits


def gdn_mixer(ops: Ops, spec: ModelSpec, W, p: str, h, batch: Batch, layer: int):
    a, g = spec.model, spec.model.linear_attention
    B, T, N = batch.B, batch.T, batch.B * batch.T
    c = ops.reshape(ops.linear(h, W(f"{p}in_proj_qkv.weight")), B, T, g.conv_dim)
    z = ops.reshape(ops.linear(h, W(f"{p}in_proj_z.weight")), N, g.num_value_heads, g.value_head_dim)
    b_raw = ops.linear(h, W(f"{p}in_proj_b.weight"))
    a_raw = ops.linear(h, W(f"{p}in_proj_a.weight"))
    stateful = batch.state is not None
    history = batch.state(f"gdn.{layer}.conv") if stateful else None
    rec = batch.records
    if batch.fold is not None:
        prev, counts = batch.fold
        ops.gdn_conv_fold(history, batch.slots, prev(f"rec.{layer}.conv"), counts)
    if rec is None:
        c = ops.gdn_conv(c, W(f"{p}conv1d.weight"), history, batch.slots)
    else:
        c = ops.gdn_conv_record(c, W(f"{p}conv1d.weight"), history, batch.slots, rec(f"rec.{layer}.conv"))
    q = ops.reshape(ops.slice(c, 2, 0, g.key_dim), B, T, g.num_key_heads, g.key_head_dim)
    k = ops.reshape(ops.slice(c, 2, g.key_dim, 2 * g.key_dim), B, T, g.num_key_heads, g.key_head_dim)
    v = ops.reshape(ops.slice(c, 2, 2 * g.key_dim, g.conv_dim), B, T, g.num_value_heads, g.value_head_dim)
    decay, beta = ops.gdn_gates(a_raw, b_raw, W(f"{p}A_log"), W(f"{p}dt_bias"))
    decay = ops.reshape(decay, B, T, g.num_value_heads)
    beta = ops.reshape(beta, B, T, g.num_value_heads)
    state = batch.state(f"gdn.{layer}.state") if stateful else None
    if batch.fold is not None:
        ops.gdn_fold(state, batch.slots, *(prev(f"rec.{layer}.{part}") for part in ("k", "v", "g")), counts)
    if rec is None:
        o = ops.gdn_recurrence(q, k, v, decay, beta, state, batch.slots)
    elif batch.snapshots:
        o = ops.gdn_recurrence_snapshot(q, k, v, decay, beta, state, batch.slots, rec(f"snap.{layer}"))
    else:
        o = ops.gdn_recurrence_record(q, k, v, decay, beta, state, batch.slots,
                                      *(rec(f"rec.{layer}.{part}") for part in ("k", "v", "g")))
    o = ops.gated_rmsnorm(ops.reshape(o, N, g.num_value_heads, g.value_head_dim), z,
                          W(f"{p}norm.weight"), a.rms_norm_eps)
    if g.out_head_order == "tiled":      # out_proj's columns take the value heads tiled over the key heads
        o = ops.transpose(ops.reshape(o, N, g.num_key_heads, g.group, g.value_head_dim), (0, 2, 1, 3))
    return row_parallel(ops, spec, ops.linear(ops.reshape(o, N, g.value_dim), W(f"{p}out_proj.weight")))


def attention_mixer(ops: Ops, spec: ModelSpec, W, p: str, h, batch: Batch, layer: str):
    a, at = spec.model, spec.model.attention
    B, T, N, D = batch.B, batch.T, batch.B * batch.T, at.head_dim
    qg = ops.linear(h, W(f"{p}q_proj.weight"))
    if at.output_gate:  # per head [query | gate], not all queries then all gates
        qg = ops.reshape(qg, N, at.num_heads, 2 * D)
        q, gate = ops.slice(qg, 2, 0, D), ops.reshape(ops.slice(qg, 2, D, 2 * D), N, at.num_heads * D)
    else:
        q = ops.reshape(qg, N, at.num_heads, D)
    k = ops.reshape(ops.linear(h, W(f"{p}k_proj.weight")), N, at.num_kv_heads, D)
    v = ops.reshape(ops.linear(h, W(f"{p}v_proj.weight")), B, T, at.num_kv_heads, D)
    q = ops.rmsnorm(q, W(f"{p}q_norm.weight"), a.rms_norm_eps)
    k = ops.rmsnorm(k, W(f"{p}k_norm.weight"), a.rms_norm_eps)
    if batch.mrope is None:
        pos = ops.positions(batch.pos, T)
        q = ops.reshape(ops.rope(q, pos, at.rotary_dim, at.rope_theta), B, T, at.num_heads, D)
        k = ops.reshape(ops.rope(k, pos, at.rotary_dim, at.rope_theta), B, T, at.num_kv_heads, D)
    else:                 # interleaved 3-axis positions; the cache positions stay `batch.pos`
        section = spec.vision.mrope_section
        q = ops.reshape(ops.mrope(q, batch.mrope, at.rotary_dim, at.rope_theta, section), B, T, at.num_heads, D)
        k = ops.reshape(ops.mrope(k, batch.mrope, at.rotary_dim, at.rope_theta, section), B, T, at.num_kv_heads, D)
    scale = D ** -0.5
    if batch.state is None:
        o = ops.causal_attention(q, k, v, scale)
    else:
        cache = batch.kv(layer)
        ops.kv_append(k, v, batch.block_table, batch.pos, cache, batch.page_size)
        o = ops.paged_attention(q, batch.block_table, batch.pos, cache, batch.page_size, scale)
    o = ops.reshape(o, N, at.num_heads * D)
    if at.output_gate:
        o = ops.mul(o, ops.sigmoid(gate))
    return row_parallel(ops, spec, ops.linear(o, W(f"{p}o_proj.weight")))


def decoder_layer(ops: Ops, spec: ModelSpec, W, p: str, kind: str, x, batch: Batch, layer):
    eps = spec.model.rms_norm_eps
    h = ops.rmsnorm(x, W(f"{p}input_layernorm.weight"), eps)
    if kind == "linear_attention":
        mixed = gdn_mixer(ops, spec, W, f"{p}linear_attn.", h, batch, layer)
    else:
        mixed = attention_mixer(ops, spec, W, f"{p}self_attn.", h, batch, layer)
    x = ops.add(x, mixed)
    h = ops.rmsnorm(x, W(f"{p}post_attention_layernorm.weight"), eps)
    gate = ops.silu(ops.linear(h, W(f"{p}mlp.gate_proj.weight")))
    up = ops.linear(h, W(f"{p}mlp.up_proj.weight"))
    return ops.add(x, row_parallel(ops, spec, ops.linear(ops.mul(gate, up), W(f"{p}mlp.down_proj.weight"))))


def lm_head_name(spec: ModelSpec) -> str:
    return "embed_tokens.weight" if spec.model.tie_word_embeddings else "lm_head.weight"


def forward(ops: Ops, spec: ModelSpec, W, tokens, batch: Batch, last_logits: bool = False, images=None):
    """Main model over tokens [B, T] → (logits [N, vocab], final-norm hidden [N, hidden]).
    `last_logits` (one-row prefill for serving): logits of the last token only, [1, vocab]. `images`: image
    tokens [M, hidden] (the vision encoder's) for the image placeholders among the tokens, in order."""
    a = spec.model
    N = batch.B * batch.T
    ids = ops.reshape(tokens, N)
    x = ops.embed(ids, W("embed_tokens.weight"))
    if images is not None:
        x = ops.embed_images(x, ids, images, spec.vision.image_token_id)
    for i, kind in enumerate(a.layers.kinds):
        x = decoder_layer(ops, spec, W, f"layers.{i}.", kind, x, batch, i)
    y = ops.rmsnorm(x, W("norm.weight"), a.rms_norm_eps)
    head_in = ops.slice(y, 0, N - 1, N) if last_logits else y
    return vocab_parallel(ops, spec, ops.linear(head_in, W(lm_head_name(spec)))), y


def mtp_forward(ops: Ops, spec: ModelSpec, W, hidden, next_tokens, batch: Batch, last_logits: bool = False,
                head: str | None = None):
    """MTP head: slot i takes final-norm hidden y_i and token x_{i+1} at RoPE position i and
    predicts x_{i+2} → (logits [N, vocab], normed MTP output [N, hidden] for chained drafts).
    `last_logits`: over a prompt the MTP pass only fills its KV cache; the last slot drafts. `head`: the
    vocabulary projection's weight (default the LM head; a reduced draft head gives logits over its rows)."""
    eps = spec.model.rms_norm_eps
    e = ops.embed(ops.reshape(next_tokens, batch.B * batch.T), W("embed_tokens.weight"))
    e = ops.rmsnorm(e, W("mtp.pre_fc_norm_embedding.weight"), eps)
    n = ops.rmsnorm(hidden, W("mtp.pre_fc_norm_hidden.weight"), eps)
    u = ops.linear(ops.concat([e, n], axis=1), W("mtp.fc.weight"))
    u = decoder_layer(ops, spec, W, "mtp.layers.0.", "full_attention", u, batch, "mtp")
    y = ops.rmsnorm(u, W("mtp.norm.weight"), eps)
    N = batch.B * batch.T
    head_in = ops.slice(y, 0, N - 1, N) if last_logits else y
    logits = ops.linear(head_in, W(head or lm_head_name(spec)))
    return (logits if head else vocab_parallel(ops, spec, logits)), y     # a draft head is whole on every rank


def commit(ops: Ops, spec: ModelSpec, batch: Batch, counts) -> None:
    """ReplaySSM fold (REPLAYSSM.md): each GDN layer replays the first `counts[r]` tokens a verify step
    logged for row r into the row's state and conv history (0: nothing). Snapshot mode: the state takes
    the verify's snapshot after token counts[r] instead (the conv history is folded either way)."""
    for i, kind in enumerate(spec.model.layers.kinds):
        if kind == "linear_attention":
            rec = batch.records
            ops.gdn_conv_fold(batch.state(f"gdn.{i}.conv"), batch.slots, rec(f"rec.{i}.conv"), counts)
            if batch.snapshots:
                ops.gdn_snapshot_restore(batch.state(f"gdn.{i}.state"), batch.slots, rec(f"snap.{i}"), counts)
                continue
            ops.gdn_fold(batch.state(f"gdn.{i}.state"), batch.slots, rec(f"rec.{i}.k"), rec(f"rec.{i}.v"),
                         rec(f"rec.{i}.g"), counts)


def reference_forward(spec: ModelSpec, params: dict, tokens, with_mtp: bool = True) -> dict:
    """Eager, stateless, differentiable forward of fresh sequences tokens [B, T] (LongTensor) at
    positions 0..T−1: `logits` [B,T,V], `hidden` [B,T,H] and `mtp_logits` [B,T−1,V] (row i predicts
    token i+2 from hidden i and the true token i+1)."""
    import torch

    B, T = tokens.shape
    dtype = "bf16" if next(iter(params.values())).dtype == torch.bfloat16 else "f32"
    ops = EagerOps(dtype)
    W = params.__getitem__
    ids = tokens.to(torch.int32)
    pos = torch.zeros(B, dtype=torch.int32, device=tokens.device)
    logits, y = forward(ops, spec, W, ids, Batch(B, T, pos))
    out = {"logits": logits.reshape(B, T, -1), "hidden": y.reshape(B, T, -1)}
    if with_mtp and spec.model.mtp.num_layers and T > 1:
        h = y.reshape(B, T, -1)[:, :-1].reshape(B * (T - 1), -1)
        mtp_logits, _ = mtp_forward(ops, spec, W, h, ids[:, 1:], Batch(B, T - 1, pos))
        out["mtp_logits"] = mtp_logits.reshape(B, T - 1, -1)
    return out
