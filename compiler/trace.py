"""trace: traces the model program per entry point and static shape into a typechecked Graph.

Entry points (DESIGN.md §2): `prefill` (one sequence, a T-token chunk at any position), `step`
(B rows × T tokens: decode T=1), `verify` (a step of T = K+1 tokens whose GDN layers read the committed
state and log ReplaySSM records instead of writing it), `commit` (folds the first `commit[r]` logged
tokens of each row into its state) and `mtp` (B × T through the MTP head). Everything that changes per
call — token ids, positions, block tables, slot ids, commit counts — is a graph input, never a constant.
`trace_vision`: the vision encoder over a bucket of patches and images (compiler.vision_model).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import model, vision_model
from .ir import Graph
from .ops import TraceOps
from .spec import DRAFT_HEAD, ModelSpec, draft_head_info, tensor_table, vision_tensor_table
from .typecheck import typecheck

ENTRIES = ("prefill", "step", "verify", "commit", "mtp")
_ACT_DTYPE_OF_FORMAT = {"bf16": "bf16", "fp32": "f32"}


@dataclass(frozen=True)
class StatePools:
    """Sizes of the state the graph addresses: KV pages and GDN state slots."""
    num_pages: int
    num_slots: int
    pages_per_seq: int
    page_size: int = 64
    kv_dtype: str = "int8"     # "int8" (codes + fp16 scales) or an activation dtype "bf16" / "f32"

    def __post_init__(self):
        assert self.kv_dtype in ("int8", "bf16", "f32"), self.kv_dtype


def state_avals(spec: ModelSpec, pools: StatePools) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, dtype) of every state tensor: paged KV per attention layer (and the MTP layer),
    fp32 recurrent state and conv history per GDN layer."""
    a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
    out = {}
    kv_shape = (pools.num_pages, 2, at.num_kv_heads, pools.page_size, at.head_dim)
    attn_layers = [str(i) for i, k in enumerate(a.layers.kinds) if k == "full_attention"]
    if a.mtp.num_layers:
        attn_layers.append("mtp")
    for name in attn_layers:
        if pools.kv_dtype == "int8":
            out[f"kv.{name}.codes"] = (kv_shape, "i8")
            out[f"kv.{name}.scales"] = ((*kv_shape[:-1], at.head_dim // 64), "f16")
        else:
            out[f"kv.{name}.values"] = (kv_shape, pools.kv_dtype)
    for i, kind in enumerate(a.layers.kinds):
        if kind == "linear_attention":
            out[f"gdn.{i}.state"] = ((pools.num_slots, g.num_value_heads, g.key_head_dim, g.value_head_dim), "f32")
            out[f"gdn.{i}.conv"] = ((pools.num_slots, g.conv_dim, g.conv_kernel - 1), "f32")
    return out


RECORD_SETS = ("rec", "rec1")     # the ReplaySSM record sets: rounds that fold inside the next verify use both in turn


def record_avals(spec: ModelSpec, batch: int, tokens: int, act_dtype: str,
                 snapshots: bool = False, prefix: str = "rec") -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, dtype) of the ReplaySSM records of a verify step of `batch` rows × `tokens`, per
    GDN layer: pre-conv columns, raw k, v (activation dtype) and (g, beta) fp32 (REPLAYSSM.md); with
    `snapshots`, the columns and the state after each token (fp32 [rows, tokens, Hv, Dk, Dv]). `prefix`: the
    record set (RECORD_SETS)."""
    g = spec.model.linear_attention
    out = {}
    for i, kind in enumerate(spec.model.layers.kinds):
        if kind == "linear_attention":
            out[f"{prefix}.{i}.conv"] = ((batch, tokens, g.conv_dim), act_dtype)
            if snapshots:
                out[f"snap.{i}"] = ((batch, tokens, g.num_value_heads, g.key_head_dim, g.value_head_dim), "f32")
                continue
            out[f"{prefix}.{i}.k"] = ((batch, tokens, g.num_key_heads, g.key_head_dim), act_dtype)
            out[f"{prefix}.{i}.v"] = ((batch, tokens, g.num_value_heads, g.value_head_dim), act_dtype)
            out[f"{prefix}.{i}.g"] = ((batch, tokens, g.num_value_heads, 2), "f32")
    return out


def _weight_dtype(spec: ModelSpec, info) -> str:
    fmt = getattr(spec.quantization, info.role)
    return _ACT_DTYPE_OF_FORMAT.get(fmt, "bf16")  # quantised matrices present as bf16 to the IR


def trace(spec: ModelSpec, entry: str, batch: int, tokens: int, pools: StatePools,
          act_dtype: str = "f32", last_logits: bool = False, draft_rows: int = 0, snapshots: bool = False,
          mrope: bool = False, image_tokens: int = 0, records: str = "rec", fold_from: str | None = None) -> Graph:
    """Trace one entry point at one static shape. Quantised weights appear as their dequantised
    dtype; the weight format is a property of the binding. `last_logits` (one-sequence chunks): the
    vocab projection runs for the chunk's last token alone, as serving needs. `draft_rows` (mtp): the head
    is the reduced draft head of that many rows (spec.DRAFT_HEAD), so the logits are over the draft ids.
    `snapshots` (verify, commit): the snapshot design instead of ReplaySSM's records (reference_replayssm).
    `mrope` (prefill, step, verify, mtp of a spec with a vision section; a sequence with images): input `mrope`
    i32[B·T, 3], the tokens' RoPE positions (compiler.multimodal), which differ from their cache positions `pos`
    after an image. `image_tokens` (with mrope): input `images` [image_tokens, hidden], the image tokens of the
    chunk's placeholders. Both off: the text-only graph. `records` (verify, commit): the record set it writes or
    folds (RECORD_SETS); `fold_from` (verify): first fold the first `commit[r]` records of that set into each row's
    state (input `commit` i32[batch]) — the previous round's, so a round needs no commit entry of its own."""
    if entry not in ENTRIES:
        raise ValueError(f"unknown entry point {entry!r} (expected one of {', '.join(ENTRIES)})")
    if entry == "prefill" and batch != 1:
        raise ValueError("prefill traces one sequence: batch must be 1")
    if last_logits and batch != 1:
        raise ValueError("last_logits applies to one-sequence chunks (batch 1) only")
    if mrope and (spec.vision is None or entry not in ("prefill", "step", "verify", "mtp")):
        raise ValueError("mrope needs a spec with a vision section and a prefill, step, verify or mtp entry")
    if image_tokens and entry not in ("prefill", "step"):
        raise ValueError("image_tokens: images enter the model in a prompt's pieces only (prefill, step)")
    if image_tokens and not mrope:
        raise ValueError("image_tokens needs mrope: a chunk with images has 3-axis positions")
    if records not in RECORD_SETS or (fold_from is not None and (fold_from not in RECORD_SETS or fold_from == records)):
        raise ValueError(f"record sets: write one of {RECORD_SETS} and fold the other, got {records!r}, {fold_from!r}")
    if (records != "rec" and entry not in ("verify", "commit")) or (fold_from and (entry != "verify" or snapshots)):
        raise ValueError(f"record set {records!r}, folding {fold_from!r}: only a verify or a commit uses the second "
                         "record set, and only a ReplaySSM verify folds the other set first")
    ops = TraceOps(act_dtype)
    table = {t.name: t for t in tensor_table(spec)}
    if draft_rows:
        table[DRAFT_HEAD] = draft_head_info(spec, draft_rows)
    weights, state = {}, {}
    svals = state_avals(spec, pools) | (record_avals(spec, batch, tokens, act_dtype, snapshots, records)
                                        if entry in ("verify", "commit") else {})
    if fold_from:
        svals |= record_avals(spec, batch, tokens, act_dtype, False, fold_from)

    def W(name):
        if name not in weights:
            info = table[name]
            weights[name] = ops.new_var(info.shape, "f32" if act_dtype == "f32" else _weight_dtype(spec, info))
        return weights[name]

    def S(name):
        if name not in state:
            shape, dtype = svals[name]
            state[name] = ops.new_var(shape, dtype)
        return state[name]

    inputs = {"tokens": ops.new_var((batch, tokens), "i32"), "pos": ops.new_var((batch,), "i32"),
              "block_table": ops.new_var((batch, pools.pages_per_seq), "i32")}
    b = model.Batch(batch, tokens, inputs["pos"], inputs["block_table"], None, S, pools.page_size,
                    pools.kv_dtype == "int8")

    def record_set(prefix: str):             # the model names records `rec.<layer>.<part>`: the set's own names
        return lambda name: S(prefix + name[3:] if name.startswith("rec.") else name)

    if entry in ("verify", "commit"):
        b.records = record_set(records)
        b.snapshots = snapshots
    outputs = {}
    if entry == "mtp":
        inputs["hidden"] = ops.new_var((batch * tokens, spec.model.hidden_size), act_dtype)
        if mrope:                      # slot i's RoPE position: its token's (three axes after an image)
            b.mrope = inputs["mrope"] = ops.new_var((batch * tokens, 3), "i32")
        outputs["logits"], outputs["hidden"] = model.mtp_forward(ops, spec, W, inputs["hidden"], inputs["tokens"], b,
                                                                 last_logits, DRAFT_HEAD if draft_rows else None)
    elif entry == "commit":
        inputs = {"slots": ops.new_var((batch,), "i32"), "commit": ops.new_var((batch,), "i32")}
        b.slots = inputs["slots"]
        model.commit(ops, spec, b, inputs["commit"])
    else:
        inputs["slots"] = b.slots = ops.new_var((batch,), "i32")
        if fold_from:
            inputs["commit"] = ops.new_var((batch,), "i32")
            b.fold = (record_set(fold_from), inputs["commit"])
        images = None
        if mrope:
            b.mrope = inputs["mrope"] = ops.new_var((batch * tokens, 3), "i32")
        if image_tokens:
            images = inputs["images"] = ops.new_var((image_tokens, spec.model.hidden_size), act_dtype)
        outputs["logits"], outputs["hidden"] = model.forward(ops, spec, W, inputs["tokens"], b, last_logits, images)
    params = {"entry": entry, "batch": batch, "tokens": tokens, "act": act_dtype, "kv": pools.kv_dtype,
              "page_size": pools.page_size}
    if last_logits:
        params["logits"] = "last"
    if draft_rows:
        params["draft_rows"] = draft_rows
    if mrope:
        params["rope"] = "mrope"
    if image_tokens:
        params["images"] = image_tokens
    if snapshots and entry in ("verify", "commit"):
        params["state"] = "snapshots"
    if records != "rec":
        params["records"] = records
    if fold_from:
        params["fold"] = fold_from
    g = Graph(f"{spec.name}.{entry}", inputs, weights, dict(sorted(state.items())), ops.eqns, outputs, params)
    typecheck(g)
    return g


def trace_vision(spec: ModelSpec, patches: int, images: int, act_dtype: str = "f32") -> Graph:
    """Trace the vision encoder for `patches` patch rows of up to `images` images: inputs pixels
    [patches, C·T·P·P], coords i32[patches, 4] and cu_seqlens i32[images + 1] (vision_model.encoder_inputs);
    output `embeds` [patches / merge², out_hidden_size]. The tower's weights are float (QuantRecipe.vision)."""
    v = spec.vision
    if v is None:
        raise ValueError(f"spec {spec.name!r} has no vision section")
    if patches <= 0 or patches % v.merge_unit or images <= 0:
        raise ValueError(f"vision bucket: patches must be a positive multiple of {v.merge_unit} and images "
                         f"positive, got {patches} patches, {images} images")
    ops = TraceOps(act_dtype)
    table = {t.name: t for t in vision_tensor_table(spec)}
    wdtype = "f32" if act_dtype == "f32" else _ACT_DTYPE_OF_FORMAT[spec.quantization.vision]
    weights = {}

    def W(name):
        if name not in weights:
            weights[name] = ops.new_var(table[name].shape, wdtype)
        return weights[name]

    inputs = {"pixels": ops.new_var((patches, v.patch_dim), act_dtype), "coords": ops.new_var((patches, 4), "i32"),
              "cu_seqlens": ops.new_var((images + 1,), "i32")}
    embeds = vision_model.vision_forward(ops, spec, W, inputs["pixels"], inputs["coords"], inputs["cu_seqlens"])
    params = {"entry": "vision", "patches": patches, "images": images, "act": act_dtype}
    g = Graph(f"{spec.name}.vision", inputs, weights, {}, ops.eqns, {"embeds": embeds}, params)
    typecheck(g)
    return g
