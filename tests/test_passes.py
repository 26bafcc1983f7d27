"""Passes: every fusion keeps the graph's results and state writes bit-identical, and fires where
it should."""
from collections import Counter
from pathlib import Path

import pytest
import torch

from compiler.interpret import run_graph
from compiler.ir import AVal, Eqn, Var
from compiler.options import CompileOptions
from compiler.passes import dead_code, pipeline, run_pipeline
from compiler.reference_ops import torch_dtype
from compiler.spec import load_spec
from compiler.trace import StatePools, state_avals, trace
from ninfer_gen.weights.random_weights import random_weights

SPEC = load_spec(Path(__file__).parent.parent / "model_specs" / "qwen3.8-tiny.yaml")
POOLS = StatePools(num_pages=16, num_slots=2, pages_per_seq=8, kv_dtype="int8")


def _state(seed):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dt) in state_avals(SPEC, POOLS).items():
        t = torch.randn(shape, generator=gen) if dt == "f32" else torch.zeros(shape)
        out[name] = t.to(torch_dtype(dt))
    return out


def _inputs(entry, batch, tokens):
    gen = torch.Generator().manual_seed(1)
    inp = {"tokens": torch.randint(0, 512, (batch, tokens), generator=gen, dtype=torch.int32),
           "pos": torch.tensor([3, 70][:batch], dtype=torch.int32),
           "block_table": torch.arange(batch * 8, dtype=torch.int32).reshape(batch, 8)}
    if entry == "mtp":
        inp["hidden"] = torch.randn(batch * tokens, 128, generator=gen)
    else:
        inp["slots"] = torch.arange(batch, dtype=torch.int32)
    return inp


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("entry,batch,tokens", [("step", 2, 1), ("step", 2, 4), ("prefill", 1, 20), ("mtp", 2, 2)])
def test_fused_graph_is_bit_identical(entry, batch, tokens):
    """Every pass but the norm fold (tested below to a tolerance: it reassociates) keeps the bits: the fused
    references make the unfused ones' torch calls in their order. On one thread, so the bits are ours and
    not a thread split's."""
    g = trace(SPEC, entry, batch, tokens, POOLS)
    fused = run_pipeline(g, CompileOptions(norm_fold=False))
    if entry != "mtp":               # the layer's q/k norm + RoPE + KV append became one equation
        assert Counter(e.prim for e in fused.eqns)["qk_rope_kv"] == 1
    weights = random_weights(SPEC)
    s1, s2 = _state(0), _state(0)
    o1 = run_graph(g, _inputs(entry, batch, tokens), weights, s1)
    o2 = run_graph(fused, _inputs(entry, batch, tokens), weights, s2)
    for k in o1:
        assert torch.equal(o1[k], o2[k]), k
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def test_fusions_fire_on_decode_graph():
    g = run_pipeline(trace(SPEC, "step", 1, 1, POOLS))
    counts = Counter(e.prim for e in g.eqns)
    layers = SPEC.model.layers.count
    # every residual add rides on a projection's epilogue; that projection also carries the next norm,
    # except the last (the final-norm hidden is an output), and layer 0's input norm reads the embedding
    assert counts["linear_residual_norm"] == 2 * layers - 1 and counts["linear_residual"] == 1
    assert counts["add"] == 0 and counts["add_rmsnorm"] == 0 and counts["rmsnorm"] == 2
    assert counts["scaled_linear_silu_mul"] == layers and counts["linear_silu_mul"] == 0 and counts["silu_mul"] == 0
    assert counts["gated_paged_attention"] == 1 and counts["sigmoid"] == 0 and counts["mul"] == 0
    assert counts["gdn_step"] == 3 and counts["gdn_gates"] == 0 and counts["gdn_recurrence"] == 0
    # the one-token conv rides on each GDN layer's qkv projection (layer 0's reads the plain norm)
    assert counts["gdn_conv"] == 0 and counts["linear_conv"] == 1 and counts["scaled_linear_conv"] == 2
    # the attention layer's q and k norm + RoPE and its KV append: one equation (the qk_rope_kv kernel)
    assert counts["qk_rope_kv"] == 1 and counts["norm_rope"] == counts["kv_append"] == counts["rope"] == 0
    assert "silu" not in counts


