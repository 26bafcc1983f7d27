"""spec: the model spec as frozen dataclasses — architecture, quantisation recipe, checkpoint names,
runtime profile — loaded strictly from YAML (compiler.spec_hf derives one from an HF `config.json`).

Owns every derived size (parameters, bytes per forward, state and KV bytes). Never touches weights. The optional
`vision` section (compiler.spec_vision) describes the vision tower; its tensors are listed apart
(`vision_tensor_table`), so a text-only spec, its tensor table and its plans are what they were without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml

from .schema import SpecError, build, require
from .spec_vision import VisionSpec

LayerKind = Literal["linear_attention", "full_attention"]
# q4_k / q5_k / q6_k: llama.cpp's k-quants as a GGUF file stores them (compiler.kquant); no quantiser.
WeightFormat = Literal["q4g64", "q5g64", "q6g64", "w8g32", "q4_k", "q5_k", "q6_k", "bf16", "fp32"]
FLOAT_FORMATS = ("bf16", "fp32")


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    output_gate: bool = True

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            require(getattr(self, name) > 0, name, "expected a positive integer")
        require(self.num_heads % self.num_kv_heads == 0, "num_heads",
                f"expected a multiple of num_kv_heads ({self.num_kv_heads}), got {self.num_heads}")
        require(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor", "expected a number in (0, 1]")
        require(self.rotary_dim % 2 == 0 and self.rotary_dim * 1.0 == self.head_dim * self.partial_rotary_factor,
                "partial_rotary_factor", f"head_dim × factor must be an even integer, got {self.head_dim} × "
                f"{self.partial_rotary_factor}")
        require(self.rope_theta > 1, "rope_theta", "expected a number > 1")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet: value head h uses query/key head h // (num_value_heads // num_key_heads).

    `out_head_order` is the order of the value heads along out_proj's input columns: `grouped` (HF, the
    heads' own order) or `tiled` (llama.cpp's GGUF files: head j·num_key_heads + kh is grouped head
    kh·group + j). A k-quant super-block (256 columns) spans several heads, so such a file's columns
    cannot be put back in place: the model permutes its activations instead (compiler.model)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    out_head_order: Literal["grouped", "tiled"] = "grouped"

    def __post_init__(self):
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            require(getattr(self, name) > 0, name, "expected a positive integer")
        require(self.num_value_heads % self.num_key_heads == 0, "num_value_heads",
                f"expected a multiple of num_key_heads ({self.num_key_heads}), got {self.num_value_heads}")
        require(self.conv_kernel >= 2, "conv_kernel", "expected an integer ≥ 2")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:
        return self.num_value_heads // self.num_key_heads


@dataclass(frozen=True)
class LayersSpec:
    """Either `pattern` (repeated to `count`) or an explicit `types` list of exactly `count` entries."""
    count: int
    pattern: tuple[LayerKind, ...] | None = None
    types: tuple[LayerKind, ...] | None = None

    def __post_init__(self):
        require(self.count > 0, "count", "expected a positive integer")
        require((self.pattern is None) != (self.types is None), "pattern",
                "give exactly one of `pattern` (repeated) or `types` (one entry per layer)")
        if self.pattern is not None:
            require(len(self.pattern) > 0 and self.count % len(self.pattern) == 0, "pattern",
                    f"pattern length {len(self.pattern)} must divide the layer count {self.count}")
        else:
            require(len(self.types) == self.count, "types",
                    f"expected {self.count} entries (one per layer), got {len(self.types)}")

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        if self.types is not None:
            return self.types
        return self.pattern * (self.count // len(self.pattern))


@dataclass(frozen=True)
class MTPSpec:
    num_layers: int = 1

    def __post_init__(self):
        require(self.num_layers in (0, 1), "num_layers", f"expected 0 or 1, got {self.num_layers}")


@dataclass(frozen=True)
class ArchSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layers: LayersSpec
    attention: AttentionSpec
    linear_attention: LinearAttentionSpec
    mtp: MTPSpec = field(default_factory=MTPSpec)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings"):
            require(getattr(self, name) > 0, name, "expected a positive integer")
        require(0 < self.rms_norm_eps < 1, "rms_norm_eps", "expected a small positive number")


@dataclass(frozen=True)
class TensorFormat:
    """One tensor's format where it differs from its role's (a GGUF file mixes formats within a role)."""
    name: str
    format: WeightFormat


@dataclass(frozen=True)
class QuantRecipe:
    """Weight format per tensor role (MODEL.md §8), and per tensor in `tensors` where one differs from its
    role's (canonical names). Matrices may use any format; vectors stay float."""
    embed: WeightFormat = "w8g32"
    lm_head: WeightFormat = "w8g32"
    attn_q: WeightFormat = "q4g64"
    attn_k: WeightFormat = "q4g64"
    attn_v: WeightFormat = "q5g64"
    attn_o: WeightFormat = "q5g64"
    gdn_qkv: WeightFormat = "q4g64"
    gdn_z: WeightFormat = "q5g64"
    gdn_ab: WeightFormat = "bf16"
    gdn_out: WeightFormat = "q5g64"
    mlp_gate_up: WeightFormat = "q4g64"
    mlp_down: WeightFormat = "q5g64"
    mtp: WeightFormat = "w8g32"
    norm: WeightFormat = "bf16"
    conv: WeightFormat = "bf16"
    gdn_decay: WeightFormat = "fp32"
    vision: WeightFormat = "bf16"          # the whole vision tower (spec.vision_tensor_table): never quantised
    tensors: tuple[TensorFormat, ...] = ()

    def __post_init__(self):
        for name in ("norm", "conv", "gdn_decay"):
            require(getattr(self, name) in FLOAT_FORMATS, name, "expected bf16 or fp32 (vectors stay float)")
        require(self.vision in FLOAT_FORMATS, "vision", "expected bf16 or fp32 (the vision tower stays float)")
        names = [t.name for t in self.tensors]
        dup = sorted({n for n in names if names.count(n) > 1})
        require(not dup, "tensors", f"each tensor may be listed once, {', '.join(dup)} is listed more often")

    @cached_property
    def by_tensor(self) -> dict[str, str]:
        return {t.name: t.format for t in self.tensors}


