"""gguf_synth: the pieces of a llama.cpp-style qwen35 GGUF of any spec's shape — metadata keys, a tiny
byte-level BPE vocabulary, llama.cpp's Q4_K_M type mix, what its converter does to each float tensor, and
random k-quant / Q8_0 blocks with valid fp16 scales — shared by the test fixtures (tests/gguf_fixtures.py)
and the full-size writer (tools/synth_gguf.py). Writes no file itself, reads none, never touches a device
it is not handed.
"""
from __future__ import annotations

import functools
import math

import torch

from compiler.kquant import KFORMATS, QK_K, KQTensor, dequantize, random_kquant
from compiler.spec import ModelSpec

GGML = {"F32": 0, "F16": 1, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30, "Q4_0": 2}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
# The fp16 scale fields of a super-block (byte ranges): d and dmin of Q4_K / Q5_K, d of Q6_K.
SCALE_BYTES = {"Q4_K": ((0, 2), (2, 4)), "Q5_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),)}
Q8_0_CODE_STD = math.sqrt((255 ** 2 - 1) / 12)      # codes uniform over −127..127


def q4_k_m(name: str, shape: tuple[int, ...], layer: int | None, n_layers: int) -> str:
    """A Q4_K_M-style type per tensor (llama.cpp's mix: Q6_K output head, Q6_K attn_v / ffn_down in some
    layers, Q5_K GDN qkv, F32 vectors and conv)."""
    if len(shape) != 2:
        return "F32"
    more_bits = layer is not None and (layer < n_layers // 8 + 1 or layer >= 7 * n_layers // 8 or layer % 3 == 2)
    if name == "lm_head.weight" or (more_bits and name.endswith(("v_proj.weight", "down_proj.weight"))):
        return "Q6_K"
    if name.endswith("in_proj_qkv.weight"):
        return "Q5_K"
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return "BF16"
    if name.startswith("mtp."):
        return "Q8_0"
    return "Q4_K"


def uniform(kind: str):
    return lambda name, shape, layer, n: kind if len(shape) == 2 else "F32"


def with_fallback(kind_of):
    """`kind_of` where a k-quant does not fit the row (K not a multiple of 256) stored as Q8_0 instead, as
    llama.cpp's quantiser falls back (Q6_K → Q8_0; its Q5_0 / Q5_1 for Q4_K / Q5_K are types we do not run)."""
    def kind(name, shape, layer, n):
        k = kind_of(name, shape, layer, n)
        return "Q8_0" if k in KQUANTS and shape[-1] % QK_K else k
    return kind


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def tile_heads(t: torch.Tensor, dim: int, nk: int, g: int, hd: int) -> torch.Tensor:
    """llama.cpp's grouped → tiled value-head order along `dim` (reshape [nk, g, hd], swap the first two)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, g, hd, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape)


def head_transform(spec: ModelSpec, name: str, t: torch.Tensor, fn) -> torch.Tensor:
    """`fn` (tile_heads or its inverse) over the value-head axis of GDN tensor `name`; others unchanged."""
    la = spec.model.linear_attention
    nk, g, dv = la.num_key_heads, la.group, la.value_head_dim
    if ".linear_attn." not in name or g == 1:
        return t
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([t[:2 * la.key_dim], fn(t[2 * la.key_dim:], 0, nk, g, dv)])
    if name.endswith("in_proj_z.weight"):
        return fn(t, 0, nk, g, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return fn(t, 0, nk, g, 1)
    if name.endswith("out_proj.weight"):
        return fn(t, 1, nk, g, dv)
    return t


def stored_float(spec: ModelSpec, name: str, w: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's converter writes for canonical float tensor `name`."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    if name.endswith("A_log"):
        w = -torch.exp(w)
    if name.endswith("conv1d.weight"):
        w = w.squeeze(1)
    return head_transform(spec, name, w, tile_heads)


def rescale_kquant(kind: str, blocks: torch.Tensor, factor: float) -> None:
    """Multiply the fp16 scales of uint8 super-blocks [nb, block_bytes] by `factor`, in place: every value
    the blocks encode scales by it (codes and sub-scales untouched)."""
    for lo, hi in SCALE_BYTES[kind]:
        d = blocks[:, lo:hi].contiguous().view(torch.float16).to(torch.float32) * factor
        blocks[:, lo:hi] = d.to(torch.float16).view(torch.uint8)


def center_kquant(kind: str, blocks: torch.Tensor) -> None:
    """Q4_K / Q5_K super-blocks [nb, block_bytes] made zero-mean, in place: each sub-block's min equal to its
    scale and dmin = d × the codes' mean (w = d·sc·(q − mean)). Uniform random bytes alone give every block a
    positive mean about its std, which makes every row of a matrix alike. Q6_K's signed codes are centred."""
    if kind == "Q6_K":
        return
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    blocks[:, 2:4] = (d * (7.5 if kind == "Q4_K" else 15.5)).to(torch.float16).view(torch.uint8)
    packed = blocks[:, 4:16]                  # 6-bit (scale, min) pairs: see compiler.kquant._scale_min_k4
    packed[:, 4:8] = packed[:, 0:4]           # mins 0–3 and the high bits of mins 4–7 as the scales'
    packed[:, 8:12] = (packed[:, 8:12] & 0x0F) * 17          # low 4 bits of mins 4–7 as the scales' (x | x << 4)


def _random_kquant(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    blocks = random_kquant(kind.lower(), n, k, gen, scale=1.0).blocks
    center_kquant(kind, blocks.view(-1, KFORMATS[kind.lower()].block_bytes))
    return blocks


@functools.cache
def _unit_std(kind: str) -> float:
    """Std of the values `_random_kquant` blocks encode (a fixed 64 × 1024 sample)."""
    blocks = _random_kquant(kind, 64, 4 * QK_K, torch.Generator().manual_seed(0))
    return float(dequantize(KQTensor(kind.lower(), blocks, 4 * QK_K)).std())


def random_blocks(kind: str, n: int, k: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row bytes] of random zero-mean Q4_K / Q5_K / Q6_K / Q8_0 blocks (valid fp16 scales) whose
    values have about `std`, on `gen`'s device."""
    if kind in KQUANTS:
        blocks = _random_kquant(kind, n, k, gen)
        rescale_kquant(kind, blocks.view(-1, KFORMATS[kind.lower()].block_bytes), std / _unit_std(kind))
        return blocks
    if kind != "Q8_0":
        raise ValueError(f"no random blocks of type {kind}")
    nb = n * k // 32
    codes = torch.randint(-127, 128, (nb, 32), generator=gen, dtype=torch.int8, device=gen.device)
    d = (torch.rand(nb, 1, generator=gen, device=gen.device) + 0.5) * (std / Q8_0_CODE_STD)
    return torch.cat([d.to(torch.float16).view(torch.uint8), codes.view(torch.uint8)], 1).view(n, -1)


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of K values in block type `kind`."""
    if kind == "Q8_0":
        return k // 32 * 34
    return k // QK_K * KFORMATS[kind.lower()].block_bytes


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: the 256 byte symbols, a few merges, the ChatML specials, [PADi] up to vocab_size."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_sym = dict(zip(bs, map(chr, cs)))
    tokens = [byte_sym[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
    tokens += ["he", "ll", "hell", "hello", "Ġw", "or"]
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    tokens += ["<think>"]
    types += [4]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [5] * (vocab_size - len(types))
    return tokens, types, merges


def add_metadata(w, spec: ModelSpec, arch: str = "qwen35", vocab: bool = True) -> None:
    """The hyperparameter keys llama.cpp writes for a qwen35 model (and, with `vocab`, `tiny_vocab` and the
    ChatML template) onto gguf.GGUFWriter `w`."""
    a, la, at = spec.model, spec.model.linear_attention, spec.model.attention
    kinds = list(a.layers.kinds)
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    half = at.rotary_dim // 2                         # RoPE frequencies, split over the three mrope axes
    for key, value in [("block_count", a.layers.count + a.mtp.num_layers), ("context_length", a.max_position_embeddings),
                       ("embedding_length", a.hidden_size), ("feed_forward_length", a.intermediate_size),
                       ("attention.head_count", at.num_heads), ("attention.head_count_kv", at.num_kv_heads),
                       ("attention.key_length", at.head_dim), ("attention.value_length", at.head_dim)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", a.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", at.rope_theta)
    w.add_uint32(f"{arch}.rope.dimension_count", at.rotary_dim)
    w.add_array(f"{arch}.rope.dimension_sections", [half // 3 + (i < half % 3) for i in range(3)] + [0])
    for key, value in [("ssm.conv_kernel", la.conv_kernel), ("ssm.state_size", la.key_head_dim),
                       ("ssm.group_count", la.num_key_heads), ("ssm.time_step_rank", la.num_value_heads),
                       ("ssm.inner_size", la.value_dim)]:
        w.add_uint32(f"{arch}.{key}", value)
    if interval and all((k == "full_attention") == ((i + 1) % interval == 0) for i, k in enumerate(kinds)):
        w.add_uint32(f"{arch}.full_attention_interval", interval)
    if a.mtp.num_layers:
        w.add_uint32(f"{arch}.nextn_predict_layers", a.mtp.num_layers)
    if vocab:
        tokens, types, merges = tiny_vocab(a.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_chat_template(CHAT_TEMPLATE)
