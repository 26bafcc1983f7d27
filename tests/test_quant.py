"""Weight formats of MODEL.md §8: ranges, scales, exact requantisation round trip, rounding, packing."""
import math

import pytest
import torch

from compiler.quant import FORMATS, QTensor, convert, dequantize, pack_codes, quantize, unpack_codes

FMTS = list(FORMATS)
# Magnitudes keep every group's scale a normal fp16 number (≥ 2^-14), where the round trip is exact.
SCALES = [0.05, 1.0, 300.0]


def _random(seed: int, n: int, k: int, magnitude: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * magnitude
    # Heavy-tailed rows as well as Gaussian ones: real weights have outliers that set a group's scale.
    w[::3] *= torch.rand(n, k, generator=g)[::3] ** -0.5
    return w


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("magnitude", SCALES)
def test_codes_in_range_and_scale_rule(fmt, magnitude):
    f = FORMATS[fmt]
    w = _random(1, 24, 4 * f.group, magnitude)
    q = quantize(w, fmt)
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.float16
    assert q.shape == (24, 4 * f.group) and tuple(q.scales.shape) == (24, 4)
    assert int(q.codes.min()) >= f.lo and int(q.codes.max()) <= f.hi
    amax = w.reshape(24, 4, f.group).abs().amax(-1)
    assert torch.equal(q.scales, (amax / f.qmax).to(torch.float16))
    # The element that sets the scale maps to ±qmax: the full code range is used.
    assert torch.equal(q.codes.reshape(24, 4, f.group).abs().amax(-1).int(), torch.full((24, 4), f.qmax).int())


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("magnitude", SCALES)
def test_requantising_dequantised_weights_is_exact(fmt, magnitude):
    f = FORMATS[fmt]
    q = quantize(_random(2, 16, 3 * f.group, magnitude), fmt)
    q2 = quantize(dequantize(q), fmt)
    assert torch.equal(q2.codes, q.codes)
    assert torch.equal(q2.scales, q.scales)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("magnitude", SCALES)
def test_dequantise_error_within_half_a_step(fmt, magnitude):
    f = FORMATS[fmt]
    w = _random(3, 32, 2 * f.group, magnitude)
    q = quantize(w, fmt)
    d = dequantize(q)
    step = q.scales.float().repeat_interleave(f.group, dim=1)
    # Nothing is clamped while scales are normal fp16, so the error is rounding alone: half a step,
    # widened only by the fp32 rounding of x·(1/scale) (≤ 127·2^-23 of a step).
    assert d.dtype == torch.float32
    assert ((d - w).abs() <= step * (0.5 + 2.0 ** -16)).all()
    assert (d - w).abs().max() > step.min() * 0.25  # the bound is not met trivially


@pytest.mark.parametrize("fmt", FMTS)
def test_round_half_to_even_on_exact_ties(fmt):
    f = FORMATS[fmt]
    # scale = qmax·0.25 / qmax = 0.25 exactly, so x·(1/scale) = 4x exactly and x = k/8 lands on ties.
    row = torch.zeros(f.group)
    row[0] = f.qmax * 0.25
    ties = torch.tensor([0.125, 0.375, 0.625, 0.875, -0.125, -0.375, -0.625, -0.875])
    row[1:9] = ties
    q = quantize(row.unsqueeze(0), fmt)
    assert q.scales.item() == 0.25
    assert q.codes[0, 1:9].tolist() == [0, 2, 2, 4, 0, -2, -2, -4]


@pytest.mark.parametrize("fmt", FMTS)
def test_zero_groups_give_zero_scale_and_no_nan(fmt):
    f = FORMATS[fmt]
    w = _random(4, 6, 3 * f.group, 1.0)
    w[2] = 0.0
    w[4, f.group:2 * f.group] = 0.0
    q = quantize(w, fmt)
    assert q.scales[2].eq(0).all() and q.scales[4, 1] == 0 and q.scales[4, 0] != 0
    assert q.codes[2].eq(0).all() and q.codes[4, f.group:2 * f.group].eq(0).all()
    d = dequantize(q)
    assert torch.isfinite(d).all()
    assert d[2].eq(0).all() and d[4, f.group:2 * f.group].eq(0).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_nbytes_and_bits_per_weight(fmt):
    f = FORMATS[fmt]
    q = quantize(_random(5, 10, 2 * f.group, 1.0), fmt)
    assert f.bits_per_weight == f.bits + 16 / f.group
    assert q.nbytes == 10 * 2 * f.group * f.bits // 8 + 2 * 10 * 2
    assert q.nbytes * 8 == pytest.approx(q.codes.numel() * f.bits_per_weight)


def test_dequantise_output_dtype():
    q = quantize(_random(6, 4, 64, 1.0), "q4g64")
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(dequantize(q, torch.bfloat16), dequantize(q).to(torch.bfloat16))


def test_convert_float_and_quantised():
    w = _random(7, 4, 64, 1.0)
    b = convert(w, "bf16")
    assert b.dtype == torch.bfloat16 and torch.equal(b, w.to(torch.bfloat16))
    assert convert(w.double(), "fp32").dtype == torch.float32
    q = convert(w, "q5g64")
    assert isinstance(q, QTensor) and q.fmt == "q5g64"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [1, 3, 8, 13, 64, 200])
