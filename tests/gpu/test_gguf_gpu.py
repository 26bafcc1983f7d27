"""GPU tier for GGUF files (issue 34): Q8_0 (read as w8g32, the same numbers) and BF16 matrices, out_proj's
value heads put back in grouped order on load; the k-quants as stored (Q4_K, Q5_K, Q6_K files, and the
Q4_K_M-style mix with its Q4_K embedding and tiled out_proj heads), run by the k-quant GEMV/GEMM
(templates/gemv_kq.cu.j2, gemm_kq.cu.j2). The compiled executable against the reference interpreter on
the same weights (the file's, dequantised): prefill in chunks and teacher-forced decode, greedy agreement
and per-position logits rel-L2 within the bf16 floor that the interpreter's own bf16 mode sets (as
tests/gpu/test_runtime_gpu.py explains), and greedy generation's tokens.

The floor (`lab.kq_precision.floor_failures`): the mean rel-L2 within max(2e-2, the bf16 mode's mean); at most
3 % of the positions (9 of 300, 4 of 128) above max(2e-2, the bf16 mode's max); none above 0.5. It was
"every position within max(2e-2, the bf16 mode's max), mean within 2e-2" until the H100 (sessions 15 and
16) found the Q4_K_M file's prefill at 0.0603 on one position (mean 0.0041). What set it, measured on the CPU
by `python -m lab.kq_precision` (lab/results/kq_precision_cpu_2026-12-05.json and
kq_precision_q4_k_m_1000_cpu_2026-12-05.json), which runs the GPU's fused graphs in fp32 from the weights as
the device holds them (matrices exact, norms and conv taps bf16) and stores each value in the dtype the plan
gives it:
- it gives this tier's H100 numbers for every file, rel-L2 max / mean: prefill Q4_K_M 0.0658 / 0.00409 (H100
  0.0603 / 0.00408; the first 13 positions within 0.0004 of the H100's), Q4_K 0.000386 / 0.000229 (the
  same), Q5_K 0.000334 / 0.000197 (the same), Q6_K 0.0567 / 0.0172 (0.0588 / 0.0170), Q8_0 0.0334 / 0.0130
  (0.0342 / 0.0131), BF16 0.0360 / 0.0121 (0.0362 / 0.0120); decode Q4_K_M 0.0057 / 0.00385 (0.0062 /
  0.00385), Q6_K 0.1025 / 0.0154 (0.1133 / 0.0167). There is no k-quant kernel in it: the k-quant path adds
  nothing to fp32 products of the stored values that shows here;
- the Q4_K_M file's worst position is 100 (token 421), where the first GDN layer's value heads 0–2 output
  ~1/70 of their usual norm (0.010–0.012 against medians 0.67–0.91) and the gated RMSNorm scales them back to
  unit RMS, so the rounding of that layer's bf16 inputs reaches the logits 10–50× larger than elsewhere.
  How large depends on which way each value rounds: the same emulation with every stored value rounded on a
  randomly offset grid (errors of the same size, other rounding decisions), 1,000 times, puts position 100
  anywhere from 0.004 to 0.207 (median 0.039), while the mean stays within 0.0039–0.0047 and no other
  position passes 0.025;
- over 300 such roundings per file for prefill and 150 for decode, the former per-position bound fails 76 %
  of them for Q4_K_M prefill, 42–56 % for Q8_0 and BF16 prefill, 9–26 % for Q6_K prefill and Q8_0, BF16 and
  Q6_K decode (the range: the bf16 mode's max as measured on the CPU or as the H100 printed it), and its
  mean bound fails Q6_K twice (0.0201 prefill, 0.0204 decode): the H100 passed those by where its roundings
  fell. The floor above holds for all 2,700 and the 1,000: the means at most 0.88 of their bound, at most 4
  positions of 300 (6 with the H100's bf16 maxima) and 2 of 128 above the per-position bound, the largest
  error 0.221 (Q6_K decode, position 33).
What it still catches: a fault in a path every position takes moves the mean; garbage (a lost scale) goes
past the cap, a non-finite value fails outright. What none of this tier's comparisons can catch well is a
fault at a few tokens of the Q4_K/Q5_K-based files: their random blocks' sub-block offsets (−dmin·m) give
every matrix row a mean nearly as large as its spread (the row means' rms 0.83–0.97 of the std, median over
the matrices; Q6_K's, Q8_0's and BF16's 0.06), so every hidden state has a large common part and the logits
hardly depend on the token: the prompt's median logits lie within rel-L2 0.021 of half of Q4_K_M's positions
but ~0.8 from a handful (120, 189, 205, 100, 53: the ill-conditioned ones), within 0.011 of all of Q4_K's
and Q5_K's, and ~0.99 from every one of Q8_0's, BF16's and Q6_K's. The k-quant arithmetic itself is pinned
by tests/gpu/test_kquant_gpu.py (GEMV/GEMM against fp32 products, the embedding gather bit-exact).
Run: pytest -m gpu tests/gpu/test_gguf_gpu.py -q -s"""
from __future__ import annotations

