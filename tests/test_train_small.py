"""Tests of tools/train_small: the CPU smoke run writes a loadable HF checkpoint whose logits match the
project's reference, whose tokenizer round-trips source text, and whose losses went down."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from compiler.model import reference_forward
from compiler.spec import tensor_table
from compiler.spec_hf import spec_from_hf_config
from tools.small_data import EOT, collect_corpus
from tools.small_export import INDEX_FILE, SHARD_LIMIT_BYTES, read_weights, write_weights
from tools.small_model import hf_config, init_params, model_spec
from tools.train_small import main

EXPECTED_FILES = ("config.json", "generation_config.json", "tokenizer.json", INDEX_FILE,
                  "training_metrics.json", "training_curve.json")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("small-smoke")
    metrics = main(["--smoke", "--out", str(out)])
    return out, metrics


def _source(rel: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text(encoding="utf-8")


def test_smoke_writes_the_hf_layout(smoke):
    out, _ = smoke
    for name in EXPECTED_FILES:
        assert (out / name).is_file(), name
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards and all((out / s).stat().st_size <= SHARD_LIMIT_BYTES for s in shards)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["mtp_num_hidden_layers"] == 1
    gen = json.loads((out / "generation_config.json").read_text())
    eot = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(EOT)
    assert gen["eos_token_id"] == config["eos_token_id"] == eot and gen["do_sample"] is False


def test_saved_tensors_match_the_spec_of_the_saved_config(smoke):
    out, _ = smoke
    spec = spec_from_hf_config(out / "config.json")
    assert list(spec.model.layers.kinds) == ["linear_attention"] * 3 + ["full_attention"]
    index = json.loads((out / INDEX_FILE).read_text())
    names = set(index["weight_map"])
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    assert all(n.startswith(("model.", "mtp.")) for n in names)   # tied: no lm_head.weight
    weights = read_weights(out)
    for t in tensor_table(spec):
        assert tuple(weights[t.name].shape) == t.shape, t.name
    assert len(weights) == len(tensor_table(spec))
    with safe_open(str(out / index["weight_map"]["model.embed_tokens.weight"]), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"


def test_hf_loads_the_checkpoint_and_matches_the_reference(smoke):
    transformers = pytest.importorskip("transformers")
    out, _ = smoke
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(EOT), *tok.encode(_source("json/decoder.py")).ids[:150]]  # > one GDN chunk
    tokens = torch.tensor([ids])
    spec = spec_from_hf_config(out / "config.json")
    with torch.no_grad():
        hf = model.eval()(input_ids=tokens, use_cache=False).logits
        ref = reference_forward(spec, read_weights(out), tokens)["logits"]
    assert ref.std() > 0.3          # trained away from flat logits
    torch.testing.assert_close(hf, ref, atol=1e-3, rtol=0)


def test_tokenizer_round_trips_source_text(smoke):
    out, _ = smoke
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for rel in ("json/decoder.py", "email/_header_value_parser.py", "argparse.py"):
        text = _source(rel)
        assert tok.decode(tok.encode(text).ids) == text, rel
    assert tok.encode(EOT).ids == [tok.token_to_id(EOT)]


def test_losses_went_down_and_metrics_are_reported(smoke):
    out, metrics = smoke
    t = metrics["training"]
    assert t["last_train_loss"] < t["first_train_loss"] - 0.3
    assert t["last_mtp_loss"] < t["first_mtp_loss"] - 0.3
    saved = json.loads((out / "training_metrics.json").read_text())
    for split in ("heldout", "valid"):
        assert 0 < saved[split]["bits_per_byte"] < 8 and 0 <= saved[split]["mtp_agreement"] <= 1
    curve = json.loads((out / "training_curve.json").read_text())
    assert any("heldout_bits_per_byte" in r for r in curve) and any("mtp_loss" in r for r in curve)


def test_corpus_excludes_tests_and_holds_out_json_and_email():
    corpus = collect_corpus()
    train = [d.path for d in corpus.train]
    assert not any(p.split("/")[0] in ("test", "idlelib", "json", "email", "site-packages") for p in train)
    assert not any("/tests/" in p or "/test/" in p for p in train)
    assert {d.path.split("/")[0] for d in corpus.heldout} == {"json", "email"}
    hashes = [hash(d.text) for d in corpus.train + corpus.heldout]
    assert len(hashes) == len(set(hashes))


def test_sharding_splits_and_reads_back(tmp_path):
    spec = model_spec(hf_config("tiny", 512, 0))
    params = init_params(spec, seed=1)
    shards = write_weights(tmp_path, spec, params, limit=400_000)
    assert len(shards) > 2 and all(s.stat().st_size <= 400_000 for s in shards)
    back = read_weights(tmp_path)
    assert back["layers.0.linear_attn.A_log"].equal(params["layers.0.linear_attn.A_log"])   # fp32 kept
    torch.testing.assert_close(back["mtp.fc.weight"], params["mtp.fc.weight"], atol=1e-3, rtol=1e-2)