@dataclass(frozen=True)
class CheckpointSpec:
    prefixes: tuple[str, ...] = ("model.language_model.", "model.")
    ignore_prefixes: tuple[str, ...] = ("model.visual.",)


@dataclass(frozen=True)
class RuntimeProfile:
    target: str = "rtx3090"
    cohorts: tuple[int, ...] = (1, 2, 4, 8)
    draft_tokens: int = 3
    max_context: int = 32768
    kv_dtype: Literal["int8", "bf16"] = "int8"
    page_size: int = 64
    prefill_chunk: int = 1024
    vram_budget_gib: float = 24.0

    def __post_init__(self):
        require(len(self.cohorts) > 0 and all(0 < c <= 32 for c in self.cohorts), "cohorts",
                "expected a list of cohort sizes in 1..32")
        require(0 <= self.draft_tokens <= 8, "draft_tokens", "expected an integer in 0..8")
        require(self.page_size > 0 and self.page_size % 64 == 0, "page_size", "expected a multiple of 64")
        require(self.max_context > 0, "max_context", "expected a positive integer")
        require(self.prefill_chunk > 0, "prefill_chunk", "expected a positive integer")


@dataclass(frozen=True)
class ParallelSpec:
    """Tensor parallelism: `tp` ranks share every layer. A spec with tp > 1 is ONE rank's (compiler.shard
    makes it): its head counts and MLP width are the rank's share, its LM head holds vocab_size / tp rows,
    and the model program all-reduces after each row-parallel projection and gathers the logits."""
    tp: int = 1

    def __post_init__(self):
        require(self.tp >= 1, "tp", f"expected a positive integer, got {self.tp}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model: ArchSpec
    quantization: QuantRecipe = field(default_factory=QuantRecipe)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    runtime: RuntimeProfile = field(default_factory=RuntimeProfile)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    vision: VisionSpec | None = None          # the vision tower and image tokens; None: a text-only model

    @property
    def arch(self) -> ArchSpec:
        return self.model

    def __post_init__(self):
        a = self.model
        require(self.runtime.max_context <= a.max_position_embeddings, "runtime.max_context",
                f"must not exceed model.max_position_embeddings ({a.max_position_embeddings})")
        if self.vision is not None:
            _check_vision(self)


def _check_vision(spec: "ModelSpec") -> None:
    """The vision section against the text model it feeds."""
    v, a = spec.vision, spec.model
    require(v.out_hidden_size == a.hidden_size, "vision.out_hidden_size",
            f"must equal model.hidden_size ({a.hidden_size}): merged image tokens replace token embeddings")
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        require(getattr(v, name) < a.vocab_size, f"vision.{name}",
                f"must be a token id below model.vocab_size ({a.vocab_size}), got {getattr(v, name)}")
    half = a.attention.rotary_dim // 2
    require(sum(v.mrope_section) == half, "vision.mrope_section",
            f"must split the {half} RoPE frequencies (rotary dims / 2), got {list(v.mrope_section)} "
            f"(sum {sum(v.mrope_section)})")


def load_spec(path: str | Path) -> ModelSpec:
    """Load and validate a YAML spec; every problem is a SpecError naming the key path."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("", f"spec file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError("", f"{path} is not valid YAML: {err}") from None
    return spec_from_dict(data)


def spec_from_dict(data: dict) -> ModelSpec:
    return build(ModelSpec, data)


# ---------------------------------------------------------------- derived sizes

@dataclass(frozen=True)
class TensorInfo:
    name: str          # canonical checkpoint name without the model prefix, e.g. "layers.0.mlp.up_proj.weight"
    shape: tuple[int, ...]
    role: str          # a QuantRecipe field

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _attention_tensors(a: ArchSpec, p: str) -> list[TensorInfo]:
    at, h = a.attention, a.hidden_size
    q_rows = at.num_heads * at.head_dim * (2 if at.output_gate else 1)
    kv_rows = at.num_kv_heads * at.head_dim
    return [TensorInfo(f"{p}self_attn.q_proj.weight", (q_rows, h), "attn_q"),
            TensorInfo(f"{p}self_attn.k_proj.weight", (kv_rows, h), "attn_k"),
            TensorInfo(f"{p}self_attn.v_proj.weight", (kv_rows, h), "attn_v"),
            TensorInfo(f"{p}self_attn.o_proj.weight", (h, at.num_heads * at.head_dim), "attn_o"),
            TensorInfo(f"{p}self_attn.q_norm.weight", (at.head_dim,), "norm"),
            TensorInfo(f"{p}self_attn.k_norm.weight", (at.head_dim,), "norm")]


def _gdn_tensors(a: ArchSpec, p: str) -> list[TensorInfo]:
    g, h = a.linear_attention, a.hidden_size
    return [TensorInfo(f"{p}linear_attn.in_proj_qkv.weight", (g.conv_dim, h), "gdn_qkv"),
            TensorInfo(f"{p}linear_attn.in_proj_z.weight", (g.value_dim, h), "gdn_z"),
            TensorInfo(f"{p}linear_attn.in_proj_a.weight", (g.num_value_heads, h), "gdn_ab"),
            TensorInfo(f"{p}linear_attn.in_proj_b.weight", (g.num_value_heads, h), "gdn_ab"),
            TensorInfo(f"{p}linear_attn.conv1d.weight", (g.conv_dim, 1, g.conv_kernel), "conv"),
            TensorInfo(f"{p}linear_attn.A_log", (g.num_value_heads,), "gdn_decay"),
            TensorInfo(f"{p}linear_attn.dt_bias", (g.num_value_heads,), "gdn_decay"),
            TensorInfo(f"{p}linear_attn.norm.weight", (g.value_head_dim,), "norm"),
            TensorInfo(f"{p}linear_attn.out_proj.weight", (h, g.value_dim), "gdn_out")]


def _decoder_tensors(a: ArchSpec, p: str, kind: str) -> list[TensorInfo]:
    h, f = a.hidden_size, a.intermediate_size
    mixer = _attention_tensors(a, p) if kind == "full_attention" else _gdn_tensors(a, p)
    return [TensorInfo(f"{p}input_layernorm.weight", (h,), "norm"), *mixer,
            TensorInfo(f"{p}post_attention_layernorm.weight", (h,), "norm"),
            TensorInfo(f"{p}mlp.gate_proj.weight", (f, h), "mlp_gate_up"),
            TensorInfo(f"{p}mlp.up_proj.weight", (f, h), "mlp_gate_up"),
            TensorInfo(f"{p}mlp.down_proj.weight", (h, f), "mlp_down")]


DRAFT_HEAD = "mtp.draft_head.weight"      # the MTP's reduced-vocabulary head: LM head rows of the draft ids


def draft_head_info(spec: "ModelSpec", rows: int) -> "TensorInfo":
    """The reduced draft head [rows, hidden] (rows of the LM head, its format): not a checkpoint tensor;
    the runtime gathers it from the LM head for a draft vocabulary."""
    return TensorInfo(DRAFT_HEAD, (rows, spec.model.hidden_size), "lm_head")


def tensor_table(spec: ModelSpec) -> list[TensorInfo]:
    """Every checkpoint tensor the spec needs, in canonical names, with shape and quantisation role."""
    a = spec.model
    out = [TensorInfo("embed_tokens.weight", (a.vocab_size, a.hidden_size), "embed")]
    for i, kind in enumerate(a.layers.kinds):
        out += _decoder_tensors(a, f"layers.{i}.", kind)
    out.append(TensorInfo("norm.weight", (a.hidden_size,), "norm"))
    if not a.tie_word_embeddings:         # a rank of tensor parallelism holds its share of the rows
        out.append(TensorInfo("lm_head.weight", (a.vocab_size // spec.parallel.tp, a.hidden_size), "lm_head"))
    if a.mtp.num_layers:
        h = a.hidden_size
        out += [TensorInfo("mtp.pre_fc_norm_embedding.weight", (h,), "norm"),
                TensorInfo("mtp.pre_fc_norm_hidden.weight", (h,), "norm"),
                TensorInfo("mtp.fc.weight", (h, 2 * h), "mtp"),
                TensorInfo("mtp.norm.weight", (h,), "norm")]
        for t in _decoder_tensors(a, "mtp.layers.0.", "full_attention"):
            is_matrix = len(t.shape) == 2
            out.append(TensorInfo(t.name, t.shape, "mtp" if is_matrix else t.role))
    return out


def vision_tensor_table(spec: ModelSpec) -> list[TensorInfo]:
    """The vision tower's checkpoint tensors (canonical names `visual.*`, stored as `model.visual.*`), all of role
    `vision`; empty for a text-only spec. Not part of `tensor_table`: the text model's plans never bind them."""
    v = spec.vision
    if v is None:
        return []
    h, f, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit

    def linear(name, n, k):
        return [TensorInfo(f"visual.{name}.weight", (n, k), "vision"),
                TensorInfo(f"visual.{name}.bias", (n,), "vision")]

    def norm(name, n):
        return [TensorInfo(f"visual.{name}.weight", (n,), "vision"), TensorInfo(f"visual.{name}.bias", (n,), "vision")]

    patch = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    out = [TensorInfo("visual.patch_embed.proj.weight", patch, "vision"),
           TensorInfo("visual.patch_embed.proj.bias", (h,), "vision"),
           TensorInfo("visual.pos_embed.weight", (v.num_position_embeddings, h), "vision")]
    for i in range(v.depth):
        p = f"blocks.{i}."
        out += [*norm(p + "norm1", h), *linear(p + "attn.qkv", 3 * h, h), *linear(p + "attn.proj", h, h),
                *norm(p + "norm2", h), *linear(p + "mlp.linear_fc1", f, h), *linear(p + "mlp.linear_fc2", h, f)]
    return out + [*norm("merger.norm", h), *linear("merger.linear_fc1", m, m),
                  *linear("merger.linear_fc2", v.out_hidden_size, m)]


def format_of(spec: ModelSpec, info: TensorInfo) -> str:
    """A tensor's weight format: its own entry in the recipe's `tensors`, else its role's. The draft head
    (rows of the LM head) takes the LM head's."""
    q = spec.quantization
    name = info.name
    if name == DRAFT_HEAD:
        name = "embed_tokens.weight" if spec.model.tie_word_embeddings else "lm_head.weight"
    return q.by_tensor.get(name) or getattr(q, info.role)
