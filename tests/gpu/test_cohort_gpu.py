"""GPU tier for the cohort engine (engine.engine over lanes.gpu) on the shipped small model:
16 requests of different lengths (greedy, K = 0 and K = 3 mixed, one seeded sampled request) give the same
tokens alone and in cohorts of 2, 4 and 8 with requests joining and leaving mid-stream; a lone request
equals Model.generate; nothing is captured or compiled at request time (every bucket and round graph
exists after start-up); every slot and page is free afterwards, the start-up's round-cost lanes' too; a lane
near its context end finishes with plain steps; the prefix cache's state and page copies are exact, and a second
turn restores its prefix and equals the same request without reuse. Run: pytest -m gpu tests/gpu/test_cohort_gpu.py -q -s"""
import random
from pathlib import Path

import pytest

from ninfer_gen.cli.env import build_root

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "models/qwen3.8-small-py"
CONTEXT = 1024


@pytest.fixture(scope="module")
def model():
    from ninfer_gen.api import load

    return load(SMALL, backend="gpu", cohorts=8, draft=3, max_context=CONTEXT, build_root=build_root(), prefix_states=4)


@pytest.fixture(scope="module")
def lanes(model):
    return model.lanes(8, prefix_cache=0)


def _requests():
    from ninfer_gen.engine import Request
    from ninfer_gen.sampling import SamplingParams

    rng = random.Random(3)
    reqs = []
    for i in range(16):
        n = rng.choice([3, 17, 40, 90, 200, 333])
        prompt = [rng.randrange(1, 4000) for _ in range(n)]
        sampling = SamplingParams(temperature=0.8, top_k=40, seed=11) if i == 5 else SamplingParams()
        reqs.append(Request(prompt, rng.randint(8, 60), sampling, draft=3 if i % 2 else 0))
    return reqs


def _run(lanes, reqs, n_lanes: int, prefill_budget: int = 64):
    from ninfer_gen.engine import Engine

    engine = Engine(lanes, lanes=n_lanes, prefill_budget=prefill_budget, max_queue=len(reqs))
    handles = [engine.submit(r) for r in reqs[:n_lanes + 2]]
    for r in reqs[n_lanes + 2:]:                 # the rest join one per step while others run and leave
        engine.step()
        handles.append(engine.submit(r))
    engine.run_until_idle()
    finals = [h.result() for h in handles]
    assert all(f.finish == "length" for f in finals), [f.error for f in finals if f.finish != "length"]
    return [h.tokens for h in handles], engine


def _captured(be) -> tuple:
    return (len(be.exe.buckets), sum(b.graph is not None for b in be.exe.buckets.values()),
            len(be.exe.rounds), sum(r.graph is not None for r in be.exe.rounds.values()))


def test_cohorts_of_2_4_8_equal_each_request_alone(model, lanes):
    be = model.backend
    captured = _captured(be)
    assert captured[0] == captured[1] and captured[2] == captured[3] > 0
    reqs = _requests()
    alone = [_run(lanes, [r], 1)[0][0] for r in reqs]
    for n_lanes in (2, 4, 8):
        got, engine = _run(lanes, reqs, n_lanes)
        diff = [i for i, (a, b) in enumerate(zip(alone, got)) if a != b]
        assert not diff, f"{n_lanes} lanes: requests {diff} differ from their run alone"
        s = engine.stats()
        assert s["lanes_busy"] == 0 and s["slots_in_use"] == 0 and s["pages_in_use"] == 0
        print(f"{n_lanes} lanes: {s['rounds']} rounds, {s['lane_rounds'] / s['rounds']:.2f} lanes per round, "
              f"acceptance {s['acceptance']:.3f}")
    assert _captured(be) == captured, "a bucket or round was bound or captured at request time"


@pytest.mark.parametrize("n", [5, 8])
def test_prompts_run_together_equal_each_run_alone(model, n):
    """GpuBackend.prefill_many (the prompts' tail steps as (B, 4) and (B, 1) steps) and mtp_many (the MTP passes
    and chained single-slot steps, batched) give each sequence the bits it gets alone."""
    import torch

    be, rng = model.backend, random.Random(n)
    prompts = [[rng.randrange(1, 4000) for _ in range(m)] for m in (3, 17, 30, 45, 70, 7, 21, 2)[:n]]

    def run(group):
        seqs = [be.new_sequence() for _ in group]
        try:
            outs = be.prefill_many(seqs, group, all_hidden=[True] * len(group))
            nxt = [p[1:] + [5] for p in group]
            mtp = be.mtp_many(seqs, [h for _, h in outs], nxt, [0] * len(group))
            chained = be.mtp_many(seqs, [m[1] for m in mtp], [[7]] * len(group), [len(p) for p in group])
            return [(o[0].cpu(), o[1].cpu(), m[0].cpu(), m[1].cpu(), c[0].cpu(), c[1].cpu())
                    for o, m, c in zip(outs, mtp, chained)]
        finally:
            for s in seqs:
                be.release(s)

    together = run(prompts)
    for i, p in enumerate(prompts):
        alone = run([p])[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, together[i])), f"prompt {i} ({len(p)} tokens)"