def test_add_rmsnorm_fuses_where_no_projection_takes_the_add():
    from compiler.passes import fuse_add_rmsnorm
    g = fuse_add_rmsnorm(trace(SPEC, "step", 1, 1, POOLS))
    assert Counter(e.prim for e in g.eqns)["add_rmsnorm"] == 2 * SPEC.model.layers.count


def test_dead_code_keeps_effects_and_drops_unused():
    g = trace(SPEC, "step", 1, 1, POOLS)
    x = g.inputs["pos"]
    unused = Eqn("positions", [x], {"tokens": 1}, [Var(AVal((1,), "i32"))])
    g.eqns.append(unused)
    pruned = dead_code(g)
    assert unused not in pruned.eqns
    assert sum(e.prim == "kv_append" for e in pruned.eqns) == 1


def test_pipeline_is_ordered_and_pure():
    g = trace(SPEC, "step", 1, 1, POOLS)
    before = str(g)
    run_pipeline(g)
    assert str(g) == before
    assert pipeline()[-1] is dead_code
    folds = {p.__name__ for p in pipeline()} - {p.__name__ for p in pipeline(CompileOptions(norm_fold=False,
                                                                                          conv_fold=False))}
    assert folds == {"fold_norms_into_projections", "fold_conv_into_projection"}


@pytest.mark.parametrize("entry,batch,tokens", [("step", 1, 1), ("step", 2, 4), ("mtp", 2, 2)])
def test_norm_fold_is_the_norm_to_rounding(entry, batch, tokens):
    """The fold moves each norm's scale past the projections reading it: in fp32 the logits, the hidden
    and every state write agree with the unfolded graph to rounding (~1e-6), and the fold fired."""
    g = trace(SPEC, entry, batch, tokens, POOLS)
    fused = run_pipeline(g)
    counts = Counter(e.prim for e in fused.eqns)
    assert counts["linear_residual_norm"] >= 1 and counts["scaled_linear"] + counts["scaled_linear_silu_mul"] >= 1
    weights = random_weights(SPEC)
    s1, s2 = _state(0), _state(0)
    o1 = run_graph(g, _inputs(entry, batch, tokens), weights, s1)
    o2 = run_graph(fused, _inputs(entry, batch, tokens), weights, s2)
    for k in (*o1, *s1):
        a, b = (o1[k], o2[k]) if k in o1 else (s1[k], s2[k])
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err < 1e-5, (k, err)


def test_norm_fold_stays_out_of_prefill_and_can_be_turned_off():
    for entry, batch, tokens in (("prefill", 1, 20), ("step", 8, 5)):       # prefill; more than 32 rows
        counts = Counter(e.prim for e in run_pipeline(trace(SPEC, entry, batch, tokens, POOLS)).eqns)
        assert counts["linear_residual_norm"] == counts["scaled_linear"] == 0, (entry, batch, tokens)
    counts = Counter(e.prim for e in run_pipeline(trace(SPEC, "step", 1, 1, POOLS), CompileOptions(norm_fold=False)).eqns)
    assert counts["linear_residual_norm"] == 0 and counts["rmsnorm"] == 2 * SPEC.model.layers.count + 1


def test_conv_fold_only_for_one_token_steps():
    for entry, batch, tokens in (("step", 2, 4), ("prefill", 1, 20)):
        counts = Counter(e.prim for e in run_pipeline(trace(SPEC, entry, batch, tokens, POOLS)).eqns)
        assert counts["gdn_conv"] == 3 and counts["linear_conv"] == counts["scaled_linear_conv"] == 0
    counts = Counter(e.prim for e in run_pipeline(trace(SPEC, "step", 2, 1, POOLS), CompileOptions(conv_fold=False)).eqns)
    assert counts["gdn_conv"] == 3 and counts["scaled_linear_conv"] == 0
