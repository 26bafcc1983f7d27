"""tools/synth_gguf: a random Q4_K_M-style GGUF of a spec's shape opens with our reader as that spec, holds
llama.cpp's type mix tensor by tensor, every tensor reads back (zero-mean blocks at random_weights' scale),
and the writer streams — the tensor table first, then one tensor in memory at a time. The 27B's file is
planned here (types, size, largest tensor) without writing it (lab/gguf_rss.py writes and measures it)."""
from __future__ import annotations

import json
import weakref
from collections import Counter
from pathlib import Path

import gguf
import pytest

from compiler.spec import load_spec, tensor_table
from gguf_fixtures import kquant_spec
from ninfer_gen.weights.checkpoint import dequantized
from ninfer_gen.weights.gguf_load import iter_tensors, open_gguf
from ninfer_gen.weights.gguf_synth import layer_of
from tools import synth_gguf
from tools.synth_gguf import Q4_K_M, matrix_std, plan, shape_mismatches, write_gguf

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
TINY = SPECS / "qwen3.8-tiny.yaml"


def _stored_types(g) -> dict[str, str]:
    return {name: t.tensor_type.name for name, t in g.entries.items()}


def _expected_types(spec) -> dict[str, str]:
    n = spec.model.layers.count
    return {t.name: Q4_K_M(t.name, t.shape, layer_of(t.name), n) for t in tensor_table(spec)}


def test_tool_writes_the_tiny_spec(tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    assert synth_gguf.main([str(out), "--spec", str(TINY)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = load_spec(TINY)
    g = open_gguf(out)
    assert r["mismatches"] == [] and shape_mismatches(g.spec.model, spec.model) == []
    assert g.spec.vision is None and r["bytes"] == out.stat().st_size and r["tensors"] == len(g.entries)
    assert _stored_types(g) == _expected_types(spec)
    # hidden 128: rows too short for a k-quant fall back to Q8_0; down_proj and o_proj (K = 256) stay k-quants
    assert g.entries["layers.3.self_attn.q_proj.weight"].tensor_type.name == "Q8_0"
    assert {"Q4_K", "Q6_K", "Q8_0", "BF16", "F32"} <= set(_stored_types(g).values())
    names = [name for name, _ in iter_tensors(g)]
    assert sorted(names) == sorted(g.entries) and len(names) == len(tensor_table(spec))


def test_kquant_widths_hold_the_whole_mix_at_the_drawn_scale(tmp_path):
    spec = kquant_spec()
    write_gguf(spec, tmp_path / "k.gguf")
    g = open_gguf(tmp_path / "k.gguf")
    types = _stored_types(g)
    assert types == _expected_types(spec) and set(types.values()) == {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "BF16", "F32"}
    assert types["lm_head.weight"] == "Q6_K" and types["layers.0.linear_attn.in_proj_qkv.weight"] == "Q5_K"
    assert g.spec.model.linear_attention.out_head_order == "tiled"        # k-quant out_proj keeps llama.cpp's order
    for name, value in iter_tensors(g):
        if types[name] in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"):
            w = dequantized({name: value})[name].float()
            std = matrix_std(spec, name, w.shape[1])
            assert abs(float(w.std()) / std - 1) < 0.15, name
            assert abs(float(w.mean())) < 0.1 * std, name                  # blocks centred, rows unlike


def test_writer_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The tensor table is written before any data, add_tensor (which holds every array until the end) is never
    used, and when a tensor is written every earlier one has been freed."""
    calls, alive = [], []

    def no_add_tensor(self, *a, **k):
        raise AssertionError("add_tensor keeps every tensor in memory until write_tensors_to_file")

    real_ti, real_data = gguf.GGUFWriter.write_ti_data_to_file, gguf.GGUFWriter.write_tensor_data

    def ti(self):
        calls.append("table")
        return real_ti(self)

    def data(self, tensor, *a, **k):
        assert calls and calls[0] == "table"
        assert all(r() is None for r in alive), "an earlier tensor is still in memory"
        alive.append(weakref.ref(tensor))
        calls.append("tensor")
        return real_data(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", no_add_tensor)
    monkeypatch.setattr(gguf.GGUFWriter, "write_ti_data_to_file", ti)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", data)
    r = write_gguf(kquant_spec(), tmp_path / "k.gguf")
    assert calls.count("tensor") == r["tensors"] == len(plan(kquant_spec()))


def test_the_27b_plan():
    """The 27B's file: every row fits its k-quant (no fallback), ≈ 17 GB, the Q6_K LM head the largest tensor."""
    spec = load_spec(SPECS / "qwen3.8-27b.yaml")
    entries = plan(spec)
    assert {e.kind for e in entries if e.name.startswith("mtp.") and len(e.shape) == 2} == {"Q8_0"}
    assert "Q8_0" not in {e.kind for e in entries if not e.name.startswith("mtp.")}
    assert all(e.name == "lm_head.weight" or e.name.endswith(("v_proj.weight", "down_proj.weight"))
               for e in entries if e.kind == "Q6_K")
    assert Counter(e.kind for e in entries)["Q4_K"] > 300
    assert {e.kind for e in entries if "in_proj_qkv" in e.name} == {"Q5_K"}
    largest = max(entries, key=lambda e: e.nbytes)
    assert (largest.gguf, largest.kind, largest.nbytes) == ("output.weight", "Q6_K", 248320 * 5120 // 256 * 210)
    assert sum(e.nbytes for e in entries) == pytest.approx(17.0e9, rel=0.01)
