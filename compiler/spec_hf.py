"""spec_hf: an HF Qwen3.5-family `config.json` (nested `text_config` or flat text-only, with or without a
`vision_config`) → a ModelSpec with the default quantisation recipe and runtime section. Reads no weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from .schema import SpecError
from .spec import ModelSpec, spec_from_dict
from .spec_vision import vision_from_hf_config


def spec_from_hf_config(config: dict | str | Path, name: str | None = None,
                        vision: Literal["auto", "require", "skip"] = "auto") -> ModelSpec:
    """Derive a spec from an HF Qwen3.5-family config (nested `text_config` or flat text-only). Its
    `vision_config` gives the vision section: `auto` keeps it when it is valid against the text model and else
    derives the text-only spec (a text load never fails on the tower); `require` raises its SpecError; `skip`
    leaves it out."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    text = dict(config.get("text_config") or config)
    where = "text_config" if "text_config" in config else ""

    def get(key, *fallbacks, default=None):
        for src in (text, config):
            for k in (key, *fallbacks):
                if k in src:
                    return src[k]
        if default is None:
            raise SpecError(f"{where}.{key}".strip("."), "missing key in config.json")
        return default

    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise SpecError(f"{where}.rope_parameters.rope_theta".strip("."), "missing key in config.json")
    n_layers = get("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    data = {
        "name": name or str(text.get("model_type", "qwen3_5")),
        "model": {
            "vocab_size": get("vocab_size"),
            "hidden_size": get("hidden_size"),
            "intermediate_size": get("intermediate_size"),
            "rms_norm_eps": get("rms_norm_eps", default=1e-6),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            "max_position_embeddings": get("max_position_embeddings", default=262144),
            "layers": {"count": n_layers, "types": list(layer_types)},
            "attention": {
                "num_heads": get("num_attention_heads"),
                "num_kv_heads": get("num_key_value_heads"),
                "head_dim": get("head_dim"),
                "rope_theta": float(theta),
                "partial_rotary_factor": float(rope.get("partial_rotary_factor",
                                                        text.get("partial_rotary_factor", 0.25))),
                "output_gate": bool(text.get("attn_output_gate", True)),
            },
            "linear_attention": {
                "num_key_heads": get("linear_num_key_heads"),
                "num_value_heads": get("linear_num_value_heads"),
                "key_head_dim": get("linear_key_head_dim"),
                "value_head_dim": get("linear_value_head_dim"),
                "conv_kernel": get("linear_conv_kernel_dim", default=4),
            },
            "mtp": {"num_layers": int(text.get("mtp_num_hidden_layers", 1))},
        },
    }
    ctx = min(32768, data["model"]["max_position_embeddings"])
    data["runtime"] = {"max_context": ctx}
    text_only = spec_from_dict(data)
    att = text_only.model.attention
    section = vision_from_hf_config(config, att.rotary_dim // 2) if vision != "skip" else None
    if section is None:
        if vision == "require":
            raise SpecError("vision_config", "missing in config.json (the model has no vision tower)")
        return text_only
    try:
        return spec_from_dict({**data, "vision": section})
    except SpecError as err:
        if vision == "require":
            raise SpecError(f"vision_config ({err.path})", err.message) from None
        return text_only
