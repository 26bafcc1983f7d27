"""User-input errors name the problem: one test per error class of the spec and checkpoint loaders,
plus the checkpoint layouts that must load (model.*, model.language_model.*, sharded)."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from compiler.quant import QTensor
from compiler.schema import SpecError
from compiler.spec import load_spec, tensor_table
from compiler.spec_hf import spec_from_hf_config
from ninfer_gen.weights.checkpoint import (CheckpointError, dequantized, load_checkpoint, quantize_weights,
                                   read_hf_config)

TINY = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3.8-tiny.yaml"
CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "max_position_embeddings": 4096, "mtp_num_hidden_layers": 1,
}


# ---------------------------------------------------------------- spec loader

def _spec_error(tmp_path, mutate) -> SpecError:
    data = yaml.safe_load(TINY.read_text())
    mutate(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


def test_tiny_spec_loads():
    assert load_spec(TINY).model.layers.kinds[3] == "full_attention"


def test_unknown_nested_key(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"]["attention"].update(bogus=1))
    assert err.path == "model.attention.bogus" and "unknown key" in str(err)
    assert "model.attention.bogus" in str(err)


def test_missing_key(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"].pop("hidden_size"))
    assert err.path == "model.hidden_size" and "missing key" in str(err)


def test_wrong_type(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"].update(hidden_size="big"))
    assert "model.hidden_size" in str(err) and "expected an integer" in str(err) and "'big'" in str(err)


def test_heads_not_dividing(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"]["attention"].update(num_heads=5))
    assert err.path == "model.attention.num_heads" and "multiple of num_kv_heads (2), got 5" in str(err)


def test_value_heads_not_multiple_of_key_heads(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"]["linear_attention"].update(num_value_heads=5))
    assert err.path == "model.linear_attention.num_value_heads" and "num_key_heads (2), got 5" in str(err)


def test_layer_types_length_differs_from_count(tmp_path):
    def mutate(d):
        d["model"]["layers"] = {"count": 4, "types": ["linear_attention"] * 3}
    err = _spec_error(tmp_path, mutate)
    assert err.path == "model.layers.types" and "expected 4 entries" in str(err) and "got 3" in str(err)


def test_pattern_length_not_dividing_count(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["model"]["layers"].update(pattern=["linear_attention"] * 3))
    assert err.path == "model.layers.pattern" and "pattern length 3 must divide the layer count 4" in str(err)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n  name: x\n")
    with pytest.raises(SpecError, match="not valid YAML") as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="spec file not found") as info:
        load_spec(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


def test_bad_quant_format_name(tmp_path):
    err = _spec_error(tmp_path, lambda d: d["quantization"].update(attn_q="q3g64"))
    assert err.path == "quantization.attn_q" and "'q3g64'" in str(err) and "'q4g64'" in str(err)


@pytest.mark.parametrize("nested", [False, True])
def test_hf_config_missing_key(nested):
    text = {k: v for k, v in CONFIG.items() if k != "hidden_size"}
    config = {"text_config": text} if nested else text
    with pytest.raises(SpecError, match="missing key in config.json") as info:
        spec_from_hf_config(config)
    assert info.value.path == ("text_config.hidden_size" if nested else "hidden_size")


# ---------------------------------------------------------------- checkpoint loader

def _spec(**overrides):
    return spec_from_hf_config({**CONFIG, **overrides}, name="tiny")


def _tensors(spec, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in tensor_table(spec)}


def _stored(tensors, prefix):
    return {(n if n.startswith(("lm_head.", "mtp.")) else prefix + n): t for n, t in tensors.items()}


def _write(path: Path, tensors, prefix="model.", config=CONFIG, extra=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({**_stored(tensors, prefix), **(extra or {})}, str(path / "model.safetensors"))
    return path


def _load_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, **kwargs)
    return str(info.value)


def test_missing_config_json(tmp_path):
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    msg = _load_error(tmp_path)
    assert "config.json not found" in msg and str(tmp_path) in msg


def test_config_not_json_and_missing_config_key(tmp_path):
    (tmp_path / "config.json").write_text("{vocab_size: 96")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "head_dim"}))
    msg = _load_error(tmp_path)
    assert "config.json: head_dim: missing key" in msg


def test_missing_directory(tmp_path):
    assert "checkpoint directory not found" in _load_error(tmp_path / "absent")


def test_missing_tensor(tmp_path):
    tensors = _tensors(_spec())
    del tensors["layers.1.linear_attn.A_log"]
    msg = _load_error(_write(tmp_path, tensors))
    assert "1 missing tensor(s): layers.1.linear_attn.A_log" in msg and str(tmp_path) in msg


def test_many_missing_tensors_are_counted(tmp_path):
    tensors = {n: t for n, t in _tensors(_spec()).items() if not n.startswith(("layers.0.", "layers.1."))}
    msg = _load_error(_write(tmp_path, tensors))
    assert "28 missing tensor(s): layers.0.input_layernorm.weight" in msg and "and 18 more" in msg


def test_unexpected_tensor(tmp_path):
    extra = {"model.layers.0.mlp.up_proj.bias": torch.zeros(128)}
    msg = _load_error(_write(tmp_path, _tensors(_spec()), extra=extra))
    assert "1 unexpected tensor(s): layers.0.mlp.up_proj.bias" in msg


def test_misshaped_tensor(tmp_path):
    tensors = _tensors(_spec())
    tensors["layers.3.self_attn.q_proj.weight"] = torch.zeros(128, 64)
    msg = _load_error(_write(tmp_path, tensors))
    assert "layers.3.self_attn.q_proj.weight (expected [256, 64], got [128, 64])" in msg


def test_no_safetensors_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    msg = _load_error(tmp_path)
    assert "no safetensors files in" in msg and str(tmp_path) in msg


def test_unreadable_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read safetensors file" in _load_error(tmp_path)


def test_index_names_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00001-of-00002.safetensors" in _load_error(tmp_path)


def test_tensor_stored_under_two_prefixes(tmp_path):
    tensors = _tensors(_spec())
    extra = {"model.language_model.norm.weight": torch.ones(64)}
    assert "'norm.weight' is stored twice" in _load_error(_write(tmp_path, tensors, extra=extra))


def test_mtp_tensors_absent(tmp_path):
    spec = _spec()
    tensors = {n: t for n, t in _tensors(spec).items() if not n.startswith("mtp.")}
    path = _write(tmp_path, tensors)
    msg = _load_error(path)
    assert "MTP layer" in msg and "mtp.pre_fc_norm_embedding.weight" in msg and "require_mtp=False" in msg
    spec2, loaded = load_checkpoint(path, require_mtp=False)
    assert spec2.model.mtp.num_layers == 0 and set(loaded) == set(tensors)


def _assert_same(loaded, tensors):
    assert list(loaded) == list(tensors)  # tensor-table order
    for name, t in tensors.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t.float()), name


def test_both_prefix_layouts_load_the_same(tmp_path):
    spec = _spec()
    tensors = _tensors(spec, seed=1)
    tensors["layers.0.linear_attn.in_proj_a.weight"] = tensors["layers.0.linear_attn.in_proj_a.weight"].bfloat16()
    text = _write(tmp_path / "text", tensors, prefix="model.")
    vlm = _write(tmp_path / "vlm", tensors, prefix="model.language_model.",
                 extra={"model.visual.x": torch.ones(3, 5)})
    spec_a, a = load_checkpoint(text)
    spec_b, b = load_checkpoint(vlm)
    assert spec_a.name == "text" and spec_b.model == spec_a.model == spec.model
    _assert_same(a, tensors)
    _assert_same(b, tensors)


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_checkpoint(tmp_path, with_index):
    tensors = _tensors(_spec(), seed=2)
    stored = list(_stored(tensors, "model.").items())
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = dict(stored[i::3])
        save_file(part, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    if with_index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, loaded = load_checkpoint(tmp_path)
    _assert_same(loaded, tensors)


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    config = {**CONFIG, "tie_word_embeddings": True}
    tensors = _tensors(_spec(tie_word_embeddings=True))
    assert "lm_head.weight" not in tensors
    spec, loaded = load_checkpoint(_write(tmp_path, tensors, config=config))
    assert spec.model.tie_word_embeddings and "lm_head.weight" not in loaded


def test_quantize_weights_follows_the_recipe():
    spec = _spec()
    tensors = _tensors(spec, seed=3)
    q = quantize_weights(spec, tensors)
    assert isinstance(q["layers.0.mlp.up_proj.weight"], QTensor) and q["layers.0.mlp.up_proj.weight"].fmt == "q4g64"
    assert q["layers.0.mlp.down_proj.weight"].fmt == "q5g64" and q["mtp.fc.weight"].fmt == "w8g32"
    assert q["layers.0.linear_attn.in_proj_a.weight"].dtype == torch.bfloat16
    assert q["layers.0.linear_attn.conv1d.weight"].dtype == torch.bfloat16
    assert q["layers.0.linear_attn.A_log"].dtype == torch.float32
    d = dequantized(q)
    assert all(t.dtype == torch.float32 for t in d.values())
    up, ref = d["layers.0.mlp.up_proj.weight"], tensors["layers.0.mlp.up_proj.weight"]
    assert 0 < (up - ref).abs().max() < ref.abs().max() / 7


def test_quantize_weights_names_the_tensor_that_cannot_be_grouped():
    spec = _spec(hidden_size=96)  # K = 96 suits w8g32 (embedding) but is no multiple of 64
    with pytest.raises(CheckpointError, match="layers.0.linear_attn.in_proj_qkv.weight.*multiple of 64"):
        quantize_weights(spec, _tensors(spec))
    with pytest.raises(CheckpointError, match="'bogus.weight' is not in the tensor table"):
        quantize_weights(spec, {"bogus.weight": torch.zeros(2, 64)})
