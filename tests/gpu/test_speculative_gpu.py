"""GPU tier for speculative decoding (one-graph device rounds in fused and eager mode, and host-driven
rounds of ninfer_gen.speculative over the GPU backend): the
ReplaySSM transaction on the device — a verify never writes a lane's GDN state or conv history; a
commit of m logged tokens equals m plain decode steps bit for bit for every m in 0..K+1, in every GDN
layer; a round whose drafts are all rejected leaves state, conv history and length as one plain step —
and losslessness: greedy output with K = 1..5 drafts equals plain greedy output token for token on the
shipped small model (8 prompts, 256 new tokens each) in every round mode, with the acceptance and tokens
per round printed; a fused round is one graph replay; and with sampling (temperature 1, and top-k/top-p)
the marginal distribution of each of the first 8 tokens with K = 3 matches plain sampling (chi-square,
20,000 samples per arm, tiny spec; marked `slow_gpu`: `pytest -m slow_gpu` runs it).
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


def _backend(spec, q, draft: int, draft_vocab=None, round_mode: str = "fused"):
    from dataclasses import replace

    from ninfer_gen.executor.device_weights import from_host
    from ninfer_gen.executor.gpu_backend import GpuBackend

    spec = replace(spec, runtime=replace(spec.runtime, draft_tokens=draft))
    return GpuBackend(spec, from_host(spec, q), max_context=2048, build_root=build_root(), draft_vocab=draft_vocab,
                      round_mode=round_mode)


@pytest.fixture(scope="module")
def tiny_weights():
    from ninfer_gen.weights.checkpoint import quantize_weights
    from ninfer_gen.weights.random_weights import random_weights

    spec = load_spec(ROOT / "model_specs/qwen3.8-tiny.yaml")
    return spec, quantize_weights(spec, random_weights(spec, seed=0))


@pytest.fixture(scope="module")
def tiny(tiny_weights):
    return _backend(*tiny_weights, 3)


def _gdn(be, slot) -> dict:
    return {f"{kind}.{layer}": t[slot].clone() for kind, d in (("ssm", be.state.ssm), ("conv", be.state.conv))
            for layer, t in d.items()}


@pytest.mark.parametrize("state_mode", ["replayssm", "snapshot"])
def test_transaction_on_the_device(tiny, tiny_weights, state_mode):
    """Both designs: the verify leaves the committed state; its commit of m equals m decode steps, bit for bit."""
    be = tiny if state_mode == "replayssm" else _backend(*tiny_weights, 3, round_mode="snapshot")
    T = be.profile.tail_tokens
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

    def model(k: int, draft_vocab: tuple | None = None, snapshots: bool = False):
        key = (k, draft_vocab, snapshots)
        if key not in models:
            models.clear()                           # one backend at a time: its state pool is large
            models[key] = ninfer_gen.Model(spec, _backend(spec, q, k, draft_vocab and list(draft_vocab),
                                                          "snapshot" if snapshots else "fused"), SMALL, "gpu")
        return models[key]
    return model


def _prompts(model, n: int = 8, tokens: int = 64) -> list[list[int]]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    ids = model.tokenizer.encode(text)
    step = (len(ids) - tokens) // n
    return [ids[i * step:i * step + tokens] for i in range(n)]


_PLAIN: dict[int, list[int]] = {}


@pytest.mark.parametrize("k", range(1, K_MAX + 1))
@pytest.mark.parametrize("mode", ["fused", "eager", "snapshot"])
def test_speculative_greedy_is_lossless(small, k, mode):
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    model, stats = small(k, snapshots=mode == "snapshot"), Stats()
    model.lanes(1, round_mode="eager" if mode == "eager" else "fused")
    with pytest.raises(ValueError, match=f"at most {k} drafts"):
        model.speculative(k + 1)
    for i, prompt in enumerate(_prompts(model)):
        if i not in _PLAIN:
            _PLAIN[i] = model.generate(prompt, 256)
        plain = _PLAIN[i]
        spec = list(model.stream(prompt, 256, SamplingParams(), None, draft=k, stats=stats))
        if spec != plain:
            at = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
            pytest.fail(f"K={k} {mode}: prompt {i}: speculative output parts from plain greedy at token {at} "
                        f"({len(spec)} vs {len(plain)} tokens)")
    print(f"K={k} {mode}: acceptance {stats.acceptance:.3f}, {stats.tokens_per_round:.2f} tokens per round "
          f"({stats.rounds} rounds)")
    if mode in ("fused", "snapshot"):
        rnd = model.lanes(1).round_graph(1, "greedy")
        assert rnd.graph is not None
        print(f"K={k} {mode}: a round is one graph replay of {rnd.launches} kernel launches "
              f"({len(rnd.plan.calls())} round calls between {len(rnd.plan.buckets())} buckets)")


def test_stop_tokens_and_budget_truncate_a_device_round(small):
    """A stop token or the token budget inside a round ends the output there, as plain decoding would."""
    model = small(3)
    prompt = _prompts(model)[0]
    plain = model.generate(prompt, 64)
    for budget in (1, 2, 5, 11):
        assert model.generate(prompt, budget, draft=3) == plain[:budget]
    stop = plain[9]
    cut = plain[:plain.index(stop) + 1]
    assert model.generate(prompt, 64, stop_tokens={stop}, draft=3) == cut


DRAFT_VOCAB = 2048       # of the small model's 8,192 ids


@pytest.fixture(scope="module")
def draft_ids(small):
    """The 2,048 most frequent ids of the small model's training files (the held-out json/ and email/
    files, where the prompts come from, are not counted)."""
    from ninfer_gen.weights.draft_vocab import rank
    from tools.small_data import collect_corpus

    model = small(1)
    ids, counted = rank(model.tokenizer.encode, (d.text for d in collect_corpus().train), DRAFT_VOCAB,
                        model.spec.model.vocab_size)
    return tuple(ids)


@pytest.mark.parametrize("k", range(1, K_MAX + 1))
def test_reduced_draft_vocabulary_is_lossless(small, draft_ids, k):
    """Drafting from the 2,048 most frequent ids (fused rounds): output still equals plain greedy; the
    acceptance and tokens per round are printed beside the full head's (test above)."""
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    model, stats = small(k, draft_ids), Stats()
    assert model.backend.profile.draft_vocab == DRAFT_VOCAB
    for i, prompt in enumerate(_prompts(model)):
        if i not in _PLAIN:
            _PLAIN[i] = model.generate(prompt, 256)
        spec = list(model.stream(prompt, 256, SamplingParams(), None, draft=k, stats=stats))
        assert spec == _PLAIN[i], f"K={k}, reduced draft vocabulary: prompt {i} differs from plain greedy"
    print(f"K={k} draft vocabulary {DRAFT_VOCAB}: acceptance {stats.acceptance:.3f}, "
          f"{stats.tokens_per_round:.2f} tokens per round ({stats.rounds} rounds)")


