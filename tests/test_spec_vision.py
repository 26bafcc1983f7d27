"""test_spec_vision: the spec's optional vision section — strict validation with the key path in every error, its
derivation from an HF config.json, its tensor table against HF's own vision tower, and text-only specs unchanged.
"""
import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from compiler.schema import SpecError
from compiler.spec import format_of, load_spec, spec_from_dict, vision_tensor_table
from compiler.spec_hf import spec_from_hf_config
from compiler.spec_vision import effective_mrope_section, mrope_axis
from ninfer_gen.weights.container import spec_dict
from vision_fixtures import hf_config

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
TINY_VL = SPECS / "qwen3.8-tiny-vl.yaml"


def _data() -> dict:
    return yaml.safe_load(TINY_VL.read_text())


def _error(edit) -> SpecError:
    data = _data()
    edit(data)
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    return info.value


def test_tiny_vl_loads():
    spec = load_spec(TINY_VL)
    v = spec.vision
    assert (v.head_dim, v.grid_side, v.patch_dim, v.merge_unit) == (16, 8, 384, 4)
    assert v.out_hidden_size == spec.model.hidden_size and spec.quantization.vision == "bf16"
    assert load_spec(SPECS / "qwen3.8-tiny.yaml").vision is None


@pytest.mark.parametrize("name", ["qwen3.8-tiny-vl", "qwen3.8-27b"])
def test_tensor_table_is_hf_vision_tower(name):
    """Names and shapes equal HF's Qwen3_5VisionModel state dict (the 27B's from its meta-device twin)."""
    spec = load_spec(SPECS / f"{name}.yaml")
    with torch.device("meta"):
        tower = Qwen3_5VisionModel(hf_config(spec).vision_config)
    hf = {f"visual.{k}": tuple(t.shape) for k, t in tower.state_dict().items()}
    ours = {t.name: t.shape for t in vision_tensor_table(spec)}
    assert ours == hf
    assert all(format_of(spec, t) == "bf16" for t in vision_tensor_table(spec))


def test_27b_tower_shape():
    spec = load_spec(SPECS / "qwen3.8-27b.yaml")
    table = vision_tensor_table(spec)
    assert len(table) == 333 and 4.6e8 < sum(math.prod(t.shape) for t in table) < 4.62e8
    assert spec.vision.mrope_section == (11, 11, 10) and spec.vision.image_token_id == 248056


def test_from_hf_config_equals_yaml():
    spec = load_spec(TINY_VL)
    derived = spec_from_hf_config(hf_config(spec).to_dict(), name=spec.name)
    assert derived.vision == spec.vision


def test_hf_config_defaults_fill_a_partial_vision_config():
    """A config.json naming few vision keys (as a hand-edited config may) takes transformers' defaults, and
    the M-RoPE section HF applies over the text model's frequencies."""
    config = hf_config(load_spec(TINY_VL)).to_dict()
    config["vision_config"] = {"model_type": "qwen3_5_vision", "hidden_size": 64, "out_hidden_size": 128}
    del config["text_config"]["rope_parameters"]["mrope_section"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        del config[key]
    config["text_config"]["vocab_size"] = 248320
    v = spec_from_hf_config(config).vision
    assert (v.depth, v.num_heads, v.patch_size, v.num_position_embeddings) == (27, 16, 16, 2304)
    assert v.image_token_id == 248056
    assert v.mrope_section == (3, 3, 2)          # HF's [11, 11, 10] over 8 frequencies


def test_hf_vision_config_that_does_not_fit_the_text_model():
    """A config that names no token ids: the defaults (248056 …) lie outside a small vocabulary.
    `auto` derives the text-only spec (a text load never fails on the tower), `require` says why, `skip` skips."""
    config = hf_config(load_spec(TINY_VL)).to_dict()
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        del config[key]
    assert spec_from_hf_config(config).vision is None
    with pytest.raises(SpecError, match=r"vision_config \(vision.image_token_id\): must be a token id below"):
        spec_from_hf_config(config, vision="require")
    good = hf_config(load_spec(TINY_VL)).to_dict()
    assert spec_from_hf_config(good, vision="skip").vision is None
    assert spec_from_hf_config(good, vision="require").vision == load_spec(TINY_VL).vision
    text_only = {k: v for k, v in good.items() if k != "vision_config"}
    with pytest.raises(SpecError, match="vision_config: missing in config.json"):
        spec_from_hf_config(text_only, vision="require")


def test_mrope_axes():
    """Interleaved: T H W T H W …, an axis whose count is used up gives its slots to T."""
    assert [mrope_axis(j, (11, 11, 10)) for j in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [mrope_axis(j, (11, 11, 10)) for j in range(29, 32)] == [2, 0, 1]
    assert effective_mrope_section((11, 11, 10), 32) == [11, 11, 10]
    assert [mrope_axis(j, (4, 2, 2)) for j in range(8)] == [0, 1, 2, 0, 1, 2, 0, 0]


def test_text_only_spec_dict_unchanged():
    """A spec without a vision section writes no vision keys: the converted containers' hashes stay valid."""
    data = spec_dict(load_spec(SPECS / "qwen3.8-tiny.yaml"))
    assert "vision" not in data and "vision" not in data["quantization"]
    vl = load_spec(TINY_VL)
    back = spec_from_dict(spec_dict(vl))
    assert back.vision == vl.vision and spec_dict(back) == spec_dict(vl)


@pytest.mark.parametrize("edit,path,words", [
    (lambda d: d["vision"].update(num_heads=3), "vision.num_heads", "divisor of hidden_size"),
    (lambda d: d["vision"].update(num_heads=32), "vision.num_heads", "multiple of 4"),
    (lambda d: d["vision"].update(num_position_embeddings=60), "vision.num_position_embeddings", "square"),
    (lambda d: d["vision"].update(out_hidden_size=64), "vision.out_hidden_size", "model.hidden_size (128)"),
    (lambda d: d["vision"].update(image_token_id=512), "vision.image_token_id", "below model.vocab_size"),
    (lambda d: d["vision"].update(image_token_id=509), "vision.image_token_id", "distinct"),
    (lambda d: d["vision"].update(mrope_section=[4, 3, 2]), "vision.mrope_section", "the 8 RoPE frequencies"),
    (lambda d: d["vision"].update(hidden_act="relu"), "vision.hidden_act", "'gelu_pytorch_tanh'"),
    (lambda d: d["vision"].update(depth=0), "vision.depth", "positive"),
    (lambda d: d["vision"].update(colour="blue"), "vision.colour", "unknown key"),
    (lambda d: d["vision"].pop("patch_size"), "vision.patch_size", "missing key"),
    (lambda d: d.update(vision=[1]), "vision", "expected a mapping"),
    (lambda d: d["quantization"].update(vision="q4g64"), "quantization.vision", "stays float"),
])
def test_errors_name_the_key(edit, path, words):
    err = _error(edit)
    assert err.path == path and words in str(err), str(err)


def test_vision_section_is_optional():
    data = _data()
    del data["vision"]
    assert spec_from_dict(copy.deepcopy(data)).vision is None
