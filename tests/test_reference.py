"""Reference backend: chunked prefill, decode and batched steps all give the logits of one full
forward; eager and traced programs agree; INT8 KV and bf16 stay close; sampling is seeded."""
from pathlib import Path

import numpy as np
import pytest
import torch

import ninfer_gen
from compiler.model import reference_forward

SPEC = Path(__file__).parent.parent / "model_specs" / "qwen3.8-tiny.yaml"
IDS = [int(x) for x in np.random.default_rng(7).integers(0, 512, 150)]


@pytest.fixture(scope="module")
def model():
    return ninfer_gen.load(SPEC, device="cpu")


@pytest.fixture(scope="module")
def full(model):
    return model.forward_logits(IDS)


def test_logits_are_not_flat(full):
    assert full.shape == (150, 512) and full.std() > 1.0


@pytest.mark.parametrize("chunk", [64, 37, 7])
def test_chunked_prefill_equals_whole(model, full, chunk):
    np.testing.assert_allclose(model.forward_logits(IDS, chunk_size=chunk), full, atol=1e-4, rtol=0)


def test_prefill_then_decode_equals_full_forward(model, full):
    b = model.backend
    seq = b.new_sequence()
    logits, _ = b.prefill(seq, IDS[:130], chunk=64)
    rows = [logits]
    for token in IDS[130:]:
        step, _ = b.run("step", [seq], [[token]])
        rows.append(step)
    b.release(seq)
    np.testing.assert_allclose(torch.cat(rows).numpy(), full, atol=1e-4, rtol=0)


def test_verify_step_of_several_tokens(model, full):
    b = model.backend
    seq = b.new_sequence()
    b.prefill(seq, IDS[:120])
    verify, _ = b.run("step", [seq], [IDS[120:124]])  # T = K+1 = 4 tokens in one step
    b.release(seq)
    np.testing.assert_allclose(verify.numpy(), full[120:124], atol=1e-4, rtol=0)


def test_batched_rows_are_independent(model, full):
    b = model.backend
    a, c = b.new_sequence(), b.new_sequence()
    b.prefill(a, IDS[:60])
    b.prefill(c, IDS[:90])
    both, _ = b.run("step", [a, c], [[IDS[60]], [IDS[90]]])
    b.release(a)
    b.release(c)
    np.testing.assert_allclose(both[0].numpy(), full[60], atol=1e-4, rtol=0)
    np.testing.assert_allclose(both[1].numpy(), full[90], atol=1e-4, rtol=0)


def test_eager_program_matches_traced_graph(model, full):
    out = reference_forward(model.spec, model.backend.weights, torch.tensor([IDS]))
    np.testing.assert_allclose(out["logits"][0].numpy(), full, atol=1e-4, rtol=0)
    mtp = model.mtp_logits(IDS)
    np.testing.assert_allclose(out["mtp_logits"][0].numpy(), mtp[:-1], atol=1e-4, rtol=0)


def test_mtp_last_row_uses_the_models_own_next_token(model, full):
    mtp = model.mtp_logits(IDS)
    greedy = int(full[-1].argmax())
    out = reference_forward(model.spec, model.backend.weights, torch.tensor([IDS + [greedy]]))
    np.testing.assert_allclose(out["mtp_logits"][0, -1].numpy(), mtp[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kw,rel_tol,agree", [({"kv_dtype": "int8"}, 3e-3, 0.97),
                                              ({"kv_dtype": "bf16"}, 1e-3, 0.99),
                                              ({"dtype": "bfloat16"}, 4e-2, 0.9)])
def test_reduced_precision_stays_close(full, kw, rel_tol, agree):
    other = ninfer_gen.load(SPEC, device="cpu", **kw).forward_logits(IDS, chunk_size=48)
    assert np.linalg.norm(other - full) / np.linalg.norm(full) < rel_tol
    assert (other.argmax(-1) == full.argmax(-1)).mean() >= agree


def test_generate_is_greedy_continuation(model, full):
    new = model.generate(IDS[:149], 3)
    assert new[0] == int(full[148].argmax())
    extended = model.forward_logits(IDS[:149] + new[:2])
    assert new[1:] == [int(extended[-2].argmax()), int(extended[-1].argmax())]


def test_sampling_is_seeded_and_stops(model):
    a = model.generate(IDS[:20], 12, greedy=False, temperature=1.0, top_k=40, top_p=0.9, seed=3)
    b = model.generate(IDS[:20], 12, greedy=False, temperature=1.0, top_k=40, top_p=0.9, seed=3)
    assert a == b and len(a) == 12
    stop = model.generate(IDS[:20], 12, stop_tokens={a[4]})
    greedy = model.generate(IDS[:20], 12)
    assert stop == greedy[:greedy.index(a[4]) + 1] if a[4] in greedy else stop == greedy


def test_context_limit_is_a_clear_error(model):
    too_long = [1] * (model.backend.max_context + 1)
    with pytest.raises(ValueError, match="context limit"):
        model.forward_logits(too_long)
    assert model.backend.slots.free_slots == model.backend.slots.num_slots  # the failed sequence gave its slot back
    assert model.backend.blocks.free_pages == model.backend.blocks.num_pages


def test_generate_stops_at_stop_tokens_budgets_and_the_context_limit(model):
    """Model.generate (a one-lane engine): a stop token ends the output at once, 0 and 1 token budgets, and a
    prompt 25 positions short of the context gets its first token and 25 more."""
    plain = model.generate(IDS[:20], 40)
    stop = plain[20]
    assert model.generate(IDS[:20], 40, stop_tokens={stop}) == plain[:plain.index(stop) + 1]
    assert model.generate(IDS[:20], 0) == [] and model.generate(IDS[:20], 1) == plain[:1]
    near = model.backend.max_context - 25
    assert len(model.generate([1] * near, 40)) == 26


def test_precision_tool_measures_the_bf16_spread(capsys):
    """lab.precision without a GPU: the interpreter's bf16 mode and the floor (only the GEMM inputs in
    bf16) against its fp32 mode, per position; the floor rounds a subset of bf16's values, so it is closer."""
    from lab.precision import main, rel_l2
    out = main(["--no-gpu", "--positions", "24", "--token-seeds", "1"])
    assert list(out["runs"][1]) == ["ref-bf16 vs ref-f32", "floor vs ref-f32"]
    s, floor = out["runs"][1].values()
    assert 0 < s["mean"] <= s["p99"] <= s["max"] < 0.2
    assert 0 < floor["mean"] < s["mean"]
    assert all(0 <= pos < 24 for pos, _ in s["worst"]) and s["worst"][0][1] == round(s["max"], 4)
    assert "rel-L2 max" in capsys.readouterr().out
    x = torch.randn(3, 8, dtype=torch.float64)
    assert rel_l2(x, x).abs().max() == 0 and torch.allclose(rel_l2(2 * x, x), torch.ones(3, dtype=torch.float64))