def _chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square homogeneity test over token counts: bins with expected count ≥ 5 in both
    arms, the rest pooled into one bin (kept if it reaches 5 too)."""
    na, nb = a.sum(), b.sum()
    expected_a, expected_b = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
    big = (expected_a >= 5) & (expected_b >= 5)
    ca, cb = a[big].tolist(), b[big].tolist()
    rest_a, rest_b = a[~big].sum(), b[~big].sum()
    if (rest_a + rest_b) * min(na, nb) / (na + nb) >= 5:
        ca.append(rest_a)
        cb.append(rest_b)
    ca, cb = torch.tensor(ca, dtype=torch.float64), torch.tensor(cb, dtype=torch.float64)
    if len(ca) < 2:
        return 1.0
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    df = len(ca) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


SAMPLES = 20_000


@pytest.mark.slow_gpu                 # 2 × 20,000 streams per case, minutes each: apart from the 5-minute tier
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 0.9)])
def test_speculative_sampling_matches_plain_sampling(tiny, top_k, top_p):
    """The marginal of each of the first 8 generated tokens: device rounds (K = 3, rejection sampling on
    the device, random drafts of the random tiny model) vs plain sampling, 20,000 samples per arm."""
    import ninfer_gen
    from ninfer_gen.sampling import SamplingParams
    from ninfer_gen.speculative import Stats

    model = ninfer_gen.Model(tiny.spec, tiny, None, "tiny")
    V, n_tok = tiny.spec.model.vocab_size, 8
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    counts = {arm: torch.zeros(n_tok, V, dtype=torch.float64) for arm in ("plain", "spec")}
    stats = Stats()
    for i in range(SAMPLES):
        for arm, draft, seed in (("plain", 0, 2 * i), ("spec", 3, 2 * i + 1)):
            params = SamplingParams(1.0, top_k, top_p, seed)
            out = list(model.stream(prompt, n_tok, params, None, draft=draft, stats=stats if draft else None))
            counts[arm][torch.arange(n_tok), torch.tensor(out)] += 1
    ps = [_chi_square_p(counts["plain"][j], counts["spec"][j]) for j in range(n_tok)]
    adjusted = [min(1.0, p * n_tok) for p in ps]
    print(f"top_k {top_k} top_p {top_p}: acceptance {stats.acceptance:.3f}, {stats.tokens_per_round:.2f} tokens "
          f"per round; Bonferroni-adjusted p per position: " + " ".join(f"{p:.3f}" for p in adjusted))
    assert all(p > 0.01 for p in adjusted), adjusted