def test_a_lone_request_equals_model_generate(model, lanes):
    """Prompts within one prefill chunk: the engine's calls are the single-sequence path's."""
    for r in _requests()[:6]:
        if not r.sampling.greedy:
            continue
        got = _run(lanes, [r], 1, prefill_budget=lanes.prefill_chunk)[0][0]
        assert got == model.generate(list(r.prompt), r.max_tokens, draft=r.draft), f"prompt of {len(r.prompt)}"


def test_round_costs_come_from_throwaway_lanes_that_leave_nothing_behind(model, lanes):
    """Start-up measured a round's cost in plain steps for every cohort bucket by running throwaway lanes through the
    adapter (lanes.round_costs); afterwards no slot or page is held, and a request's tokens are plain decoding's."""
    costs = dict(lanes.caps.round_cost)
    print(f"round cost in plain steps: {costs}")
    assert set(costs) == {b for b in lanes.round_sizes if b in lanes.step_sizes}
    assert all(0.2 < c < 10 for c in costs.values()), costs
    usage = lanes.usage()
    assert usage["slots_in_use"] == 0 and usage["pages_in_use"] == 0, usage
    r = _requests()[1]
    assert _run(lanes, [r], 1)[0][0] == model.generate(list(r.prompt), r.max_tokens)


def test_the_context_end_finishes_with_plain_steps(model, lanes):
    """A speculative lane whose context has no room for another round continues with plain steps and stops
    at its limit; its tokens equal plain decoding's."""
    from ninfer_gen.engine import Request

    n = CONTEXT - 30
    prompt = [random.Random(9).randrange(1, 4000) for _ in range(n)]
    spec_tokens, _ = _run(lanes, [Request(prompt, 100, draft=3)], 1)
    plain_tokens, _ = _run(lanes, [Request(prompt, 100, draft=0)], 1)
    assert spec_tokens[0] == plain_tokens[0] and len(spec_tokens[0]) == CONTEXT - n + 1


def test_prefix_checkpoint_protocol_copies_bit_for_bit(model):
    """allocators.prefix's backend protocol on the GPU: a saved state restored into another slot, and a KV
    page copied, equal their sources bit for bit; a freed handle lets its memory go."""
    import torch

    be = model.backend
    a, b = be.new_sequence(), be.new_sequence()
    try:
        be.prefill(a, [random.Random(4).randrange(1, 4000) for _ in range(150)])
        handle = be.save_state(a)
        assert sum(t.numel() * t.element_size() for t in handle) == be.state_bytes
        be.reserve(b, 1)
        be.restore_state(handle, b)
        for t in be._gdn_tensors():
            assert torch.equal(t[a.slot], t[b.slot])
        src, dst = a.table.pages[0], b.table.pages[0]
        be.copy_page(src, dst)
        for layer in be.state.kv.values():
            for t in layer.values():
                assert torch.equal(t[src], t[dst])
        be.free_state(handle)
        assert not handle
    finally:
        be.release(a)
        be.release(b)


@pytest.mark.parametrize("draft", [0, 3])
def test_second_turn_restores_the_prefix_and_equals_no_reuse(model, lanes, draft):
    """Prefix reuse on the GPU: turn 2 (turn 1's prompt + its answer + new tokens) restores the answer's
    checkpoint, prefills only the rest, and gives the tokens the same request gives without reuse — or, the
    answer's state having come from the decode kernels and not the prefill ones, splits from them only at a
    near tie of the no-reuse logits (within 1 % of the largest)."""
    from ninfer_gen.engine import Request
    from ninfer_gen.lanes.gpu import GpuLanes

    reuse = GpuLanes(model.backend, prefix_cache=4)
    rng = random.Random(20 + draft)
    turn1 = [rng.randrange(1, 4000) for _ in range(700)]
    (answer,), _ = _run(reuse, [Request(turn1, 24, draft=draft)], 1)
    turn2 = turn1 + answer + [rng.randrange(1, 4000) for _ in range(50)]
    (with_reuse,), engine = _run(reuse, [Request(turn2, 32, draft=draft)], 1)
    cached = len(turn1) + len(answer) - 1
    assert engine.stats()["prefix_hit_tokens"] == cached and engine.stats()["prefill_tokens"] == len(turn2) - cached
    (without,), _ = _run(lanes, [Request(turn2, 32, draft=draft)], 1)
    print(f"K={draft}: turn 2 of {len(turn2)} tokens restored {cached}, prefilled {len(turn2) - cached}")
    if with_reuse != without:
        # the restored answer's state and KV were computed by the decode kernels (turn 1), the same tokens
        # without reuse by the prefill kernels: equal up to rounding, so a split may only come at a near tie
        i = next(j for j, (x, y) in enumerate(zip(with_reuse, without)) if x != y)
        margin, scale = _margin(model.backend, turn2 + without[:i], without[i], with_reuse[i])
        print(f"K={draft}: split at token {i}: logits {without[i]} vs {with_reuse[i]} differ by {margin:.4f} "
              f"(largest logit {scale:.2f})")
        assert abs(margin) <= 0.01 * scale, f"split at token {i} with a margin of {margin:.3f}: not rounding"
    reuse.reuse.cache.clear()
    assert model.backend.blocks.free_pages == model.backend.blocks.num_pages


