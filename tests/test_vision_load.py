"""The vision tower through loading: an HF VLM checkpoint's `model.visual.*` loads under `visual.*` (checked
against the spec's vision tensor table; `vision=False` drops it, the GPU paths skip it), `convert` carries it
bit for bit with its hashes, a broken tower is an error naming the tensor, and `run --image` end to end."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ninfer_gen
from compiler.spec import load_spec, tensor_table, vision_tensor_table
from ninfer_gen.cli import main
from ninfer_gen.executor.device_weights import from_checkpoint, from_container
from ninfer_gen.weights.checkpoint import CheckpointError, load_checkpoint
from ninfer_gen.weights.container import MANIFEST, load_host, open_container
from ninfer_gen.weights.convert import convert_checkpoint
from ninfer_gen.weights.random_weights import random_weights
from vision_fixtures import hf_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "model_specs" / "qwen3.8-tiny.yaml")
TINY_VL = str(ROOT / "model_specs" / "qwen3.8-tiny-vl.yaml")
FILE = "model.safetensors"


def _hf_name(name: str) -> str:
    """Where the HF Qwen3.5 conditional-generation layout stores a canonical tensor."""
    if name.startswith("visual."):
        return "model." + name
    return name if name.startswith(("lm_head.", "mtp.")) else "model.language_model." + name


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """(folder, canonical name → the tensor as written): a tiny-vl HF checkpoint, the text model in fp32 and the
    tower in bf16 (as released checkpoints store it)."""
    spec = load_spec(TINY_VL)
    tensors = random_weights(spec, seed=3)
    tower = {t.name for t in vision_tensor_table(spec)}
    written = {n: t.to(torch.bfloat16) if n in tower else t for n, t in tensors.items()}
    path = tmp_path_factory.mktemp("vl") / "qwen3.8-tiny-vl-hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(spec).to_dict()))
    save_file({_hf_name(n): t.contiguous() for n, t in written.items()}, str(path / FILE))
    return path, written


def _tower(tensors) -> dict:
    return {n: t for n, t in tensors.items() if n.startswith("visual.")}


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / FILE)
    edit(tensors)
    save_file(tensors, str(dst / FILE))
    return dst


def test_checkpoint_loads_the_tower_and_vision_false_drops_it(vl_checkpoint):
    path, written = vl_checkpoint
    model = ninfer_gen.load(path, device="cpu")
    assert model.vision and model.spec.vision == load_spec(TINY_VL).vision
    want = _tower(written)
    assert set(_tower(model.backend.weights)) == set(want) == {t.name for t in vision_tensor_table(model.spec)}
    for name, t in want.items():
        assert torch.equal(model.backend.weights[name].cpu(), t.float()), name
    quantised = ninfer_gen.load(path, device="cpu", quantize=True)      # the recipe keeps the tower bf16
    assert all(torch.equal(quantised.backend.weights[n].cpu(), t.float()) for n, t in want.items())

    text = ninfer_gen.load(path, device="cpu", vision=False)
    assert text.spec.vision is None and not text.vision and not _tower(text.backend.weights)
    assert set(text.backend.weights) == {t.name for t in tensor_table(text.spec)}
    with pytest.raises(ValueError, match="vision must be True or False"):
        ninfer_gen.load(path, device="cpu", vision="no")


def test_device_loads_skip_the_tower(vl_checkpoint):
    """The GPU's streaming path (here on the CPU) reads no tower tensor: the spec keeps its vision section
    (the GPU refuses images itself), or drops it when asked."""
    path, _ = vl_checkpoint
    skipped = from_checkpoint(path, device="cpu")
    assert skipped.spec.vision is not None and not any("visual" in n for n in skipped.tensors)
    assert from_checkpoint(path, device="cpu", vision="drop").spec.vision is None
    with pytest.raises(ValueError, match="no vision tower"):
        from_checkpoint(path, device="cpu", vision="load")


def test_convert_carries_the_tower_bit_for_bit(vl_checkpoint, tmp_path):
    path, written = vl_checkpoint
    box = tmp_path / "box"
    summary = convert_checkpoint(path, box, device="cpu")
    assert summary["vision"]
    manifest = json.loads((box / MANIFEST).read_text())
    planes = {k: v for k, v in manifest["tensors"].items() if k.startswith("visual.")}
    assert len(planes) == len(vision_tensor_table(load_spec(TINY_VL)))
    assert all(v["dtype"] == "BF16" and len(v["sha256"]) == 64 for v in planes.values())
    spec, host = load_host(box)
    assert spec.vision == load_spec(TINY_VL).vision
    for name, t in _tower(written).items():
        assert host[name].dtype == torch.float32 and torch.equal(host[name], t.float()), name
    model = ninfer_gen.load(box, device="cpu")
    assert model.vision
    device = from_container(box, device="cpu")
    assert device.spec.vision is not None and not any("visual" in n for n in device.tensors)
    text_spec, text = load_host(box, vision="drop")
    assert text_spec.vision is None and not _tower(text)

    entry = open_container(box).entries["visual.pos_embed.weight#tensor"]       # hashes cover the tower
    with open(entry.path, "r+b") as f:
        f.seek(entry.offset + 3)
        byte = f.read(1)
        f.seek(entry.offset + 3)
        f.write(bytes([byte[0] ^ 0x04]))
    with pytest.raises(CheckpointError, match=r"visual.pos_embed.weight#tensor.*does not match the manifest"):
        load_host(box)
    assert load_host(box, vision="drop")[0].vision is None          # an unread tower is not checked


def test_broken_tower_is_an_error_naming_the_tensor(vl_checkpoint, tmp_path):
    path, _ = vl_checkpoint
    missing = _rewrite(path, tmp_path / "missing", lambda t: t.pop("model.visual.blocks.1.mlp.linear_fc2.bias"))
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): visual.blocks.1.mlp.linear_fc2.bias.*"
                                              r"--no-vision"):
        load_checkpoint(missing)
    assert load_checkpoint(missing, vision="drop")[0].vision is None       # text only still loads

    def reshape(t):
        t["model.visual.pos_embed.weight"] = t["model.visual.pos_embed.weight"][:49].contiguous()
    bad = _rewrite(path, tmp_path / "shape", reshape)
    with pytest.raises(CheckpointError, match=r"wrong shape: visual.pos_embed.weight \(expected \[64, 64\], "
                                              r"got \[49, 64\]\)"):
        ninfer_gen.load(bad, device="cpu")
    with pytest.raises(CheckpointError, match="visual.pos_embed.weight"):
        convert_checkpoint(bad, tmp_path / "box", device="cpu")


def test_checkpoint_without_a_tower_loads_text_only_saying_so(vl_checkpoint, tmp_path, capsys):
    path, _ = vl_checkpoint
    bare = _rewrite(path, tmp_path / "bare", lambda t: [t.pop(k) for k in list(t) if k.startswith("model.visual.")])
    spec, tensors = load_checkpoint(bare)
    assert spec.vision is None and not _tower(tensors)
    err = capsys.readouterr().err
    assert err.count("stores no model.visual.* tensors: loading the text model only") == 1


# ---------------------------------------------------------------- run --image

@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from vision_fixtures import make_images

    root = tmp_path_factory.mktemp("images")
    good = root / "a.png"
    make_images(0)[0].save(good)
    bad = root / "bad.png"
    bad.write_bytes(good.read_bytes()[:60])
    return good, bad


def test_run_image_end_to_end(images, capsys):
    good, _ = images
    argv = ["run", "--weights", TINY_VL, "--image", str(good), "--prompt", "abc", "--max-tokens", "4",
            "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("abc") and "4 new tokens" in out.err
    assert "[vision tower: 2 blocks, " in out.err and "bf16]" in out.err and "[1 image: " in out.err
    assert main(argv[:5] + ["--image", str(good), "--prompt", "de", "--json", *argv[5:]]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["finish"] for x in lines] == ["length", "length"] and all(len(x["tokens"]) == 4 for x in lines)
    assert lines[0]["prompt_tokens"] > 2 * 60          # both images' placeholder blocks, then the text


@pytest.mark.parametrize("weights,extra,message", [
    (TINY_VL, ["--image", "BAD"], "error: image 1: "),
    (TINY_VL, ["--image", "missing.png"], "error: image 1: no such file"),
    (TINY_VL, ["--image", "GOOD", "--no-vision"], "error: --image needs the model's vision tower"),
    (TINY, ["--image", "GOOD"], "error: model qwen3.8-tiny has no vision tower: it takes text only"),
])
def test_run_image_errors(images, capsys, weights, extra, message):
    extra = [str({"GOOD": images[0], "BAD": images[1]}.get(x, x)) for x in extra]
    assert main(["run", "--weights", weights, "--prompt", "x", "--max-tokens", "2", "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_run_no_vision_says_so(capsys):
    argv = ["run", "--weights", TINY_VL, "--no-vision", "--prompt", "x", "--max-tokens", "2", "--device", "cpu"]
    assert main(argv) == 0
    assert "[vision tower not loaded (--no-vision): images are refused]" in capsys.readouterr().err


def test_vision_kernels_is_refused_where_it_cannot_run():
    """`vision_kernels` runs the tower's compiled plans on the GPU: with the reference backend or without the tower
    the load refuses it, naming why."""
    from ninfer_gen.api import LoadOptions

    for fields in ({"vision_kernels": True}, {"vision_kernels": True, "backend": "gpu", "vision": False}):
        with pytest.raises(ValueError, match="vision_kernels runs the vision tower's compiled plans"):
            LoadOptions(**fields)
    assert LoadOptions(backend="gpu", vision_kernels=True).vision_kernels