def test_pack_unpack_round_trip(fmt, k):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(f.lo, f.hi + 1, (5, k), generator=g, dtype=torch.int8)
    codes[0, 0], codes[-1, -1] = f.lo, f.hi  # the extremes of the range must survive
    packed = pack_codes(codes, f.bits)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, math.ceil(k * f.bits / 8))
    assert torch.equal(unpack_codes(packed, f.bits, codes.shape), codes)


def test_pack_is_dense_little_endian():
    codes = torch.tensor([[-8, 7, 0, 1]], dtype=torch.int8)  # offsets 0, 15, 8, 9
    assert pack_codes(codes, 4).tolist() == [[0xF0, 0x98]]
    codes5 = torch.tensor([[-16 + 1, -16 + 2]], dtype=torch.int8)  # 5-bit fields 1, 2 → bits 0 and 6
    assert pack_codes(codes5, 5).tolist() == [[0b01000001, 0]]
    assert pack_codes(torch.tensor([[-127, 127]], dtype=torch.int8), 8).tolist() == [[0, 254]]


def test_pack_quantised_matrix_matches_nbytes():
    q = quantize(_random(8, 12, 128, 2.0), "q6g64")
    packed = pack_codes(q.codes, 6)
    assert packed.numel() + 2 * q.scales.numel() == q.nbytes
    assert torch.equal(unpack_codes(packed, 6, q.shape), q.codes)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(64), r"2-D .*shape \(64,\)"),
    (torch.zeros(2, 3, 64), r"2-D .*shape \(2, 3, 64\)"),
    (torch.ones(4, 96), r"multiple of 64.*\(4, 96\)"),
    (torch.ones(4, 64, dtype=torch.int32), "floating-point"),
])
def test_quantise_rejects_bad_shapes(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize(bad, "q4g64")


def test_quantise_rejects_unknown_format_and_non_finite():
    with pytest.raises(ValueError, match="unknown quantised weight format 'q3g64'"):
        quantize(torch.ones(4, 64), "q3g64")
    with pytest.raises(ValueError, match="unknown weight format 'fp8'"):
        convert(torch.ones(4, 64), "fp8")
    w = torch.ones(4, 64)
    w[1, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(w, "w8g32")
    with pytest.raises(ValueError, match="overflows the fp16 scale"):
        quantize(torch.full((1, 64), 1e6), "q4g64")


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="no weight format has 3-bit codes"):
        pack_codes(torch.zeros(2, 8, dtype=torch.int8), 3)
    with pytest.raises(ValueError, match=r"must lie in \[-8, 7\]"):
        pack_codes(torch.tensor([[9, 0]], dtype=torch.int8), 4)
    with pytest.raises(ValueError, match=r"pack to uint8 \(2, 4\)"):
        unpack_codes(torch.zeros(2, 5, dtype=torch.uint8), 4, (2, 8))


def test_qtensor_rejects_inconsistent_parts():
    with pytest.raises(ValueError, match="scales must be float16"):
        QTensor("q4g64", torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D int8"):
        QTensor("q4g64", torch.zeros(2, 64, dtype=torch.int16), torch.zeros(2, 1, dtype=torch.float16))
