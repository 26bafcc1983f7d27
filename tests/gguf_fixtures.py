"""gguf_fixtures: tiny GGUF files made with the `gguf` package's writer, the way llama.cpp's converter and
quantiser lay out a Qwen3.5 hybrid (arch qwen35: norms stored 1 + w, ssm_a = −exp(A_log), conv squeezed,
GDN value heads tiled), with random k-quant blocks (valid fp16 scales) and a tiny byte-level BPE vocab —
the pieces shared with the full-size writer (tools/synth_gguf.py) live in ninfer_gen.weights.gguf_synth.

`write_gguf` returns the canonical (HF-layout) fp32 tensors the file encodes — the k-quant and Q8_0 blocks
dequantised by the `gguf` package and the llama.cpp transforms undone here, independently of
ninfer_gen.weights.gguf_names — so a test can run them through the plain-tensor / HF-checkpoint path.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from compiler.kquant import random_kquant
from compiler.spec import ModelSpec, load_spec, tensor_table
from ninfer_gen.weights.gguf_synth import (CHAT_TEMPLATE, GGML, add_metadata, head_transform, layer_of,  # noqa: F401
                                            q4_k_m, rescale_kquant, stored_float, uniform)
from ninfer_gen.weights.random_weights import random_weights

REPO = Path(__file__).resolve().parents[1]


def kquant_spec(group: int = 3) -> ModelSpec:
    """The tiny spec at widths k-quants accept (every matrix's K a multiple of 256), `group` value heads per key
    head (3 as in the 27B), value heads of 128 so a 256-value super-block spans two heads."""
    base = load_spec(REPO / "model_specs" / "qwen3.8-tiny.yaml")
    a = base.model
    la = dataclasses.replace(a.linear_attention, num_key_heads=2, num_value_heads=2 * group, value_head_dim=128)
    model = dataclasses.replace(a, hidden_size=256, intermediate_size=512, linear_attention=la)
    return dataclasses.replace(base, name="qwen3.8-tiny-k", model=model)


def q4_k_m_recipe(spec: ModelSpec) -> ModelSpec:
    """`spec` with a Q4_K_M-style recipe by role (Q6_K LM head, V and down; Q5_K GDN qkv; Q4_K elsewhere, the
    embedding too) and out_proj's value heads tiled, as a GGUF k-quant file loads: the kernel shapes such a
    file of this size plans (e.g. the 27B's, with no file)."""
    q = dataclasses.replace(spec.quantization, embed="q4_k", lm_head="q6_k", attn_q="q4_k", attn_k="q4_k",
                            attn_v="q6_k", attn_o="q4_k", gdn_qkv="q5_k", gdn_z="q4_k", gdn_out="q4_k",
                            mlp_gate_up="q4_k", mlp_down="q6_k")
    la = dataclasses.replace(spec.model.linear_attention, out_head_order="tiled")
    return dataclasses.replace(spec, quantization=q, model=dataclasses.replace(spec.model, linear_attention=la))


def _untile(t: torch.Tensor, dim: int, nk: int, g: int, hd: int) -> torch.Tensor:
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], g, nk, hd, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape)


def _encode(kind: str, w: torch.Tensor, gen: torch.Generator):
    """(numpy data for the writer, raw ggml type or None, the float values the file then holds)."""
    import gguf

    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        n, k = w.shape
        kq = random_kquant(kind.lower(), n, k, gen, scale=1.0)
        blocks = kq.blocks.numpy()
        vals = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
        factor = float(w.std()) / float(vals.std())         # the float draw's scale, in valid fp16 scales
        rescale_kquant(kind, torch.from_numpy(blocks.reshape(-1, kq.format.block_bytes)), factor)
        data = blocks.reshape(n, -1)
        return data, GGML[kind], torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]))
    x = w.numpy().astype(np.float32)
    if kind in ("Q8_0", "Q4_0"):
        q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
        return q, GGML[kind], torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType[kind]))
    if kind == "BF16":
        b = torch.from_numpy(x).to(torch.bfloat16)
        return b.view(torch.int16).numpy().view(np.uint16), GGML[kind], b.to(torch.float32)
    if kind == "F16":
        h = x.astype(np.float16)
        return h, None, torch.from_numpy(h.astype(np.float32))
    return x, None, torch.from_numpy(x)


def _gguf_name(name: str, n_layers: int) -> str:
    from ninfer_gen.weights.gguf_names import gguf_name
    return gguf_name(name, n_layers)


def write_gguf(path: Path, spec: ModelSpec, kind_of=q4_k_m, seed: int = 0, arch: str = "qwen35",
               vocab: bool = True, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write `spec` with random weights as a llama.cpp-style GGUF; returns the canonical fp32 tensors it encodes."""
    import gguf

    n = spec.model.layers.count
    w = gguf.GGUFWriter(str(path), arch)
    add_metadata(w, spec, arch, vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    canonical = {}
    for t, value in zip(tensor_table(spec), random_weights(spec, seed).values()):
        kind = kind_of(t.name, t.shape, layer_of(t.name), n)
        stored = stored_float(spec, t.name, value)
        data, raw, held = _encode(kind, stored, gen)
        gname = _gguf_name(t.name, n)
        if gname not in drop:
            w.add_tensor(gname, data, raw_dtype=raw) if raw is not None else w.add_tensor(gname, data)
        canonical[t.name] = _canonical_of(spec, t.name, held.reshape(stored.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return canonical


def _canonical_of(spec: ModelSpec, name: str, held: torch.Tensor) -> torch.Tensor:
    held = head_transform(spec, name, held.to(torch.float32), _untile)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        held = held - 1
    if name.endswith("A_log"):
        held = torch.log(-held)
    if name.endswith("conv1d.weight"):
        held = held.unsqueeze(1)
    return held


def write_hf_checkpoint(folder: Path, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> Path:
    """The same tensors as an HF text-only checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    a, at, la = spec.model, spec.model.attention, spec.model.linear_attention
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_5_text", "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
              "intermediate_size": a.intermediate_size, "rms_norm_eps": a.rms_norm_eps,
              "tie_word_embeddings": a.tie_word_embeddings, "max_position_embeddings": a.max_position_embeddings,
              "num_hidden_layers": a.layers.count, "layer_types": list(a.layers.kinds),
              "num_attention_heads": at.num_heads, "num_key_value_heads": at.num_kv_heads, "head_dim": at.head_dim,
              "rope_parameters": {"rope_theta": at.rope_theta, "partial_rotary_factor": at.partial_rotary_factor},
              "linear_num_key_heads": la.num_key_heads, "linear_num_value_heads": la.num_value_heads,
              "linear_key_head_dim": la.key_head_dim, "linear_value_head_dim": la.value_head_dim,
              "linear_conv_kernel_dim": la.conv_kernel, "mtp_num_hidden_layers": a.mtp.num_layers}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({(k if k.startswith(("mtp.", "lm_head.")) else f"model.{k}"): v.contiguous()
               for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
