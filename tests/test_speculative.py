"""The speculative round's logic (ninfer_gen.speculative) on the CPU: greedy acceptance, rejection sampling
whose output distribution is the target's (chi-square), truncation at stop tokens and the token budget,
and whole rounds on the reference backend (verify in record mode, ReplaySSM commit, MTP drafts): greedy
output with K drafts equals plain greedy decoding, a stop token inside a round ends the output where
plain decoding ends it, and the CLI prints acceptance and tokens per round."""
import math

import pytest
import torch

import ninfer_gen
from ninfer_gen.sampling import SamplingParams, distribution
from ninfer_gen.speculative import Stats, accept_greedy, accept_sampled, truncate


def _logits(best: list[int], vocab: int = 7) -> torch.Tensor:
    out = torch.zeros(len(best), vocab)
    out[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return out


def test_greedy_acceptance_keeps_the_matching_prefix_then_the_target_token():
    assert accept_greedy([1, 2, 3], _logits([1, 2, 3, 4])) == [1, 2, 3, 4]          # all kept + bonus
    assert accept_greedy([1, 2, 3], _logits([1, 5, 3, 4])) == [1, 5]                # second rejected
    assert accept_greedy([6, 2, 3], _logits([1, 2, 3, 4])) == [1]                   # first rejected
    assert accept_greedy([], _logits([4])) == [4]


def test_truncation_at_stop_tokens_and_budget():
    assert truncate([1, 2, 3, 4], {3}, 10) == [1, 2, 3]
    assert truncate([1, 2, 3, 4], None, 2) == [1, 2]
    assert truncate([1, 2, 3, 4], {9}, 0) == []


def _chi2_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic over cells with expected count ≥ 5 (Wilson–Hilferty)."""
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_outputs_the_target_distribution():
    """K = 2 drafts from q against fixed target rows p0, p1, p2: the first two output tokens are
    distributed as p0 ⊗ p1 (the rounds that keep draft 1 and those that resample it alike), including
    tokens q never proposes and drafts p forbids."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.0, 0.1, 0.2], [0.3, 0.3, 0.2, 0.1, 0.1]])
    counts, n = torch.zeros(5, 5), 40_000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = accept_sampled(drafts, q, p, gen)
        if len(out) == 1:                        # a rejection ended the round: the next token comes from p1
            out.append(int(torch.multinomial(p[1], 1, generator=gen)))
        counts[out[0], out[1]] += 1
    expected = (p[0][:, None] * p[1][None, :]) * n
    assert counts[4].sum() == 0                  # p0 forbids token 4: q's draft of it is always rejected
    assert _chi2_p(counts.flatten(), expected.flatten()) > 0.01


def test_distribution_matches_the_sampler_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    greedy = distribution(logits, SamplingParams())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    top = distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top[0, 2:] == 0).all() and math.isclose(float(top.sum()), 1.0, rel_tol=1e-6)
    nucleus = distribution(logits, SamplingParams(temperature=0.5, top_p=0.6))
    assert int((nucleus > 0).sum()) == 1


@pytest.fixture(scope="module")
def small():
    return ninfer_gen.load(device="cpu")


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy_on_the_reference(small, k):
    """Same tokens, unless they part at a near-tie of the plain run (the verify's matmuls see K+1 rows,
    the step's one: fp32 rounding may flip a top-2 within 1e-3 of a logit's spread)."""
    for prompt in ("def fibonacci(n):\n", "import json\n\nclass Encoder"):
        ids = small.tokenizer.encode(prompt)
        plain, stats = small.generate(ids, 24), Stats()
        spec = list(small.stream(ids, 24, SamplingParams(), None, draft=k, stats=stats))
        assert len(spec) == 24 and stats.rounds > 0 and 0 <= stats.accepted <= stats.drafted == k * stats.rounds
        if spec != plain:
            i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
            top = torch.from_numpy(small.forward_logits(ids + plain[:i])[-1]).double().topk(2).values
            assert (top[0] - top[1]) < 1e-3, f"K={k}: tokens part at {i} away from a tie"


def test_a_stop_token_inside_a_round_ends_the_output_there(small):
    ids = small.tokenizer.encode("def add(a, b):\n")
    plain = small.generate(ids, 20)
    stop = {plain[7]}
    first = next(i for i, t in enumerate(plain) if t in stop)
    stats = Stats()
    spec = list(small.stream(ids, 20, SamplingParams(), stop, draft=3, stats=stats))
    assert spec == plain[:first + 1] and 1 + stats.emitted == len(spec)      # + the prefill's token


def test_cli_run_prints_acceptance_and_refuses_drafting_without_mtp(capsys):
    from ninfer_gen.cli import main

    argv = ["run", "--backend", "reference", "--device", "cpu", "--prompt", "x = 1", "--max-tokens", "6"]
    assert main(argv + ["--draft", "2"]) == 0
    assert "2 drafts per round: acceptance" in capsys.readouterr().err
    assert main(argv + ["--draft", "0"]) == 0 and "plain decode" in capsys.readouterr().err
    assert main(argv + ["--draft", "-1"]) == 2 and "--draft must be ≥ 0" in capsys.readouterr().err


def test_rounds_that_keep_every_draft_stop_inside_the_context(monkeypatch):
    """A round that keeps all K drafts near the context end: the next drafts would be chained past the last
    position, so the stream stops at the context limit instead (it used to fail reserving the pages)."""
    from ninfer_gen.lanes import reference as speculative       # where the reference lanes take accept_greedy

    model = ninfer_gen.load("model_specs/qwen3.8-tiny.yaml", device="cpu", max_context=64)
    keep_all = lambda drafts, logits: drafts + [int(logits.reshape(len(drafts) + 1, -1)[-1].argmax())]
    monkeypatch.setattr(speculative, "accept_greedy", keep_all)
    ids = list(range(1, 41))
    stats = Stats()
    out = list(model.stream(ids, 100, SamplingParams(), None, draft=3, stats=stats))
    assert stats.rounds > 0 and stats.emitted == 4 * stats.rounds      # at most 4 a round: every round kept all
    held = len(ids) + len(out) - 1                   # the last token is the next anchor, never run
    assert held <= 64 and 64 - held <= 3, f"stopped {64 - held} positions before the context limit"
