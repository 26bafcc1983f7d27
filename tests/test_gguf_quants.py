"""GGUF weight formats on the CPU: our k-quant dequantisation equals the `gguf` package's bit for bit,
Q8_0 read as w8g32 keeps its numbers, the formats flow through the recipe, sizes and device planes."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from compiler.kernels.weight_layout import kquant_tile_order, pack_kquant_for_device, unpack_kquant_from_device
from compiler.kquant import KFORMATS, KQTensor, QK_K, dequantize, random_kquant
from compiler.quant import dequantize as dequantize_q
from compiler.schema import SpecError
from compiler.sizes import FORMAT_BITS
from compiler.spec import QuantRecipe, TensorFormat, format_of, spec_from_dict, tensor_table
from compiler.weights import plane_bytes, planes_of
from ninfer_gen.weights.checkpoint import CheckpointError, dequantized, quantize_weights
from ninfer_gen.weights.gguf_file import q8_0_as_w8g32

GGML = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
        "q6_k": gguf.GGMLQuantizationType.Q6_K}
SCALE_BYTES = {"q4_k": [(0, 2), (2, 4)], "q5_k": [(0, 2), (2, 4)], "q6_k": [(208, 210)]}


def _random_fp16_scales(blocks: torch.Tensor, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Every finite fp16 bit pattern is a valid scale: negative, subnormal, zero and large ones too."""
    per = blocks.view(-1, KFORMATS[fmt].block_bytes)
    for lo, hi in SCALE_BYTES[fmt]:
        bits = torch.randint(0, 1 << 16, (per.shape[0],), generator=gen, dtype=torch.int64)
        bits = torch.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)          # no inf / NaN
        per[:, lo:hi] = bits.to(torch.int32).to(torch.int16).view(torch.uint8).view(-1, 2)
    return blocks


@pytest.mark.parametrize("fmt", sorted(KFORMATS))
@pytest.mark.parametrize("scales", ["realistic", "any fp16"])
def test_kquant_dequant_equals_gguf_bit_for_bit(fmt, scales):
    gen = torch.Generator().manual_seed(sorted(KFORMATS).index(fmt))
    w = random_kquant(fmt, 24, 4 * QK_K, gen)
    if scales == "any fp16":
        w = KQTensor(fmt, _random_fp16_scales(w.blocks.clone(), fmt, gen), w.k)
    ours = dequantize(w).numpy()
    ref = gguf.quants.dequantize(w.blocks.numpy(), GGML[fmt])
    assert ours.shape == ref.shape == (24, 4 * QK_K)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))          # bit for bit, −0 included


def test_q8_0_reads_as_w8g32_with_the_same_numbers():
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)).numpy()
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    w = q8_0_as_w8g32(q, 512, "test")
    assert w.fmt == "w8g32" and w.codes.shape == (16, 512) and int(w.codes.min()) >= -127
    ref = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q(w).numpy().view(np.uint32), ref.view(np.uint32))
    bad = q.copy().reshape(16, -1, 34)
    bad[0, 0, 2] = 0x80                                                          # code −128
    with pytest.raises(CheckpointError, match="−128"):
        q8_0_as_w8g32(bad.reshape(16, -1), 512, "test")


def test_kqtensor_checks_its_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        KQTensor("q4_k", torch.zeros(2, 144, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match=r"uint8 \[N, 288\]"):
        KQTensor("q4_k", torch.zeros(2, 144, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="unknown k-quant format"):
        KQTensor("q3_k", torch.zeros(2, 110, dtype=torch.uint8), 256)


@pytest.mark.parametrize("fmt", sorted(KFORMATS))
@pytest.mark.parametrize("gate_up", [False, True])
def test_kquant_device_planes_round_trip(fmt, gate_up):
    n = 48 if gate_up else 40          # a fused gate/up has 2·F rows, F a multiple of 8
    w = random_kquant(fmt, n, 512, torch.Generator().manual_seed(1))
    planes = pack_kquant_for_device(w, gate_up=gate_up)
    assert planes["lo"].numel() == plane_bytes(fmt, n, 512)["lo"] and planes_of(fmt) == ("lo",)
    back = unpack_kquant_from_device(planes, fmt, n, 512, gate_up=gate_up)
    assert torch.equal(back.blocks, w.blocks)
    rows = kquant_tile_order(planes["lo"], fmt, 48, 512, inverse=True).view(48, -1)   # the device's 16-row tile order
    if gate_up:               # each tile: 8 gate rows, then the same 8 up rows
        assert torch.equal(rows[8:16], w.blocks[24:32])
    else:                     # padded rows are zero blocks: they decode to 0
        padded = KQTensor(fmt, rows, 512)
        assert torch.equal(dequantize(padded)[40:], torch.zeros(8, 512))


def test_format_bits_are_the_block_sizes():
    for fmt, f in KFORMATS.items():
        assert FORMAT_BITS[fmt] == f.bits_per_weight == f.block_bytes * 8 / QK_K


def _spec(recipe: dict | None = None):
    from gguf_fixtures import kquant_spec
    spec = kquant_spec()
    return dataclasses.replace(spec, quantization=QuantRecipe(**(recipe or {})))


def test_recipe_tensor_entries_override_roles():
    spec = _spec({"mlp_down": "q4_k", "tensors": (TensorFormat("layers.1.mlp.down_proj.weight", "q6_k"),)})
    table = {t.name: t for t in tensor_table(spec)}
    assert format_of(spec, table["layers.0.mlp.down_proj.weight"]) == "q4_k"
    assert format_of(spec, table["layers.1.mlp.down_proj.weight"]) == "q6_k"
    with pytest.raises(SpecError, match="listed once"):
        QuantRecipe(tensors=(TensorFormat("norm.weight", "fp32"), TensorFormat("norm.weight", "bf16")))
    data = {"name": "x", "model": dataclasses.asdict(spec.model),
            "quantization": {"tensors": [{"name": "lm_head.weight", "format": "q6_k"}]},
            "runtime": {"max_context": 4096}}
    assert spec_from_dict(data).quantization.by_tensor == {"lm_head.weight": "q6_k"}


def test_quantize_weights_keeps_stored_blocks_and_has_no_kquant_quantiser():
    spec = _spec({"attn_q": "q4_k"})
    name = "layers.3.self_attn.q_proj.weight"
    shape = next(t.shape for t in tensor_table(spec) if t.name == name)
    kq = random_kquant("q4_k", *shape)
    assert quantize_weights(spec, {name: kq})[name] is kq
    assert torch.equal(dequantized({name: kq})[name], dequantize(kq))
    with pytest.raises(CheckpointError, match="no quantiser"):
        quantize_weights(spec, {name: torch.randn(shape)})
    with pytest.raises(CheckpointError, match="requantising"):
        quantize_weights(_spec({"attn_q": "q5_k"}), {name: kq})


def test_layout_fingerprint_covers_kquant_planes(monkeypatch):
    """A change to the k-quant device layout (here: rows instead of 16-row tile order) changes the layout fingerprint,
    so a container of GGUF planes packed the old way is refused, not misread."""
    from compiler.kernels import weight_layout
    from ninfer_gen.weights import planes

    planes.layout_fingerprint.cache_clear()
    shipped = planes.layout_fingerprint()
    monkeypatch.setattr(weight_layout, "kquant_tile_order", lambda lo, *args, **kwargs: lo)
    planes.layout_fingerprint.cache_clear()
    try:
        assert planes.layout_fingerprint() != shipped
    finally:
        planes.layout_fingerprint.cache_clear()
