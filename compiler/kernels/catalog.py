"""catalog: every kernel key a model spec needs: decode/verify buckets (B rows × T tokens, M = B·T) and
one prefill chunk.

A stand-in for the lead's Graph → Plan lowering, which will emit keys from the traced graph: until
then this list drives `build_kernels` in tests and the kernel lab.
"""
from __future__ import annotations

from dataclasses import replace

from ..targets import Target
from . import (argmax, attn_combine, attn_decode, attn_prefill, embed, gated_rmsnorm, gdn_chunk, gdn_conv, gdn_step,
               gemm, gemm_wg, gemv, qk_rope_kv, rmsnorm, xperm)


def matmul_key(fmt: str, n: int, k: int, m: int, target: Target, epilogue: str = "none", out_dtype: str = "bf16"):
    """The matrix multiply for M rows: the skinny gemv up to 32 rows (decode, verify, cohorts), above it
    the prefill GEMM — on Hopper warpgroup MMA where the arch and format allow (gemm_wg), else mma.sync."""
    if m <= 32:
        return gemv.make_key(fmt, n, k, m, target, epilogue, out_dtype)
    make = gemm_wg.make_key if gemm_wg.eligible(fmt, n, k, m, target) else gemm.make_key
    return make(fmt, n, k, m, target, epilogue, out_dtype)


def matmul_calls(fmt: str, n: int, k: int, m: int, target: Target, epilogue: str = "none",
                 out_dtype: str = "bf16") -> list:
    """The kernels of one matrix multiply: matmul_key's, after an xperm of the activations for gemm_wg."""
    key = matmul_key(fmt, n, k, m, target, epilogue, out_dtype)
    return [xperm.make_key(m, k, target), key] if key.family == "gemm_wg" else [key]


def buckets(cohorts, draft: int) -> list[tuple[int, int]]:
    """(B, T) pairs: plain decode T = 1 and verify T = draft + 1, for every cohort size."""
    ts = sorted({1, draft + 1}) if draft else [1]
    return [(b, t) for b in sorted(set(cohorts)) for t in ts if b * t <= 32]


def gemv_shapes(spec) -> list[tuple[str, int, int, str, str]]:
    """(fmt, n, k, epilogue, out_dtype) of every matrix a decode/verify step multiplies."""
    a, q = spec.model, spec.quantization
    g, at, h, f = a.linear_attention, a.attention, a.hidden_size, a.intermediate_size
    attn_in = at.num_heads * at.head_dim

    def attention(fmt_q, fmt_k, fmt_v, fmt_o):
        return [(fmt_q, 2 * attn_in if at.output_gate else attn_in, h, "none", "bf16"),
                (fmt_k, at.num_kv_heads * at.head_dim, h, "none", "bf16"),
                (fmt_v, at.num_kv_heads * at.head_dim, h, "none", "bf16"),
                (fmt_o, h, attn_in, "residual", "bf16")]

    def mlp(fmt_gu, fmt_d):
        return [(fmt_gu, 2 * f, h, "silu_mul", "bf16"), (fmt_d, h, f, "residual", "bf16")]

    shapes = [(q.gdn_qkv, g.conv_dim, h, "none", "bf16"), (q.gdn_z, g.value_dim, h, "none", "bf16"),
              (q.gdn_ab, 2 * g.num_value_heads, h, "none", "f32"), (q.gdn_out, h, g.value_dim, "residual", "bf16")]
    shapes += attention(q.attn_q, q.attn_k, q.attn_v, q.attn_o) + mlp(q.mlp_gate_up, q.mlp_down)
    shapes.append((q.embed if a.tie_word_embeddings else q.lm_head, a.vocab_size, h, "none", "f32"))
    if a.mtp.num_layers:
        shapes.append((q.mtp, h, 2 * h, "none", "bf16"))
        shapes += attention(q.mtp, q.mtp, q.mtp, q.mtp) + mlp(q.mtp, q.mtp)
    return list(dict.fromkeys(shapes))


def _row_keys(spec, m: int, target: Target) -> list:
    a, eps, arch = spec.model, spec.model.rms_norm_eps, target.arch
    g = a.linear_attention
    keys = [gemv.make_key(fmt, n, k, m, target, epi, out) for fmt, n, k, epi, out in gemv_shapes(spec)]
    keys += _folded_norm_keys(spec, keys)
    keys += [rmsnorm.Key(a.hidden_size, m, add, "bf16", eps, arch) for add in (False, True)]
    keys += [embed.Key(spec.quantization.embed, a.hidden_size, m, arch),
             gated_rmsnorm.Key(g.num_value_heads, g.value_head_dim, m, eps, arch),
             argmax.Key(a.vocab_size, m, arch)]
    return keys


def _folded_norm_keys(spec, keys) -> list:
    """The split-RMSNorm variants of a decode step's GEMVs (passes.fold_norms_into_projections): the
    residual projections with `norm_out`, the hidden-size readers with `scale_in` (not the vocabulary
    head, which reads the final norm, nor the MTP's input projection, which reads a concat)."""
    from ..passes import norm_fold_enabled
    if not norm_fold_enabled():
        return []
    a = spec.model

    def reads_a_norm(k) -> bool:                   # a hidden-size input that is not the vocabulary head's
        return k.k == a.hidden_size and not (k.n == a.vocab_size and k.out_dtype == "f32")
    gemvs = [k for k in keys if k.family == "gemv"]
    return [replace(k, norm_out=True) for k in gemvs if k.epilogue == "residual"] + \
        [replace(k, scale_in=True, eps=a.rms_norm_eps) for k in gemvs if k.epilogue != "residual" and reads_a_norm(k)]


