"""rounding: how two torch CPU computations of the same values are compared when their bits are torch's,
not ours. Test helper only.

Torch's CPU matmul (MKL in our wheels) is not bit-reproducible across thread counts, BLAS builds or even
buffer addresses: on the 2-core CI box the same `F.linear` on equal inputs and the same weight gave
different last bits at 2 threads when the input sat at another address (equal at 1 thread). Two paths that
make the same torch calls therefore agree to rounding, not to the bit, once a matmul is big enough to be
threaded. Bit-for-bit stays for what our code decides alone: one thread split, elementwise work, copies,
integer results.
"""
from __future__ import annotations

import torch

# Allowed max|a − b| as a fraction of max|b| (the tensor's largest magnitude), per dtype.
# float32: measured on the shipped small model, fast reference vs the plain one (tests/test_reference_speed.py),
#   1–16 threads on the 2-core box: at most 7.5e-7 (≈ 6 fp32 ulps of the largest value); 1e-5 is ×13 that.
# float16 (INT8-KV scales) and bfloat16: no difference observed at 1–16 threads; one rounding flip of the
#   largest value is 2^-10 (fp16) / 2^-7 (bf16) of it; allowed twice that, so a flip passes and a wrong
#   value does not.
REL = {torch.float32: 1e-5, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}
# int8 tensors are quantised codes (INT8 KV): a value that moved by an ulp can round to the neighbouring
# code, and a flipped fp16 scale moves a code by under 0.13, so at most one code apart. Other integer
# tensors (ids, positions, tables) are ours: equal.
CODE_STEP = {torch.int8: 1}


def assert_same_to_rounding(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """a equals b up to the rounding that torch's CPU kernels may differ by (REL, CODE_STEP above)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    if torch.equal(a, b):
        return
    diff = (a.double() - b.double()).abs().max().item()
    if a.is_floating_point():
        scale = max(b.double().abs().max().item(), 1e-30)
        assert diff <= REL[a.dtype] * scale, f"{what}: differs by {diff:.3g} ({diff / scale:.3g} of its largest " \
                                             f"magnitude, allowed {REL[a.dtype]:.3g})"
    else:
        assert diff <= CODE_STEP.get(a.dtype, 0), f"{what}: integers differ by {diff:g}"
