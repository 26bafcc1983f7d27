"""GPU tier for speculative decoding (engine.speculative over the GPU backend, host-driven rounds): the
ReplaySSM transaction on the device — a verify never writes a lane's GDN state or conv history; a
commit of m logged tokens equals m plain decode steps bit for bit for every m in 0..K+1, in every GDN
layer; a round whose drafts are all rejected leaves state, conv history and length as one plain step —
and losslessness: greedy output with K = 1..5 drafts equals plain greedy output token for token on the
shipped small model (8 prompts, 256 new tokens each), with the acceptance and tokens per round printed.
Run: pytest -m gpu tests/gpu/test_speculative_gpu.py -q -s"""
import sysconfig
from pathlib import Path

import pytest
import torch

from compiler.spec import load_spec
from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "models/qwen3.8-small-py"
K_MAX = 5


def _backend(spec, q, draft: int):
    from dataclasses import replace

    from ninfer_gen.executor.device_weights import from_host
    from ninfer_gen.executor.gpu_backend import GpuBackend

    spec = replace(spec, runtime=replace(spec.runtime, draft_tokens=draft))
    return GpuBackend(spec, from_host(spec, q), max_context=2048, build_root=build_root())


@pytest.fixture(scope="module")
def tiny():
    from ninfer_gen.weights.checkpoint import quantize_weights
    from ninfer_gen.weights.random_weights import random_weights

    spec = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")
    return _backend(spec, quantize_weights(spec, random_weights(spec, seed=0)), 3)


def _gdn(be, slot) -> dict:
    return {f"{kind}.{layer}": t[slot].clone() for kind, d in (("ssm", be.state.ssm), ("conv", be.state.conv))
            for layer, t in d.items()}


def test_transaction_on_the_device(tiny):
    be, T = tiny, tiny.profile.tail_tokens
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, tiny.spec.model.vocab_size, (40,), generator=gen).tolist()
    tokens = torch.randint(0, tiny.spec.model.vocab_size, (T,), generator=gen).tolist()
    seq = be.new_sequence()
    try:
        be.prefill(seq, prompt)
        snap, length = be.state.snapshot(), seq.length
        before = _gdn(be, seq.slot)
        be.verify(seq, tokens)
        after = _gdn(be, seq.slot)
        assert all(torch.equal(after[k], v) for k, v in before.items()), "verify wrote the committed state"
        for m in range(T + 1):
            be.state.restore(snap)
            seq.table.length = length
            be.verify(seq, tokens)
            be.commit(seq, m)
            folded, folded_len = _gdn(be, seq.slot), seq.length
            be.state.restore(snap)
            seq.table.length = length
            for t in tokens[:m]:
                be.run("step", [seq], [[t]])
            stepped = _gdn(be, seq.slot)
            assert folded_len == seq.length == length + m
            for k in stepped:
                assert torch.equal(folded[k], stepped[k]), f"m = {m}: commit of {k} differs from {m} decode steps"
    finally:
        be.release(seq)


@pytest.fixture(scope="module")
def small():
    """k → the shipped small model on a GPU backend built for k drafts (its profile's verify shape)."""
    import ninfer_gen
    from ninfer_gen.weights.checkpoint import load_checkpoint, quantize_weights

    spec, tensors = load_checkpoint(SMALL, require_mtp=True)
    q = quantize_weights(spec, tensors)
    models = {}

    def model(k: int):
        if k not in models:
            models.clear()                           # one backend at a time: its state pool is large
            models[k] = ninfer_gen.Model(spec, _backend(spec, q, k), SMALL, "gpu")
        return models[k]
    return model


def _prompts(model, n: int = 8, tokens: int = 64) -> list[list[int]]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    ids = model.tokenizer.encode(text)
    step = (len(ids) - tokens) // n
    return [ids[i * step:i * step + tokens] for i in range(n)]


@pytest.mark.parametrize("k", range(1, K_MAX + 1))
def test_speculative_greedy_is_lossless(small, k):
    from ninfer_gen.engine.sampling import SamplingParams
    from ninfer_gen.engine.speculative import Stats

    model, stats = small(k), Stats()
    with pytest.raises(ValueError, match=f"built for {k} drafts"):
        model.speculative(k + 1)
    for i, prompt in enumerate(_prompts(model)):
        plain = model.generate(prompt, 256)
        spec = list(model.stream(prompt, 256, SamplingParams(), None, draft=k, stats=stats))
        if spec != plain:
            at = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
            pytest.fail(f"K={k}, prompt {i}: speculative output parts from plain greedy at token {at}")
    print(f"K={k}: acceptance {stats.acceptance:.3f}, {stats.tokens_per_round:.2f} tokens per round "
          f"({stats.rounds} rounds)")
