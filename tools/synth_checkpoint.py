"""synth_checkpoint: writes a random HF checkpoint of a spec's shape in the Qwen3.5 layout and tensor names
— config.json (text settings under text_config), generation_config.json, safetensors shards with an index
as released checkpoints have them — so loading and conversion can be measured at full size without a
download. Weights at O(1) scale by `random_weights`' rules, one tensor in memory at a time, drawn on a
GPU when asked (`--device cuda`); each tensor is seeded by its name, so any one can be redrawn alone.

    python -m tools.synth_checkpoint lab/qwen3.8-9b.yaml /scratch/q9b --device cuda   [--shard-size 4GB]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

import torch

from compiler.spec import ModelSpec, load_spec, tensor_table, vision_tensor_table
from ninfer_gen.weights.random_weights import draw_tensor
from ninfer_gen.weights.safetensors_io import ShardWriter

INDEX = "model.safetensors.index.json"
VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
               "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "hidden_act")
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def hf_config(spec: ModelSpec, layout: str = "vlm") -> dict:
    """The config.json of a Qwen3.5-family checkpoint of this spec (spec_from_hf_config reads it back)."""
    a, at, g = spec.model, spec.model.attention, spec.model.linear_attention
    half = at.rotary_dim // 2                      # RoPE frequencies, split over the three mrope axes
    text = {
        "model_type": "qwen3_5_text", "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": a.layers.count,
        "layer_types": list(a.layers.kinds), "num_attention_heads": at.num_heads, "num_key_value_heads": at.num_kv_heads,
        "head_dim": at.head_dim, "attn_output_gate": at.output_gate, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": at.rope_theta,
                            "partial_rotary_factor": at.partial_rotary_factor, "mrope_interleaved": True,
                            "mrope_section": [half // 3 + (i < half % 3) for i in range(3)]},
        "linear_num_key_heads": g.num_key_heads, "linear_num_value_heads": g.num_value_heads,
        "linear_key_head_dim": g.key_head_dim, "linear_value_head_dim": g.value_head_dim,
        "linear_conv_kernel_dim": g.conv_kernel, "rms_norm_eps": a.rms_norm_eps,
        "tie_word_embeddings": a.tie_word_embeddings, "max_position_embeddings": a.max_position_embeddings,
        "mtp_num_hidden_layers": a.mtp.num_layers, "dtype": "bfloat16",
    }
    if layout == "text":
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "tie_word_embeddings": a.tie_word_embeddings, "dtype": "bfloat16"}
    v = spec.vision
    if v is not None:          # the whole tower of the spec's vision section, as released checkpoints carry it
        text["rope_parameters"]["mrope_section"] = list(v.mrope_section)
        config["vision_config"] = {"model_type": "qwen3_5_vision", **{k: getattr(v, k) for k in VISION_KEYS},
                                   "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
        config |= {k: getattr(v, k) for k in TOKEN_KEYS}
    return config


def stored_name(name: str, layout: str) -> str:
    if name.startswith(("lm_head.", "mtp.")):
        return name
    if name.startswith("visual."):
        return "model." + name
    return ("model.language_model." if layout == "vlm" else "model.") + name


def _seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


def draw(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int, device) -> torch.Tensor:
    """One tensor as the checkpoint stores it (bf16), from its own seeded generator."""
    gen = torch.Generator(device=device).manual_seed(_seed(seed, name))
    w = draw_tensor(name, shape, gen)
    if name == ("embed_tokens.weight" if spec.model.tie_word_embeddings else "lm_head.weight"):
        w = w * 2.0                                # logit std ≈ 2 on normed hidden states, as random_weights
    return w.to(torch.bfloat16)


def write_synthetic(spec: ModelSpec, out, seed: int = 0, shard_bytes: int = 4 * 10**9, device="cpu",
                    layout: str = "vlm", with_mtp: bool = True, progress: bool = False) -> dict:
    """Write the checkpoint to folder `out`; returns its size, shard count and seconds."""
    if layout not in ("vlm", "text"):
        raise ValueError(f"layout must be 'vlm' or 'text', got {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    table = [(t.name, t.shape) for t in tensor_table(spec) if with_mtp or not t.name.startswith("mtp.")]
    if layout == "vlm":                    # the vision tower (a spec with a vision section): model.visual.*
        table += [(t.name, t.shape) for t in vision_tensor_table(spec)]
    items = [(stored_name(n, layout), s) for n, s in table]
    writer = ShardWriter(out, [(n, "BF16", s) for n, s in items], shard_bytes, stem="model", hashes=False)
    canonical = {stored_name(n, layout): n for n, _ in table}
    total = sum(2 * math.prod(s) for _, s in items)
    from tqdm import tqdm
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {out.name}",
              disable=None if progress else True) as bar:
        for key, shape in items:
            writer.write(key, draw(spec, canonical.get(key, key), shape, seed, device))
            bar.update(2 * math.prod(shape))
    writer.close()
    if len(writer.files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: v[0] for k, v in writer.plan.items()}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    config = hf_config(spec, layout)
    config.get("text_config", config)["mtp_num_hidden_layers"] = int(with_mtp and spec.model.mtp.num_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}, indent=2))  # no eos: fixed lengths
    return {"out": str(out), "bytes": total, "shards": len(writer.files), "tensors": len(items),
            "largest_tensor_bytes": max(2 * math.prod(s) for _, s in items), "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="model spec YAML giving the shape")
    p.add_argument("out", help="folder to write (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=float, default=4e9, help="largest shard in bytes (default 4e9)")
    p.add_argument("--device", default="cpu", help="where to draw: cpu or cuda")
    p.add_argument("--layout", choices=("vlm", "text"), default="vlm", help="vlm: model.language_model.* and "
                   "the spec's vision tower (model.visual.*), as released; text: model.* (Qwen3_5ForCausalLM saves)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* tensors")
    args = p.parse_args(argv)
    r = write_synthetic(load_spec(args.spec), args.out, args.seed, int(args.shard_size), args.device, args.layout,
                        not args.no_mtp, progress=True)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
