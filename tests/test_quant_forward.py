"""Forward with dequantised weights vs the original weights, within stated tolerances.

Stated tolerances (relative L2 of the logits over 100 positions of the tiny spec with O(1) random
weights, every matrix in one format): W8G32 ≤ 0.05, Q6G64 ≤ 0.2, Q5G64 ≤ 0.4, Q4G64 ≤ 0.7; the error
roughly doubles per bit removed. A random network amplifies weight noise far more than a trained one
(see lab/NOTES.md for the trained small model's figure)."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import ninfer_gen
from compiler.spec import load_spec

SPEC = load_spec(Path(__file__).parent.parent / "model_specs" / "qwen3.8-tiny.yaml")
IDS = [int(x) for x in np.random.default_rng(7).integers(0, 512, 100)]
MATRIX_ROLES = ("embed", "lm_head", "attn_q", "attn_k", "attn_v", "attn_o", "gdn_qkv", "gdn_z", "gdn_out",
                "mlp_gate_up", "mlp_down", "mtp")
TOLERANCE = {"w8g32": 0.05, "q6g64": 0.2, "q5g64": 0.4, "q4g64": 0.7}


def _rel_error(fmt: str, full: np.ndarray) -> float:
    recipe = dataclasses.replace(SPEC.quantization, **{role: fmt for role in MATRIX_ROLES})
    spec = dataclasses.replace(SPEC, quantization=recipe)
    logits = ninfer_gen.load(spec, device="cpu", quantize=True).forward_logits(IDS)
    return float(np.linalg.norm(logits - full) / np.linalg.norm(full))


@pytest.fixture(scope="module")
def errors():
    full = ninfer_gen.load(SPEC, device="cpu").forward_logits(IDS)
    return {fmt: _rel_error(fmt, full) for fmt in TOLERANCE}


@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_dequantised_forward_within_tolerance(errors, fmt):
    assert 0 < errors[fmt] <= TOLERANCE[fmt], f"{fmt}: relative logit error {errors[fmt]:.3f}"


def test_error_grows_about_twofold_per_bit(errors):
    assert 1.4 < errors["q5g64"] / errors["q6g64"] < 3.0
    assert errors["w8g32"] < errors["q6g64"] < errors["q5g64"] < errors["q4g64"]
