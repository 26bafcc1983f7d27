"""`ninfer-gen convert` and its container: converted == quantise-at-load bit for bit (device planes and the
reference's tensors) for every checkpoint layout; the manifest's hashes are the data's; corrupt, truncated,
altered or foreign containers are refused saying what is wrong; the CLI converts and runs the shipped model."""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import checkpoint_cases
import ninfer_gen
from checkpoint_cases import assert_same_device_weights
from compiler.spec import load_spec, spec_from_dict
from ninfer_gen.cli import main
from ninfer_gen.executor.device_weights import from_checkpoint, from_container, from_host
from ninfer_gen.weights.checkpoint import CheckpointError, dequantized, load_checkpoint, quantize_weights
from ninfer_gen.weights.container import (FORMAT_VERSION, MANIFEST, SPEC_FILE, load_host, open_container,
                                          spec_dict, spec_hash)
from ninfer_gen.weights.convert import convert_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "qwen3.8-small-py"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """layout → (HF dir, container dir), the containers in 2 shards or more where the data allows."""
    root = tmp_path_factory.mktemp("containers")
    out = {}
    for layout, path in checkpoint_cases.hf_layouts().items():
        convert_checkpoint(path, root / layout, device="cpu", shard_bytes=300_000)
        out[layout] = (path, root / layout)
    return out


@pytest.mark.parametrize("layout", checkpoint_cases.LAYOUTS)
def test_streamed_and_converted_loads_equal_quantise_at_load(converted, layout):
    """Device planes from the streamed HF load and from the container equal those of the whole-checkpoint
    load quantised on the host; the container's reference tensors equal the dequantised recipe."""
    source, box = converted[layout]
    spec, tensors = load_checkpoint(source)
    quantised = quantize_weights(spec, tensors)
    at_load = from_host(spec, quantised, device="cpu")
    streamed = from_checkpoint(source, device="cpu", require_mtp=True)
    assert streamed.spec == spec
    assert_same_device_weights(streamed, at_load)
    assert_same_device_weights(from_container(box, device="cpu"), at_load)
    if layout in ("sharded", "tied"):             # untied and tied heads (the other layouts add nothing here)
        spec2, host = load_host(box)
        assert spec_dict(spec2) == spec_dict(spec)
        want = dequantized(quantised)
        assert list(host) == list(want)
        for name, t in want.items():
            assert host[name].dtype == torch.float32 and torch.equal(host[name], t), name


def test_reference_backend_runs_the_container_like_quantise_at_load(converted):
    source, box = converted["vlm"]
    ids = [5, 17, 3, 250, 9, 44, 1]
    a = ninfer_gen.load(source, quantize=True, device="cpu")
    b = ninfer_gen.load(box, device="cpu")
    assert np.array_equal(a.forward_logits(ids), b.forward_logits(ids))
    assert b.source.endswith("(converted)") and np.array_equal(a.mtp_logits(ids), b.mtp_logits(ids))


