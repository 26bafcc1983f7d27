"""GPU tier for CompileOptions.chain (compiler/chains.py, kernels/gemv_chain.py): decode GEMVs joined into fewer
launches must write the bits their own launches write.

- The 27B shape (random weights drawn on the device; the shapes the bench runs: split-K, stage_x, 4-warp members
  beside 8-warp ones): a prefill, then decode steps of 1 and of 3 lanes and a 4-row verify, each bucket's logits
  bit-identical between `off`, `group` and `chain`, twice in a row (the chain's counters come back to zero) and
  replayed from the CUDA graphs.
- The shipped small model through the engine: a cohort of 4 lanes (greedy and seeded sampled, K = 3, lanes
  joining and leaving, a prefix-cache second turn) gives the default build's tokens in every mode.
Run: pytest -m gpu tests/gpu/test_chains_gpu.py -q -s"""
import random
from pathlib import Path

import pytest
import torch

from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "models/qwen3.8-small-py"
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


def _cohort_tokens(mode: str):
    from compiler.options import CompileOptions
    from ninfer_gen.api import load
    from ninfer_gen.engine import Engine, Request
    from ninfer_gen.sampling import SamplingParams

    model = load(SMALL, backend="gpu", cohorts=4, draft=3, max_context=1024, build_root=build_root(),
                 prefix_states=4, compile_options=CompileOptions(chain=mode))
    rng = random.Random(5)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(1, 4000) for _ in range(rng.choice([5, 40, 130]))]
        sampling = SamplingParams(temperature=0.9, top_k=40, seed=i) if i % 3 == 2 else SamplingParams()
        reqs.append(Request(prompt, rng.randint(10, 70), sampling, draft=rng.choice([0, 3, 3])))
    lanes = model.lanes(4, prefix_cache=4)
    engine = Engine(lanes, lanes=4, prefill_budget=64, max_queue=16)
    handles = [engine.submit(r) for r in reqs[:5]]
    for r in reqs[5:]:
        engine.step()
        handles.append(engine.submit(r))
    engine.run_until_idle()
    first = engine.submit(Request(list(reqs[0].prompt), 20, draft=3))     # then a second turn of it
    engine.run_until_idle()
    again = engine.submit(Request(list(reqs[0].prompt) + first.tokens + [7, 8, 9], 20, draft=3))
    engine.run_until_idle()
    handles.append(first)
    finals = [h.result() for h in handles + [again]]
    assert all(f.finish == "length" for f in finals), [f.error for f in finals]
    assert again.final.stats.cached_tokens > 0
    return [h.tokens for h in handles + [again]]


def test_a_cohort_gives_the_default_builds_tokens_in_every_chain_mode():
    runs = {mode: _cohort_tokens(mode) for mode in MODES}
    for mode in MODES[1:]:
        for i, (a, b) in enumerate(zip(runs["off"], runs[mode])):
            assert a == b, f"chain={mode}: request {i} parts from the default build"
