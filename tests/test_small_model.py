"""The small trained model shipped in models/: the default of `load()`, HF transformers agrees with
our reference on it, and it predicts held-out Python (the json package) well."""
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import ninfer_gen
from ninfer_gen.api import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="no shipped model")
SNIPPET = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py").read_text()[:2400]


@pytest.fixture(scope="module")
def model():
    return ninfer_gen.load(device="cpu")


def test_default_load_is_the_shipped_model(model):
    assert Path(model.source) == DEFAULT_MODEL and model.tokenizer.name.endswith("tokenizer.json")


def test_hf_transformers_matches_reference(model):
    from transformers import AutoModelForCausalLM

    ids = model.tokenizer.encode(SNIPPET)[:96]
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = model.forward_logits(ids)
    assert ref.std() > 1.0
    assert np.abs(ours - ref).max() <= 1e-3


def test_held_out_bits_per_byte_and_mtp_agreement(model):
    eot = next(iter(model.eos_ids))
    ids = [eot] + model.tokenizer.encode(SNIPPET)
    ids = ids[:512]
    logits = model.forward_logits(ids[:-1]).astype(np.float64)
    targets = np.array(ids[1:])
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nats = float((lse - logits[np.arange(len(targets)), targets]).sum())
    n_bytes = len(model.tokenizer.decode(ids[1:]).encode())
    assert nats / math.log(2) / n_bytes <= 1.6
    agree = (model.mtp_logits(ids[:-1])[:-1].argmax(-1) == logits[1:].argmax(-1)).mean()
    assert agree >= 0.45