def _margin(be, ids: list[int], a: int, b: int) -> tuple[float, float]:
    """Prefill `ids` on a fresh sequence: the last position's logit of `a` minus that of `b`, and the largest
    logit's magnitude."""
    seq = be.new_sequence()
    try:
        logits, _ = be.prefill(seq, ids)
    finally:
        be.release(seq)
    row = logits[-1].float()
    return float(row[a] - row[b]), float(row.abs().max())


def test_constrained_lanes_give_schema_valid_json_among_free_lanes(model, lanes):
    """Structured output on the GPU lanes: a JSON-schema grammar masks every token (host-driven rounds with
    K = 3, masked plain steps with K = 0): the outputs parse and validate, speculative greedy equals plain
    greedy, and free device-round lanes in the same cohort give what they give alone."""
    import json

    pytest.importorskip("llguidance")
    from ninfer_gen.engine import Engine, Request
    from ninfer_gen.engine.grammar import GrammarCompiler

    tok = model.tokenizer
    eos = set(model.eos_ids)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    grammar = GrammarCompiler(tok, model.spec.model.vocab_size, eos).json_schema(schema)
    prompt = tok.encode("The weather request as JSON: ")
    reqs = [Request(prompt, 60, stop=eos, constraint=grammar), Request(prompt, 60, stop=eos, draft=3, constraint=grammar)]
    free = [Request(r.prompt, 30, draft=3) for r in _requests()[:3]]
    alone = [_run_any(lanes, [r])[0] for r in reqs + free]
    for tokens in alone[:2]:
        value = json.loads(tok.decode([t for t in tokens if t not in eos]))
        assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9 and len(value["city"]) <= 12
    assert alone[0] == alone[1]
    engine = Engine(lanes, lanes=5, max_queue=8)
    handles = [engine.submit(r) for r in reqs + free]
    engine.run_until_idle()
    assert [h.tokens for h in handles] == alone


def _run_any(lanes, reqs):
    """Like _run, but a request may end on a stop token."""
    from ninfer_gen.engine import Engine

    engine = Engine(lanes, lanes=len(reqs), max_queue=len(reqs))
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle()
    finals = [h.result() for h in handles]
    assert all(f.finish in ("stop", "length") for f in finals), [f.error for f in finals]
    return [h.tokens for h in handles]


def test_per_request_k_mixed_in_one_cohort_of_8(model, lanes):
    """K = 0, 1, 2 and 3 (built K = 3) in one cohort of 8: a lane keeps at most its own K drafts in the K-bucket's
    round, and each request's greedy tokens equal its plain greedy output (lossless); per K the acceptance and
    tokens per round are printed."""
    from ninfer_gen.engine import Engine, Request

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 4000) for _ in range(rng.choice([9, 40, 120]))] for _ in range(8)]
    reqs = [Request(p, 48, draft=i % 4) for i, p in enumerate(prompts)]
    engine = Engine(lanes, lanes=8, max_queue=8)
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle()
    for r, h in zip(reqs, handles):
        final = h.result()
        assert final.finish == "length", final.error
        assert h.tokens == model.generate(list(r.prompt), 48), f"K = {r.draft}: differs from plain greedy"
        s = final.stats
        assert s.drafted == r.draft * s.rounds
        print(f"K = {r.draft}: acceptance {s.acceptance:.1%}, {s.tokens_per_round:.2f} tokens per round")


@pytest.mark.parametrize("n", [1, 3, 5, 6, 8])
def test_run_cli_any_number_of_prompts_equals_each_alone(model, capsys, n):
    """`ninfer-gen run --backend gpu --json --draft 3` with n 64-token code prompts, 64 new tokens (the backend
    built for n lanes: buckets of the spec's sizes ≤ n and n itself): every request finishes and its text
    equals the prompt's solo greedy run."""
    import json

    from ninfer_gen.cli.main import main

    tok = model.tokenizer
    source = (ROOT / "ninfer_gen" / "engine" / "engine.py").read_text()
    ids = tok.encode(source)
    prompts = [tok.decode(ids[200 * i:200 * i + 64]) for i in range(n)]
    argv = ["run", "--backend", "gpu", "--json", "--draft", "3", "--max-tokens", "64", "--max-context", str(CONTEXT)]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == n and all(r["finish"] in ("length", "stop") and not r["error"] for r in rows)
    for r, p in zip(sorted(rows, key=lambda r: r["index"]), prompts):
        solo = model.generate(tok.encode(p), 64, stop_tokens=model.eos_ids)
        assert r["tokens"] == solo, f"prompt {r['index']} of {n}"
