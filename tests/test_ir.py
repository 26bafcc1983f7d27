"""IR: stable golden text of the tiny spec's graphs, typecheck, and tracing errors."""
import os
from pathlib import Path

import pytest

from compiler.ir import AVal, Eqn, Var
from compiler.typecheck import TypeError_, typecheck
from compiler.spec import load_spec
from compiler.trace import StatePools, trace

GOLDEN = Path(__file__).parent / "golden"
SPEC = Path(__file__).parent.parent / "model_specs" / "qwen3.8-tiny.yaml"
CASES = [("prefill", 1, 16), ("step", 2, 1), ("step", 2, 4), ("mtp", 2, 1)]


@pytest.fixture(scope="module")
def spec():
    return load_spec(SPEC)


def _graph(spec, entry, batch, tokens, kv="int8", act="bf16"):
    pools = StatePools(num_pages=16, num_slots=batch, pages_per_seq=8, kv_dtype=kv)
    return trace(spec, entry, batch, tokens, pools, act)


@pytest.mark.parametrize("entry,batch,tokens", CASES)
def test_golden_text(spec, entry, batch, tokens):
    text = str(_graph(spec, entry, batch, tokens)) + "\n"
    path = GOLDEN / f"qwen3.8-tiny.{entry}.b{batch}t{tokens}.txt"
    if os.environ.get("NINFER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; regenerate with NINFER_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"graph text changed for {path.name}"


def test_text_is_stable_across_traces(spec):
    assert str(_graph(spec, "step", 2, 4)) == str(_graph(spec, "step", 2, 4))


def test_per_call_values_are_inputs_not_constants(spec):
    g = _graph(spec, "step", 2, 4)
    assert set(g.inputs) == {"tokens", "pos", "block_table", "slots"}
    text = str(g)
    assert "%pos" in text and "%block_table" in text and "%slots" in text


def test_state_is_explicit(spec):
    g = _graph(spec, "step", 1, 1)
    assert {"gdn.0.state", "gdn.0.conv", "kv.3.codes", "kv.3.scales"} <= set(g.state)
    assert g.state["gdn.0.state"].aval == AVal((1, 6, 32, 32), "f32")
    assert "kv.3.values" in _graph(spec, "step", 1, 1, kv="bf16").state


def test_mtp_graph_uses_only_mtp_and_shared_weights(spec):
    g = _graph(spec, "mtp", 1, 3)
    assert all(w.startswith("mtp.") or w in ("embed_tokens.weight", "lm_head.weight") for w in g.weights)
    assert set(g.state) == {"kv.mtp.codes", "kv.mtp.scales"}


def test_typecheck_rejects_wrong_output_aval(spec):
    g = _graph(spec, "step", 1, 1)
    eqn = next(e for e in g.eqns if e.prim == "linear")
    eqn.outputs[0].aval = AVal((1, 7), eqn.outputs[0].aval.dtype)
    with pytest.raises(TypeError_, match="shape rule"):
        typecheck(g)


def test_typecheck_rejects_use_before_definition(spec):
    g = _graph(spec, "step", 1, 1)
    stray = Var(AVal((1, 128), "bf16"))
    g.eqns.insert(0, Eqn("silu", [stray], {}, [Var(AVal((1, 128), "bf16"))]))
    with pytest.raises(TypeError_, match="before it is defined"):
        typecheck(g)


def test_trace_errors(spec):
    with pytest.raises(ValueError, match="unknown entry point"):
        _graph(spec, "decode", 1, 1)
    with pytest.raises(ValueError, match="batch must be 1"):
        _graph(spec, "prefill", 2, 4)