import pytest
import torch

from lab.kq_precision import floor_failures
from lab.precision import rel_l2
from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
AGREE = 0.95


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["Q8_0", "BF16", "Q4_K_M", "Q4_K", "Q5_K", "Q6_K"])
def models(request, tmp_path_factory):
    import ninfer_gen
    from gguf_fixtures import kquant_spec, q4_k_m, uniform, write_gguf
    from ninfer_gen.executor.device_weights import from_host
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.reference import ReferenceBackend
    from ninfer_gen.weights.checkpoint import dequantized
    from ninfer_gen.weights.gguf_load import load_gguf

    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_gguf(path, kquant_spec(), q4_k_m if request.param == "Q4_K_M" else uniform(request.param), vocab=False)
    g = load_gguf(path)
    kquant = request.param not in ("Q8_0", "BF16")          # 256-value blocks span heads: columns stay tiled
    assert g.spec.model.linear_attention.out_head_order == ("tiled" if kquant else "grouped")
    deq = dequantized(g.weights)
    Model = ninfer_gen.Model
    ref = Model(g.spec, ReferenceBackend(g.spec, deq, device="cuda", kv_dtype="int8"), None, "ref")
    ref_bf16 = Model(g.spec, ReferenceBackend(g.spec, deq, device="cuda", dtype="bfloat16", kv_dtype="int8"),
                     None, "ref-bf16")
    gpu = Model(g.spec, GpuBackend(g.spec, from_host(g.spec, g.weights), max_context=2048, prefill_chunk=256,
                                   build_root=build_root(), all_logits=True), None, "gpu")
    return request.param, ref, ref_bf16, gpu


def _check(label, got, expected, own):
    err = rel_l2(got, expected)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    worst = err.topk(3)
    print(f"{label}: argmax agreement {agree:.4f}, rel-L2 max {err.max():.4g} mean {err.mean():.4g}, worst (position, "
          f"rel-L2) {[(int(i), round(float(v), 4)) for v, i in zip(worst.values, worst.indices)]} (bf16 interpreter's "
          f"own max {own.max():.4g} mean {own.mean():.4g})")
    assert agree >= AGREE
    fails = floor_failures(err, own)
    assert not fails, f"{label}: not within the bf16 floor: {'; '.join(fails)}"


@pytest.mark.parametrize("chunk", [64, 256])
def test_gguf_prefill_matches_reference(models, chunk):
    kind, ref, ref_bf16, gpu = models
    ids = _ids(300, ref.spec.model.vocab_size, 1)
    expected = torch.from_numpy(ref.forward_logits(ids))
    own = rel_l2(torch.from_numpy(ref_bf16.forward_logits(ids)), expected)
    _check(f"{kind} prefill chunk {chunk}", torch.from_numpy(gpu.forward_logits(ids, chunk_size=chunk)), expected, own)


def test_gguf_decode_matches_reference(models):
    kind, ref, ref_bf16, gpu = models
    ids = _ids(128, ref.spec.model.vocab_size, 2)
    expected = torch.from_numpy(ref.forward_logits(ids))
    own = rel_l2(torch.from_numpy(ref_bf16.forward_logits(ids)), expected)
    be = gpu.backend
    seq = be.new_sequence()
    try:
        got = torch.stack([be.run("step", [seq], [[t]])[0][-1].float().cpu() for t in ids])
    finally:
        be.release(seq)
    _check(f"{kind} teacher-forced decode", got, expected, own)


def test_gguf_greedy_tokens_match_reference(models):
    """Same greedy tokens, unless they part at a near-tie of the reference (top-2 within 5 % of a logit
    standard deviation), where bf16 rounding may pick either (tests/gpu/test_runtime_gpu.py)."""
    kind, ref, _, gpu = models
    ids = _ids(24, ref.spec.model.vocab_size, 5)
    a, b = ref.generate(ids, 32), gpu.generate(ids, 32)
    if a != b:
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = torch.from_numpy(ref.forward_logits(ids + a[:i])[-1]).double()
        top = logits.topk(2).values
        margin = (top[0] - top[1]).item() / logits.std().item()
        print(f"{kind}: greedy tokens part at {i} of 32, reference margin {margin:.4f} std")
        assert margin < 0.05, f"{kind}: greedy tokens part at {i} where the reference is not near a tie: {a} vs {b}"
    else:
        print(f"{kind}: 32 greedy tokens equal")
