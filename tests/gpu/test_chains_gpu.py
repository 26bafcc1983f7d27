"""GPU tier for CompileOptions.chain (compiler/chains.py, kernels/gemv_chain.py): decode GEMVs joined into fewer
launches must write the bits their own launches write.

- The 27B shape (random weights drawn on the device; the shapes the bench runs: split-K, stage_x, 4-warp members
  beside 8-warp ones): a prefill, then decode steps of 1 and of 3 lanes and a 4-row verify, each bucket's logits
  bit-identical between `off`, `group` and `chain`, twice in a row (the chain's counters come back to zero) and
  replayed from the CUDA graphs.
- The shipped small model through the engine: a cohort of 4 lanes (greedy and seeded sampled, K = 3, lanes
  joining and leaving, a prefix-cache second turn) gives the default build's tokens in every mode.
Run: pytest -m gpu tests/gpu/test_chains_gpu.py -q -s"""
from pathlib import Path

import pytest
import torch

from cohort_run import cohort_tokens, load_small
from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
MODES = ("off", "group", "chain")


def _27b_logits(mode: str, weights, spec) -> dict[str, list[torch.Tensor]]:
    from compiler.options import CompileOptions
    from ninfer_gen.executor.gpu_backend import GpuBackend
    from ninfer_gen.executor.memory_plan import GiB

    be = GpuBackend(spec, weights, max_context=2048, cohorts=3, draft=3, vram_budget=40 * GiB,
                    build_root=build_root(), options=CompileOptions(chain=mode))
    g = torch.Generator().manual_seed(3)
    out: dict[str, list[torch.Tensor]] = {"prefill": [], "step1": [], "step3": [], "verify": []}
    seqs = [be.new_sequence() for _ in range(3)]
    try:
        for s in seqs:
            ids = torch.randint(0, spec.model.vocab_size, (300,), generator=g).tolist()
            logits, _ = be.prefill(s, ids)
            out["prefill"].append(logits.float().cpu())
        for _ in range(2):                                   # twice: the counters must come back to zero
            tok = [[int(torch.randint(0, 1000, (1,), generator=g))] for _ in seqs]
            out["step1"].append(be.run("step", seqs[:1], tok[:1])[0].float().cpu())
            out["step3"].append(be.run("step", seqs, tok)[0].float().cpu())
            rows = [[int(x) for x in torch.randint(0, 1000, (4,), generator=g)]]
            out["verify"].append(be.run("verify", seqs[:1], rows)[0].float().cpu())
        launches = {k: v for k, v in be.exe.launches.items() if k[0] == "step"}
    finally:
        for s in seqs:
            be.release(s)
    print(f"27B chain={mode}: step launches {launches}")
    out["launches"] = [torch.tensor(sum(launches.values()))]
    del be
    torch.cuda.empty_cache()
    return out


def test_27b_buckets_write_the_same_bits_in_every_chain_mode():
    from compiler.spec import load_spec
    from ninfer_gen.executor.device_weights import random_on_device

    spec = load_spec(ROOT / "model_specs/qwen3.8-27b.yaml")
    weights = random_on_device(spec, seed=0)
    runs = {mode: _27b_logits(mode, weights, spec) for mode in MODES}
    for mode in MODES[1:]:
        for bucket in ("prefill", "step1", "step3", "verify"):
            for i, (a, b) in enumerate(zip(runs["off"][bucket], runs[mode][bucket])):
                assert torch.equal(a, b), f"chain={mode}: {bucket} call {i} differs from separate launches " \
                                          f"(max |diff| {(a - b).abs().max().item():.3g})"
        assert runs[mode]["launches"][0] < runs["off"]["launches"][0]
    del weights
    torch.cuda.empty_cache()


def test_a_cohort_gives_the_default_builds_tokens_in_every_chain_mode():
    from compiler.options import CompileOptions

    runs = {mode: cohort_tokens(load_small(CompileOptions(chain=mode)), drafts=(0, 3, 3))[0] for mode in MODES}
    for mode in MODES[1:]:
        for i, (a, b) in enumerate(zip(runs["off"], runs[mode])):
            assert a == b, f"chain={mode}: request {i} parts from the default build"