def test_manifest_hashes_are_the_stored_bytes(converted):
    source, box = converted["sharded"]
    manifest = json.loads((box / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION and len(manifest["shards"]) >= 2
    spec = load_spec(box / SPEC_FILE)
    assert manifest["spec_hash"] == spec_hash(spec) and manifest["spec"] == spec_dict(spec)
    assert spec.quantization.attn_q == "q4g64" and spec.model.mtp.num_layers == 1
    for key, entry in open_container(box).entries.items():
        with open(entry.path, "rb") as f:
            f.seek(entry.offset)
            assert hashlib.sha256(f.read(entry.nbytes)).hexdigest() == manifest["tensors"][key]["sha256"], key


def _copy(box: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(box, tmp_path / "box"))


def _edit_manifest(box: Path, edit) -> None:
    manifest = json.loads((box / MANIFEST).read_text())
    edit(manifest)
    (box / MANIFEST).write_text(json.dumps(manifest))


def test_hash_mismatch_names_tensor_and_file(converted, tmp_path):
    box = _copy(converted["text"][1], tmp_path)
    entry = open_container(box).entries["layers.2.mlp.down_proj.weight#lo"]
    with open(entry.path, "r+b") as f:
        f.seek(entry.offset + 5)
        byte = f.read(1)
        f.seek(entry.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"tensor 'layers.2.mlp.down_proj.weight#lo' in .*weights.*"
                                              r"safetensors: sha256 .* does not match the manifest"):
        from_container(box, device="cpu")
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        ninfer_gen.load(box, device="cpu")
    unchecked = from_container(box, device="cpu", verify=False)          # loads, with the altered byte
    good = from_container(converted["text"][1], device="cpu")
    lo = "layers.2.mlp.down_proj.weight"
    assert not torch.equal(unchecked.matrices[lo]["lo"], good.matrices[lo]["lo"])


def test_truncated_or_missing_shard_is_refused_even_unverified(converted, tmp_path):
    box = _copy(converted["sharded"][1], tmp_path)
    shard = box / json.loads((box / MANIFEST).read_text())["shards"][-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"cannot read safetensors file .*{shard.name}: truncated: tensor"):
        from_container(box, device="cpu", verify=False)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{shard.name}' .* is missing"):
        from_container(box, device="cpu", verify=False)


def test_other_format_version_layout_or_spec_is_refused(converted, tmp_path):
    box = _copy(converted["tied"][1], tmp_path)
    _edit_manifest(box, lambda m: m.update(format_version=99))
    with pytest.raises(CheckpointError, match=rf"format version 99; this ninfer-gen reads version {FORMAT_VERSION}"):
        open_container(box)
    _edit_manifest(box, lambda m: m.update(format_version=FORMAT_VERSION, layout="0" * 64))
    with pytest.raises(CheckpointError, match="another device layout .*weight_layout.py changed"):
        open_container(box)
    shutil.copy(converted["tied"][1] / MANIFEST, box / MANIFEST)
    spec = yaml.safe_load((box / SPEC_FILE).read_text())
    spec["quantization"]["mlp_down"] = "q6g64"
    (box / SPEC_FILE).write_text(yaml.safe_dump(spec))
    with pytest.raises(CheckpointError, match=r"not the spec this container was converted for .*"
                                              r"quantization.mlp_down: 'q6g64' vs 'q5g64'"):
        open_container(box)
    other = dict(spec_dict(open_container(converted["tied"][1]).spec), name="other")
    other["model"]["rms_norm_eps"] = 1e-5
    with pytest.raises(CheckpointError, match=r"converted for spec 'tied', not 'other' .*model.rms_norm_eps: "
                                              r"1e-05 vs 1e-06"):
        open_container(converted["tied"][1], spec=spec_from_dict(other))


def test_copied_files_are_checked_and_mtp_is_required_for_drafting(tmp_path):
    source = Path(shutil.copytree(checkpoint_cases.hf_layouts()["tied"], tmp_path / "src"))
    for name, text in [("tokenizer_config.json", "{}"), ("chat_template.jinja", "{{ messages }}"),
                       ("draft_vocab.json", "[1, 2, 3]"), ("generation_config.json", '{"eos_token_id": 7}')]:
        (source / name).write_text(text)
    box = tmp_path / "box"
    report = convert_checkpoint(source, box, device="cpu")
    assert {"chat_template.jinja", "draft_vocab.json", "generation_config.json", "tokenizer_config.json",
            "config.json"} <= set(report["files"])
    assert (box / "draft_vocab.json").read_text() == "[1, 2, 3]" and ninfer_gen.load(box, device="cpu").eos_ids == {7}
    (box / "chat_template.jinja").write_text("{{ changed }}")
    with pytest.raises(CheckpointError, match=r"chat_template.jinja: sha256 does not match the manifest"):
        ninfer_gen.load(box, device="cpu")
    assert ninfer_gen.load(box, device="cpu", verify=False).spec.model.mtp.num_layers == 1


def test_container_without_mtp_refuses_drafting(tmp_path):
    from hf_fixtures import SHAPE_B, make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", SHAPE_B, 5, with_mtp=False).path
    convert_checkpoint(source, tmp_path / "box", device="cpu")
    assert ninfer_gen.load(tmp_path / "box", device="cpu").spec.model.mtp.num_layers == 0
    with pytest.raises(CheckpointError, match="holds no MTP layer .* drafting needs: decode without drafts"):
        ninfer_gen.load(tmp_path / "box", device="cpu", draft=2)


def test_convert_refuses_a_used_folder_and_leaves_nothing_when_it_fails(converted, tmp_path):
    source, box = converted["text"]
    with pytest.raises(CheckpointError, match="already exists and is not empty.*--force"):
        convert_checkpoint(source, box, device="cpu")
    bad = Path(shutil.copytree(source, tmp_path / "bad"))
    from safetensors.torch import load_file, save_file
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.3.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.3.self_attn.o_proj.weight"):
        convert_checkpoint(bad, tmp_path / "out", device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_cli_converts_and_runs_the_shipped_model(tmp_path, capsys):
    box = tmp_path / "small"
    assert main(["convert", str(SMALL), str(box)]) == 0
    out = capsys.readouterr().out
    assert f"{box}: " in out and "MTP layer: yes" in out and "tokenizer.json" in out
    argv = ["--prompt", "def fibonacci(n):", "--max-tokens", "8", "--device", "cpu", "--draft", "0"]
    assert main(["run", "--weights", str(SMALL), "--quantize", *argv]) == 0
    at_load = capsys.readouterr().out
    (box / "tokenizer.json").write_text((box / "tokenizer.json").read_text() + " ")   # JSON still, hash not
    assert main(["run", "--weights", str(box), *argv]) == 2
    assert "tokenizer.json: sha256 does not match the manifest" in capsys.readouterr().err
    assert main(["run", "--weights", str(box), "--no-verify", *argv]) == 0
    converted = capsys.readouterr()
    assert "(converted)" in converted.err and "8 new tokens" in converted.err
    assert converted.out == at_load and len(at_load) > len("def fibonacci(n):\n")
