"""test_hf_parity: the reference backend against HF transformers (fp32, CPU) on tiny random checkpoints
in both checkpoint layouts: logits, greedy generation and the MTP head.

The first tests check the fixtures themselves, so a failure below them points at the backend.
"""
import copy
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

import ninfer_gen
from hf_fixtures import (SHAPE_A, SHAPE_B, HFCheckpoint, build_hf_model, hf_decode_gaps, hf_generate, hf_logits,
                         hf_mtp_reference, make_hf_checkpoint, make_mtp_state, random_prompt, safe_prefix,
                         top2_gaps)

TOL = 1e-3            # max |Δ logit| against HF fp32
MARGIN = 1e-2         # a greedy step counts only if HF's top-2 gap is 10× the tolerance
MIN_STD = 1.0         # logits flatter than this would let a wrong model pass
GEN_TOKENS = 40
MIN_COMPARED = 32
LENGTHS = [20, 200]   # 200 > 128: several 64-token chunks in HF's chunked GDN path
GEN_PROMPT_SEED = 102  # picked so that HF's greedy run has no near-tie in the first 32 steps

# shape -> (dims, weight seed); case -> (shape, layout). The two layouts of a shape hold the same weights.
SHAPES = {"A": (SHAPE_A, 1), "B": (SHAPE_B, 1)}
CASES = {"A-text": ("A", "text"), "A-vlm": ("A", "vlm"), "B-text": ("B", "text"), "B-vlm": ("B", "vlm")}
pytestmark = pytest.mark.usefixtures("one_thread_module")     # tiny ops: one torch thread (conftest)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    shape, layout = CASES[request.param]
    dims, seed = SHAPES[shape]
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), dims, seed, layout)


@pytest.fixture(scope="module", params=list(SHAPES))
def weights(request):
    """The in-memory HF model and MTP tensors of a shape, for properties that do not depend on files."""
    dims, seed = SHAPES[request.param]
    model = build_hf_model(dims, seed)
    return HFCheckpoint(None, model, make_mtp_state(model.config, seed))


@pytest.fixture(scope="module")
def engine(checkpoint):
    return ninfer_gen.load(str(checkpoint.path), backend="reference", dtype="float32")


def _vocab(checkpoint) -> int:
    return checkpoint.model.config.vocab_size


def _max_err(ours, ref) -> tuple[float, str]:
    """Largest |Δ| and where it is, so a failure names the first place to look."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - ref)
    row, col = np.unravel_index(int(diff.argmax()), diff.shape)
    return float(diff.max()), f"max |Δ| {diff.max():.3e} at row {row}, col {col} (of {diff.shape})"


# ---------------------------------------------------------------- the fixtures themselves

def test_fixture_reloads_in_hf(checkpoint):
    """HF reads the folder back (mtp.* ignored; the VLM layout through the VLM class) with the same logits."""
    vlm = "text_config" in json.loads((checkpoint.path / "config.json").read_text())
    cls = Qwen3_5ForConditionalGeneration if vlm else AutoModelForCausalLM
    reloaded = cls.from_pretrained(checkpoint.path, dtype=torch.float32).eval()
    prompt = random_prompt(_vocab(checkpoint), 20, 20)
    with torch.no_grad():
        got = reloaded(input_ids=torch.tensor([prompt])).logits[0].numpy()
    err, where = _max_err(got, hf_logits(checkpoint.model, prompt))
    assert err <= 1e-6, where


@pytest.mark.parametrize("length", LENGTHS)
def test_fixture_logits_not_flat(weights, length):
    prompt = random_prompt(_vocab(weights), length, length)
    assert hf_logits(weights.model, prompt).std() >= MIN_STD
    assert hf_mtp_reference(weights.model, weights.mtp, prompt).std() >= MIN_STD


def test_fixture_fp32_close_to_fp64(weights):
    """A strong GDN decay would make HF's own fp32 rounding as large as the tolerance (MODEL.md)."""
    prompt = random_prompt(_vocab(weights), max(LENGTHS), max(LENGTHS))
    model64 = copy.deepcopy(weights.model).double()
    with torch.no_grad():
        ref64 = model64(input_ids=torch.tensor([prompt])).logits[0].numpy()
    err, where = _max_err(hf_logits(weights.model, prompt), ref64)
    assert err <= 3e-4, where


def test_mtp_reference_is_causal(weights):
    """Rows 0..T−3 of the MTP reference must not see later tokens (its attention mask is ours to get right)."""
    prompt = random_prompt(_vocab(weights), 40, 40)
    short = hf_mtp_reference(weights.model, weights.mtp, prompt[:30])
    full = hf_mtp_reference(weights.model, weights.mtp, prompt)
    err, where = _max_err(short[:-1], full[:29])
    assert err <= 1e-4, where      # a leak through the mask moves logits by O(1); rounding by ~1e-5


# ---------------------------------------------------------------- reference backend vs HF

@pytest.mark.parametrize("length", LENGTHS)
def test_forward_logits_match_hf(checkpoint, engine, length):
    prompt = random_prompt(_vocab(checkpoint), length, length)
    ref = hf_logits(checkpoint.model, prompt)
    ours = np.asarray(engine.forward_logits(prompt))
    assert ours.shape == ref.shape
    assert ref.std() >= MIN_STD
    err, where = _max_err(ours, ref)
    assert err <= TOL, where


def test_greedy_generate_matches_hf(checkpoint, engine):
    prompt = random_prompt(_vocab(checkpoint), 20, GEN_PROMPT_SEED)
    ref = hf_generate(checkpoint.model, prompt, GEN_TOKENS)
    compared = safe_prefix(hf_decode_gaps(checkpoint.model, prompt, ref), MARGIN)
    assert compared >= MIN_COMPARED, f"near-tie at step {compared}: pick another GEN_PROMPT_SEED"
    ours = list(engine.generate(prompt, GEN_TOKENS, greedy=True))
    assert len(ours) == GEN_TOKENS
    first = next((i for i in range(compared) if ours[i] != ref[i]), None)
    assert first is None, f"first mismatch at step {first}: ours {ours[:compared]} vs HF {ref[:compared]}"


@pytest.mark.parametrize("length", LENGTHS)
def test_mtp_logits_match_reference(checkpoint, engine, length):
    prompt = random_prompt(_vocab(checkpoint), length, length)
    # The last row feeds the main model's argmax; a near-tie there would make it ambiguous.
    assert top2_gaps(hf_logits(checkpoint.model, prompt)[-1:])[0] >= MARGIN
    ref = hf_mtp_reference(checkpoint.model, checkpoint.mtp, prompt)
    ours = np.asarray(engine.mtp_logits(prompt))
    assert ours.shape == ref.shape
    err, where = _max_err(ours[:-1], ref[:-1])
    assert err <= TOL, f"teacher-forced rows: {where}"
    err, where = _max_err(ours[-1:], ref[-1:])
    assert err <= TOL, f"last row (main argmax as next token): {where}"
