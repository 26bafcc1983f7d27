"""GGUF loading on the CPU: metadata → spec, llama.cpp's tensor layout undone, the reference backend on a
GGUF's own formats equal to the same weights (dequantised by the `gguf` package) loaded as an HF
checkpoint, the tokenizer and chat template from the metadata, and one clear error per bad file."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gguf_fixtures import CHAT_TEMPLATE, kquant_spec, q4_k_m, uniform, write_gguf, write_hf_checkpoint
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.checkpoint import CheckpointError, dequantized, load_checkpoint
from ninfer_gen.weights.gguf_load import GGUFError, is_gguf, load_gguf, open_gguf

PROMPT = [5, 97, 300, 17, 259, 44, 101, 480, 3, 260, 77, 12]


def _greedy(spec, weights, prompt, n=8):
    backend = ReferenceBackend(spec, weights, device="cpu")
    seq = backend.new_sequence()
    logits, _ = backend.prefill(seq, list(prompt), None, all_logits=True)
    first = logits.float().numpy()
    tokens = [int(torch.argmax(logits[-1]))]
    while len(tokens) < n:
        step, _ = backend.run("step", [seq], [[tokens[-1]]])
        tokens.append(int(torch.argmax(step[-1])))
    return first, tokens


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    canonical = write_gguf(d / "tiny-Q4_K_M.gguf", kquant_spec(), q4_k_m)
    return d, canonical


def test_spec_from_metadata_and_formats(q4km):
    d, _ = q4km
    g = open_gguf(d / "tiny-Q4_K_M.gguf")
    want = kquant_spec().model
    la = dataclasses.replace(want.linear_attention, out_head_order="tiled")   # 3 value heads per key head
    layers = dataclasses.replace(want.layers, pattern=None, types=want.layers.kinds)
    assert g.spec.model == dataclasses.replace(want, linear_attention=la, layers=layers)
    q = g.spec.quantization
    assert (q.embed, q.lm_head, q.attn_q, q.gdn_qkv, q.gdn_ab, q.mtp, q.norm, q.gdn_decay) == \
        ("q4_k", "q6_k", "q4_k", "q5_k", "bf16", "w8g32", "fp32", "fp32")
    layers = want.layers.count
    down = {i: q4_k_m(f"layers.{i}.mlp.down_proj.weight", (1, 1), i, layers).lower() for i in range(layers)}
    for i, fmt in down.items():                       # the per-tensor mix survives in the recipe
        got = q.by_tensor.get(f"layers.{i}.mlp.down_proj.weight", q.mlp_down)
        assert got == fmt
    assert len(set(down.values())) == 2
    from compiler.sizes import weight_bytes
    assert weight_bytes(g.spec) == g.nbytes          # the memory plan counts the file's own formats


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "BF16"])
def test_reference_matches_the_same_weights_as_an_hf_checkpoint(kind, q4km, tmp_path):
    if kind == "Q4_K_M":
        path, canonical = q4km[0] / "tiny-Q4_K_M.gguf", q4km[1]
    else:
        path = tmp_path / f"tiny-{kind}.gguf"
        canonical = write_gguf(path, kquant_spec(), uniform(kind), seed=3)
    model = load_gguf(path, cache_dir=tmp_path / "cache")
    hf_spec, hf_tensors = load_checkpoint(write_hf_checkpoint(tmp_path / "hf", kquant_spec(), canonical))
    ours, ours_tokens = _greedy(model.spec, dequantized(model.weights), PROMPT)
    ref, ref_tokens = _greedy(hf_spec, hf_tensors, PROMPT)
    assert np.std(ref) > 1.0                          # logits not flat: the comparison means something
    assert np.abs(ours - ref).max() <= 1e-4
    assert ours_tokens == ref_tokens


def test_tokenizer_and_chat_template_from_metadata(q4km, tmp_path):
    from ninfer_gen.engine.tokenizer import load_tokenizer
    from ninfer_gen.serve.chat import load_chat_format

    model = load_gguf(q4km[0] / "tiny-Q4_K_M.gguf", cache_dir=tmp_path)
    tok = load_tokenizer(model.folder, model.spec.model.vocab_size)
    text = "hello world<|im_end|> <think>x"
    ids = tok.encode(text)
    assert ids[:3] == [259, 260, 261] and 264 in ids and 265 in ids      # merges and added tokens, their ids
    assert tok.decode(ids) == text
    config = json.loads((model.folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == "<|im_end|>"
    assert json.loads((model.folder / "generation_config.json").read_text()) == {"eos_token_id": [264]}
    chat = load_chat_format(model.folder)
    rendered = chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in str(rendered)
    again = load_gguf(q4km[0] / "tiny-Q4_K_M.gguf", cache_dir=tmp_path)
    assert again.folder == model.folder                 # written once per file content


def _corrupt(path, data: bytes):
    path.write_bytes(data)
    return path


def test_bad_files_get_one_clear_error(q4km, tmp_path):
    good = (q4km[0] / "tiny-Q4_K_M.gguf").read_bytes()
    cases = {
        "magic": (_corrupt(tmp_path / "a.gguf", b"GGML" + good[4:]), "not a GGUF file"),
        "truncated": (_corrupt(tmp_path / "b.gguf", good[:len(good) // 2]), "truncated"),
        "header cut": (_corrupt(tmp_path / "c.gguf", good[:4000]), "truncated or corrupt"),
        "missing": (tmp_path / "none.gguf", "not found"),
    }
    for what, (path, message) in cases.items():
        with pytest.raises(GGUFError, match=message):
            open_gguf(path)
    assert not is_gguf(tmp_path / "a.gguf") and is_gguf(q4km[0] / "tiny-Q4_K_M.gguf")


@pytest.mark.parametrize("arch, message", [("qwen3next", "'qwen3next' .*Qwen3-Next"), ("llama", "'llama' .*not supported")])
def test_other_architectures_are_refused(arch, message, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, kquant_spec(), uniform("Q8_0"), arch=arch, vocab=False)
    with pytest.raises(GGUFError, match=message):
        open_gguf(path)


def test_unsupported_types_and_missing_tensors_are_named(tmp_path):
    spec = kquant_spec()
    kinds = lambda name, shape, layer, n: "Q4_0" if name == "layers.0.mlp.up_proj.weight" else q4_k_m(name, shape, layer, n)  # noqa: E731
    write_gguf(tmp_path / "q40.gguf", spec, kinds, vocab=False)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type Q4_0, which ninfer-gen does not run"):
        open_gguf(tmp_path / "q40.gguf")
    write_gguf(tmp_path / "missing.gguf", spec, q4_k_m, vocab=False, drop=("blk.2.ssm_out.weight",))
    with pytest.raises(GGUFError, match="block 2 has neither"):
        open_gguf(tmp_path / "missing.gguf")
    write_gguf(tmp_path / "nonorm.gguf", spec, q4_k_m, vocab=False, drop=("blk.1.ssm_norm.weight",))
    with pytest.raises(GGUFError, match=r"1 missing tensor\(s\): blk\.1\.ssm_norm\.weight"):
        open_gguf(tmp_path / "nonorm.gguf")


def test_a_file_without_mtp_loads_without_it_unless_drafting(tmp_path):
    spec = kquant_spec()
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, mtp=dataclasses.replace(spec.model.mtp, num_layers=0)))
    write_gguf(tmp_path / "nomtp.gguf", spec, q4_k_m, vocab=False)
    model = load_gguf(tmp_path / "nomtp.gguf")
    assert model.spec.model.mtp.num_layers == 0 and model.folder is None
    assert not any(name.startswith("mtp.") for name in model.weights)
    with pytest.raises(GGUFError, match="no MTP"):
        open_gguf(tmp_path / "nomtp.gguf", require_mtp=True)


def test_a_q4_k_m_file_plans_every_bucket_for_the_gpu(q4km):
    """The k-quant GEMV (decode, verify) and GEMM (prefill) read the file's blocks, the embedding gathers
    Q4_K rows, and the tiled out_proj heads are the GDN norm's output order: every bucket of the runtime
    profile lowers, with no transpose left."""
    from compiler.buckets import plan_bucket, profile_of
    from compiler.kernels import gated_rmsnorm
    from compiler.targets import lookup

    spec = open_gguf(q4km[0] / "tiny-Q4_K_M.gguf").spec
    assert spec.model.linear_attention.out_head_order == "tiled"
    profile = profile_of(spec, cohorts=(1, 4), draft=3)
    keys = {k for shape in profile.shapes() for k in plan_bucket(spec, lookup("rtx3090"), *shape, profile).keys()}
    formats = {(k.family, k.fmt) for k in keys if k.family in ("gemv", "gemm", "embed")}
    assert {("gemv", "q4_k"), ("gemv", "q5_k"), ("gemv", "q6_k"), ("gemm", "q4_k"), ("gemm", "q6_k"),
            ("embed", "q4_k")} <= formats
    norms = [k for k in keys if isinstance(k, gated_rmsnorm.Key)]
    assert norms and all(k.key_heads == spec.model.linear_attention.num_key_heads for k in norms)


@pytest.mark.parametrize("kind", ["Q8_0", "BF16"])
def test_q8_0_and_float_files_put_out_proj_heads_back_and_plan_for_the_gpu(kind, tmp_path):
    from compiler.buckets import plan_bucket
    from compiler.targets import lookup

    write_gguf(tmp_path / "f.gguf", kquant_spec(), uniform(kind), vocab=False)
    spec = open_gguf(tmp_path / "f.gguf").spec
    assert spec.model.linear_attention.out_head_order == "grouped"       # 32-value blocks move with their head
    assert plan_bucket(spec, lookup("rtx3090"), "step", 1, 1).calls


def test_convert_keeps_the_files_formats(q4km, tmp_path):
    from ninfer_gen.weights.container import load_host, open_container
    from ninfer_gen.weights.convert import convert_checkpoint

    source = q4km[0] / "tiny-Q4_K_M.gguf"
    summary = convert_checkpoint(source, tmp_path / "box", progress=False)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(summary["files"])
    box = open_container(tmp_path / "box")
    model = load_gguf(source, cache_dir=tmp_path / "cache")
    assert box.spec == model.spec                               # formats, per-tensor mix and head order kept
    assert summary["written_bytes"] >= summary["read_bytes"]     # planes: the blocks as stored (+ row padding)
    spec, tensors = load_host(tmp_path / "box")
    expected = dequantized(model.weights)
    assert all(torch.equal(tensors[n], expected[n]) for n in expected)
    with pytest.raises(CheckpointError, match="carries its own spec"):
        convert_checkpoint(source, tmp_path / "other", spec=spec)


def test_tiled_out_proj_heads_give_the_same_model():
    """The `transpose` primitive behind `out_head_order: tiled`: out_proj's columns in llama.cpp's tiled head
    order, the activations permuted to match, equal the grouped model (and its shape rule checks axes)."""
    from compiler.ir import AVal
    from compiler.prims import PRIMS
    from ninfer_gen.weights.random_weights import random_weights

    spec = kquant_spec()
    la = spec.model.linear_attention
    weights = random_weights(spec, seed=5)
    tiled_w = dict(weights)
    for name in [n for n in weights if n.endswith("out_proj.weight")]:
        w = weights[name].reshape(-1, la.num_key_heads, la.group, la.value_head_dim)
        tiled_w[name] = w.transpose(1, 2).reshape(weights[name].shape).contiguous()
    tiled = dataclasses.replace(spec, model=dataclasses.replace(
        spec.model, linear_attention=dataclasses.replace(la, out_head_order="tiled")))
    grouped_logits, grouped_tokens = _greedy(spec, weights, PROMPT, n=4)
    tiled_logits, tiled_tokens = _greedy(tiled, tiled_w, PROMPT, n=4)
    assert np.abs(grouped_logits - tiled_logits).max() <= 1e-5 and grouped_tokens == tiled_tokens
    assert PRIMS["transpose"].shape_rule(AVal((2, 3, 4), "f32"), perm=(0, 2, 1)) == [AVal((2, 4, 3), "f32")]
    with pytest.raises(Exception, match="not a permutation"):
        PRIMS["transpose"].shape_rule(AVal((2, 3, 4), "f32"), perm=(0, 1, 1))


def test_device_weights_stream_the_file_one_tensor_at_a_time(q4km):
    from checkpoint_cases import assert_same_device_weights
    from ninfer_gen.executor.device_weights import from_host, from_stream
    from ninfer_gen.weights.gguf_load import iter_tensors

    g = open_gguf(q4km[0] / "tiny-Q4_K_M.gguf")
    streamed = from_stream(g.spec, iter_tensors(g), device="cpu")
    assert_same_device_weights(streamed, from_host(g.spec, load_gguf(g.path).weights, device="cpu"))
    assert streamed.formats["layers.0.mlp.gate_up.weight"] == "q4_k"