def _bucket_keys(spec, b: int, t: int, target: Target) -> list:
    a, arch = spec.model, target.arch
    g, at, rt = a.linear_attention, a.attention, spec.runtime
    max_pages = -(-rt.max_context // rt.page_size)
    conv_mode = "update" if t == 1 else "record"
    keys = [gdn_conv.Key(g.conv_dim, b, t, g.conv_kernel, conv_mode, arch),
            gdn_step.make_key(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, b, t,
                              "step" if t == 1 else "record", target),
            qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, b, t, rt.kv_dtype,
                           rt.page_size, max_pages, a.rms_norm_eps, arch)]
    if t > 1:   # ReplaySSM: an eager fold after the round, or the fold fused into the next verify
        for mode in ("fold", "commit_record"):
            keys += [gdn_conv.Key(g.conv_dim, b, t, g.conv_kernel, mode, arch),
                     gdn_step.make_key(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, b, t,
                                       mode, target)]
    if t == 1:  # the qkv projection carrying the conv (passes.fold_conv_into_projection), plain and scaled
        keys += _conv_qkv_keys(spec, b, target)
    dec = attn_decode.make_key(at.num_heads, at.num_kv_heads, at.head_dim, b, t, rt.kv_dtype, max_pages, target,
                               at.output_gate, rt.page_size)
    return keys + [dec] + ([attn_combine.for_decode(dec)] if dec.splits > 1 else [])


def _conv_qkv_keys(spec, m: int, target: Target) -> list:
    """The GDN qkv projection of a one-token step with the conv in its epilogue: reading the normed
    input (layer 0) and, with the norm fold, reading xn (every other layer)."""
    from ..passes import conv_fold_enabled, norm_fold_enabled
    if not conv_fold_enabled():
        return []
    a, g = spec.model, spec.model.linear_attention
    key = replace(gemv.make_key(spec.quantization.gdn_qkv, g.conv_dim, a.hidden_size, m, target), conv=g.conv_kernel)
    return [key] + ([replace(key, scale_in=True, eps=a.rms_norm_eps)] if norm_fold_enabled() else [])


def prefill_gdn_key(hk, hv, dk, dv, t: int, target: Target):
    """The GDN recurrence of a prefill chunk of t tokens: chunked from 64 tokens, else sequential."""
    if t >= 64 and t % 16 == 0:
        return gdn_chunk.make_key(hk, hv, dk, dv, t, target)
    return gdn_step.make_key(hk, hv, dk, dv, 1, t, "step", target)


def prefill_keys(spec, target: Target) -> list:
    """Keys of one prefill chunk (M = chunk tokens of one sequence): the prefill GEMMs (the vocab
    projection only runs at M = 1), norms, GDN conv and the chunked (WY) GDN recurrence over the whole
    chunk (gdn_chunk; the sequential gdn_step below 64 tokens), RoPE + KV append and the flash-style
    prefill attention."""
    a, rt, arch = spec.model, spec.runtime, target.arch
    g, at, chunk = a.linear_attention, a.attention, rt.prefill_chunk
    max_pages = -(-rt.max_context // rt.page_size)
    keys = list(dict.fromkeys(key for fmt, n, k, epi, out in gemv_shapes(spec) if n != a.vocab_size
                              for key in matmul_calls(fmt, n, k, chunk, target, epi, out)))
    keys += [rmsnorm.Key(a.hidden_size, chunk, add, "bf16", a.rms_norm_eps, arch) for add in (False, True)]
    keys += [embed.Key(spec.quantization.embed, a.hidden_size, chunk, arch),
             gated_rmsnorm.Key(g.num_value_heads, g.value_head_dim, chunk, a.rms_norm_eps, arch),
             gdn_conv.Key(g.conv_dim, 1, chunk, g.conv_kernel, "update", arch),
             prefill_gdn_key(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, chunk, target),
             qk_rope_kv.Key(at.num_heads, at.num_kv_heads, at.head_dim, at.rotary_dim, 1, chunk, rt.kv_dtype,
                            rt.page_size, max_pages, a.rms_norm_eps, arch)]
    keys.append(attn_prefill.make_key(at.num_heads, at.num_kv_heads, at.head_dim, chunk, rt.kv_dtype, max_pages,
                                      target, at.output_gate, rt.page_size))
    return keys


def spec_keys(spec, target: Target, cohorts=None, draft: int | None = None) -> list:
    """Every kernel key of `spec` for `target`: decode/verify buckets (defaults: the spec's runtime
    profile) and the prefill GEMMs."""
    rt = spec.runtime
    pairs = buckets(cohorts or rt.cohorts, rt.draft_tokens if draft is None else draft)
    keys = []
    for m in sorted({b * t for b, t in pairs}):
        keys += _row_keys(spec, m, target)
    for b, t in pairs:
        keys += _bucket_keys(spec, b, t, target)
    return list(dict.fromkeys(keys + prefill_keys(spec, target)))
