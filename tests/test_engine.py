"""The cohort engine (engine.engine, lanes.contract) on the CPU with the reference backend and the tiny spec:
N concurrent requests give exactly what each gives alone (greedy and sampled, K = 0 and K = 3 mixed,
requests joining and leaving), per-lane stop tokens, token and context limits, cancellation and failures
free the lane's slot and pages, a full queue is refused, prefill chunks interleave with decode rounds
(fake clock), the background loop, and `ninfer-gen run` with several prompts."""
import json
import random
from dataclasses import replace

import pytest

from compiler.spec import load_spec
from ninfer_gen.engine import Engine, EngineFull, Request
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.api import TINY_SPEC
from ninfer_gen.sampling import SamplingParams
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights

CONTEXT = 128
GREEDY = SamplingParams()
pytestmark = pytest.mark.usefixtures("one_thread_module")     # tiny ops: one torch thread (conftest)


@pytest.fixture(scope="module")
def weights():
    spec = load_spec(TINY_SPEC)
    return spec, random_weights(spec)


def _backend(spec, weights, name: str) -> ReferenceBackend:
    """A fresh backend per test (a failed test's sequences die with it); `name` keys `alone`'s memo."""
    b = ReferenceBackend(spec, weights, device="cpu", max_sequences=8, max_context=CONTEXT)
    b.name = name
    return b


@pytest.fixture
def backend(weights):
    return _backend(*weights, "random")


@pytest.fixture
def flat(weights):
    """The LM head (shared by the MTP) scaled down: target and draft distributions are near uniform, so
    sampled rounds keep almost every draft and emit up to K + 1 tokens."""
    spec, w = weights
    return _backend(spec, w | {"lm_head.weight": w["lm_head.weight"] * 0.01}, "flat")


_ALONE: dict = {}


def alone(backend, request: Request, prefill_budget: int | None = None) -> list[int]:
    """The request's tokens when it runs by itself (one lane)."""
    key = (backend.name, request.prompt, request.max_tokens, request.sampling, request.stop, request.draft,
           request.max_context, prefill_budget)
    if key not in _ALONE:
        engine = Engine(ReferenceLanes(backend), lanes=1, prefill_budget=prefill_budget)
        handle = engine.submit(Request(request.prompt, request.max_tokens, request.sampling, request.stop,
                                       request.draft, max_context=request.max_context))
        handle.result()
        _ALONE[key] = handle.tokens
    return _ALONE[key]


def _all_free(backend) -> bool:
    return backend.slots.free_slots == backend.slots.num_slots and backend.blocks.free_pages == backend.blocks.num_pages


def _prompt(n: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(1, 500), n)


def test_cohort_equals_each_request_alone_greedy_mixed_k_joining_and_leaving(backend):
    """Six greedy requests of different lengths and K (0 and 3) through 3 lanes: queued ones join as
    others leave; one more joins mid-stream. Each equals its run alone, and alone equals the single-
    sequence path (plain steps), and with drafts equals without (greedy is lossless)."""
    reqs = [Request(_prompt(n, n), m, draft=k) for n, m, k in
            [(5, 6, 0), (17, 4, 3), (3, 7, 3), (9, 3, 0), (12, 5, 0), (2, 4, 3)]]
    engine = Engine(ReferenceLanes(backend), lanes=3, prefill_budget=8)
    handles = [engine.submit(r) for r in reqs[:5]]
    for _ in range(3):
        engine.step()
    handles.append(engine.submit(reqs[5]))
    engine.run_until_idle()
    for req, h in zip(reqs, handles):
        final = h.result()
        assert h.tokens == alone(backend, req, 8) and final.finish == "length" and final.stats.tokens == req.max_tokens
    assert engine.stats()["finished"] == {"length": 6} and _all_free(backend)
    # alone == the one-sequence paths (prompts ≤ the prefill budget: the same calls)
    plain, spec = reqs[0], reqs[2]
    seq, out = backend.new_sequence(), []
    logits, _ = backend.prefill(seq, list(plain.prompt))
    for _ in range(plain.max_tokens):
        out.append(int(logits[-1].argmax()))
        logits, _ = backend.run("step", [seq], [[out[-1]]])
    backend.release(seq)
    assert out == alone(backend, plain, 8)
    assert alone(backend, spec, 8) == alone(backend, replace(spec, draft=0), 8)      # lossless: drafts = plain


def test_sixteen_requests_in_cohorts_of_2_4_and_8_equal_each_alone(backend):
    """16 greedy requests of different lengths (K = 0 and 3): the first C + 2 start together, the rest join
    one per step while others run and leave. Every request's tokens equal its run alone for C = 2, 4, 8;
    with the K = 0 lanes batched into one B-row step (`batch_steps`) too (rows agree to fp32 rounding:
    these tokens are far from near-ties)."""
    rng = random.Random(1)
    reqs = [Request(_prompt(rng.randint(1, 20), 100 + i), rng.randint(2, 7), draft=3 if i % 3 == 0 else 0)
            for i in range(16)]
    want = [alone(backend, r, 8) for r in reqs]
    for lanes, batch in [(2, False), (4, False), (8, False), (4, True)]:
        engine = Engine(ReferenceLanes(backend, batch_steps=batch), lanes=lanes, prefill_budget=8, max_queue=16)
        handles = [engine.submit(r) for r in reqs[:lanes + 2]]
        for r in reqs[lanes + 2:]:
            engine.step()
            handles.append(engine.submit(r))
        engine.run_until_idle()
        assert [h.tokens for h in handles] == want, f"{lanes} lanes, batch_steps={batch}"
        assert engine.stats()["lanes_busy"] == 0 and _all_free(backend)


def test_per_lane_sampling_parameters_and_seeds(flat):
    """Sampled lanes (temperature, top-k, top-p, each its own seed) beside greedy ones, K = 0 and 3: each
    equals its run alone with the same seed; rounds keep drafts (multi-token)."""
    reqs = [Request(_prompt(4, 1), 8, SamplingParams(0.8, top_k=50, seed=1)),
            Request(_prompt(6, 2), 9, SamplingParams(1.0, seed=2), draft=3),
            Request(_prompt(3, 3), 9, SamplingParams(1.0, top_p=0.9, seed=3), draft=3),
            Request(_prompt(5, 4), 5, GREEDY, draft=3)]
    engine = Engine(ReferenceLanes(flat), lanes=4)
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle()
    for req, h in zip(reqs, handles):
        h.result()
        assert h.tokens == alone(flat, req)
    stats = handles[1].result().stats
    assert stats.accepted > 0 and stats.tokens_per_round > 1.5 and stats.drafted == 3 * stats.rounds
    again = Engine(ReferenceLanes(flat), lanes=2)
    same = [again.submit(Request(reqs[0].prompt, 8, replace(reqs[0].sampling, seed=s))) for s in (1, 7)]
    again.run_until_idle()
    assert [h.result().finish for h in same] == ["length"] * 2
    assert same[0].tokens == handles[0].tokens != same[1].tokens


def test_stop_tokens_max_tokens_and_context_limits_per_lane(flat):
    """In one cohort: a stop token that ends a multi-token round in its middle, a stop token of a plain
    lane, a token budget that cuts a round, and a lane whose own context limit ends it (K = 3: its
    last rounds verify fewer drafts)."""
    base = Request(_prompt(4, 5), 12, SamplingParams(1.0, seed=5), draft=3)
    full = alone(flat, base)
    stop = full[6]                       # inside the second round (tokens 5..8) when it keeps its drafts
    first = full.index(stop)
    plain = Request(_prompt(3, 6), 10, SamplingParams(1.0, seed=6))
    plain_full = alone(flat, plain)
    reqs = [Request(base.prompt, 12, base.sampling, {stop}, draft=3),
            Request(plain.prompt, 10, plain.sampling, {plain_full[3]}),
            Request(base.prompt, 6, base.sampling, draft=3),
            Request(_prompt(8, 7), 50, SamplingParams(1.0, seed=7), draft=3, max_context=14)]
    engine = Engine(ReferenceLanes(flat), lanes=4)
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle()
    finals = [h.result() for h in handles]
    assert handles[0].tokens == full[:first + 1] and finals[0].finish == "stop"
    assert handles[1].tokens == plain_full[:plain_full.index(plain_full[3]) + 1] and finals[1].finish == "stop"
    assert handles[2].tokens == full[:6] and finals[2].finish == "length"
    assert len(handles[3].tokens) == 14 - 8 + 1 and finals[3].finish == "length"     # the context is full
    assert _all_free(flat)


def test_cancel_mid_stream_frees_the_slot_and_pages(backend):
    engine = Engine(ReferenceLanes(backend), lanes=2, max_queue=2)
    long_req, short = Request(_prompt(70, 8), 40, draft=3), Request(_prompt(4, 9), 5)
    h_long, h_short = engine.submit(long_req), engine.submit(short)
    h_queued = engine.submit(Request(_prompt(3, 10), 5))
    while len(h_long.tokens) < 2:
        engine.step()
    use = engine.stats()
    # both prompts were prefilled in the first step (one budget for both): 72+ tokens on 2 pages, 4 + 5 on one
    assert use["slots_in_use"] == 2 and use["pages_in_use"] == 3 and use["queue_depth"] == 1
    assert h_queued.cancel() and h_queued.result().finish == "cancelled" and h_queued.tokens == []
    assert engine.cancel(h_long.id)                  # no step runs: freed at once
    after = engine.stats()
    assert after["slots_in_use"] == 1 and after["pages_in_use"] == 1                    # short's page only
    final = h_long.result()
    assert final.finish == "cancelled" and 2 <= len(h_long.tokens) < 40 and final.stats.tokens == len(h_long.tokens)
    engine.run_until_idle()
    assert h_short.tokens == alone(backend, short) and _all_free(backend)
    assert not engine.cancel(h_long.id) and engine.stats()["finished"] == {"cancelled": 2, "length": 1}


def test_a_full_queue_is_refused_and_bad_requests_are_clear_errors(backend):
    engine = Engine(ReferenceLanes(backend), lanes=1, max_queue=1)
    engine.submit(Request([1, 2], 3, id="a"))
    engine.submit(Request([3, 4], 3, id="b"))
    with pytest.raises(EngineFull, match=r"2 requests in the engine, the most it takes \(1 lanes \+ max_queue=1\)"):
        engine.submit(Request([5], 3))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.submit(Request([5], 3, id="a"))
    with pytest.raises(ValueError, match="outside the vocabulary of 512"):
        engine.submit(Request([512], 3))
    for bad, message in [(dict(prompt=[]), "prompt is empty"), (dict(prompt=[1], max_tokens=0), "max_tokens"),
                         (dict(prompt=[1], draft=-1), "draft")]:
        with pytest.raises(ValueError, match=message):
            Request(**bad)
    with pytest.raises(ValueError, match="between 1 and the backend's 8 state slots"):
        Engine(ReferenceLanes(backend), lanes=9)
    assert engine.cancel("a") and engine.cancel("b") and _all_free(backend)


class _Failing(ReferenceLanes):
    """Fails one request's lane in its third round (a plain step), or in its prefill."""

    def __init__(self, backend, bad_prompt, where):
        super().__init__(backend)
        self.bad_prompt, self.where = list(bad_prompt), where

    def prefill(self, lane, ids, last):
        if self.where == "prefill" and lane.prompt == self.bad_prompt:
            raise RuntimeError("injected prefill failure")
        return super().prefill(lane, ids, last)

    def _step(self, lane):
        if self.where == "round" and lane.prompt == self.bad_prompt and len(lane.tokens) == 3:
            raise RuntimeError("injected round failure")
        return super()._step(lane)


@pytest.mark.parametrize("where", ["round", "prefill"])
def test_a_failing_request_reports_an_error_and_the_others_continue(backend, where):
    ok = [Request(_prompt(6, 11), 6, draft=3), Request(_prompt(4, 12), 6)]
    bad = Request(_prompt(5, 13), 8)
    engine = Engine(_Failing(backend, bad.prompt, where), lanes=3)
    too_long = engine.submit(Request(_prompt(CONTEXT + 1, 14), 4))
    handles = [engine.submit(r) for r in ok] + [engine.submit(bad)]
    engine.run_until_idle()
    final = too_long.result()
    assert final.finish == "error" and "prompt of 129 tokens exceeds the context limit of 128" in final.error
    final = handles[2].result()
    assert final.finish == "error" and f"injected {where} failure" in final.error
    assert len(handles[2].tokens) == (3 if where == "round" else 0)
    assert [h.tokens for h in handles[:2]] == [alone(backend, r) for r in ok] and _all_free(backend)
    assert engine.stats()["finished"] == {"error": 2, "length": 2}


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Timed(ReferenceLanes):
    """Charges the fake clock 1 ms per prompt token and 10 ms per decode round."""

    def __init__(self, backend, clock):
        super().__init__(backend)
        self.clock = clock

    def prefill(self, lane, ids, last):
        self.clock.now += 1e-3 * len(ids)
        return super().prefill(lane, ids, last)

    def round(self, lanes):
        self.clock.now += 10e-3
        return super().round(lanes)


def test_prefill_chunks_interleave_with_decode_rounds(backend):
    """A 72-token prompt arrives while a lane decodes: with 8 tokens of prefill per step it takes 9 steps,
    and the running lane gets a round in each — its gap between tokens is one chunk plus one round
    (18 ms), never the whole prefill (72 ms)."""
    clock = _Clock()
    engine = Engine(_Timed(backend, clock), lanes=2, prefill_budget=8, clock=clock)
    running = engine.submit(Request(_prompt(4, 15), 30))
    for _ in range(3):
        engine.step()
    rounds_before, times = engine.stats()["rounds"], []
    long_req = Request(_prompt(72, 16), 3)
    late = engine.submit(long_req)
    seen = len(running.tokens)
    while not late.tokens:
        n = len(running.tokens)
        engine.step()
        times += [clock.now] * (len(running.tokens) - n)
    assert engine.stats()["rounds"] - rounds_before == 9 and len(running.tokens) - seen == 9
    assert max(b - a for a, b in zip(times, times[1:])) == pytest.approx(0.018)
    first = late.result().stats.ttft_s
    assert first == pytest.approx(9 * 8e-3 + 8 * 10e-3)           # 9 chunks, and the rounds between them
    engine.run_until_idle()
    assert late.tokens == alone(backend, long_req, 8) and _all_free(backend)


def test_background_loop_serves_threads_and_stop_cancels(backend):
    import threading

    engine = Engine(ReferenceLanes(backend), lanes=3)
    engine.start()
    reqs = [Request(_prompt(5, 20 + i), 4, draft=3 * (i % 2)) for i in range(4)]
    got = {}

    def client(i):
        handle = engine.submit(reqs[i])
        got[i] = (handle.result().finish, handle.tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(got[i] == ("length", alone(backend, reqs[i])) for i in range(4))
    pending = engine.submit(Request(_prompt(3, 30), 100))
    engine.stop()
    assert pending.result().finish == "cancelled" and not engine.running and _all_free(backend)


def test_many_requests_with_cancellations_leak_nothing(backend):
    rng = random.Random(0)
    engine = Engine(ReferenceLanes(backend, batch_steps=True), lanes=4, max_queue=40)
    handles = [engine.submit(Request(_prompt(rng.randint(1, 6), 40 + i), rng.randint(1, 3))) for i in range(30)]
    for i, h in enumerate(handles):
        if i % 4 == 1:
            h.cancel()
        if i % 3 == 0:
            engine.step()
    engine.run_until_idle()
    finals = [h.result() for h in handles]
    assert all(f.finish in ("length", "cancelled") for f in finals) and _all_free(backend)
    stats = engine.stats()
    assert sum(stats["finished"].values()) == 30 and stats["lanes_busy"] == stats["queue_depth"] == 0


def test_cli_runs_several_prompts_as_one_cohort(tmp_path, capsys):
    from ninfer_gen.cli import main

    base = ["run", "--weights", str(TINY_SPEC), "--device", "cpu", "--max-tokens", "4", "--max-context", "128"]
    assert main(base + ["--prompt", "ab", "--prompt", "xyz", "--draft", "0"]) == 0
    out = capsys.readouterr()
    assert "[1] ab" in out.out and "[2] xyz" in out.out and "[1: 2 prompt tokens, 4 new tokens" in out.err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ab\n\nxyz\nq\n")
    assert main(base + ["--prompts-file", str(prompts), "--json", "--draft", "3"]) == 0
    rows = sorted((json.loads(line) for line in capsys.readouterr().out.splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [1, 2, 3] and all(len(r["tokens"]) == 4 for r in rows)
    assert set(rows[0]) >= {"index", "text", "tokens", "ttft_ms", "decode_tok_s", "acceptance", "finish"}
    solo = main(base + ["--prompt", "ab", "--json", "--draft", "3"])
    assert solo == 0 and json.loads(capsys.readouterr().out)["tokens"] == rows[0]["tokens"]
    (tmp_path / "empty.txt").write_text("\n\n")
    for argv, message in [(["--prompts-file", str(tmp_path / "none.txt")], "no such prompts file"),
                          (["--prompts-file", str(tmp_path / "empty.txt")], "no prompts in"),
                          ([], "give a prompt: --prompt TEXT"),
                          (["--prompt", "a", "--prompt", "b", "--lanes", "0"], "--lanes")]:
        assert main(base + argv) == 2
        assert message in capsys.readouterr().err


class _Cuts(ReferenceLanes):
    """Records each lane's prefill chunks (their lengths, in order)."""

    def __init__(self, backend):
        super().__init__(backend)
        self.cuts: dict[tuple, list[int]] = {}

    def prefill(self, lane, ids, last):
        self.cuts.setdefault(tuple(lane.prompt), []).append(len(ids))
        return super().prefill(lane, ids, last)


def test_a_prompt_is_cut_as_it_is_alone_whatever_its_cohort_takes(backend):
    """A lane's chunks are its prompt cut every `prefill_budget` tokens, in any cohort: the chunk boundaries set the
    prefill's pieces and so its rounding (the GPU tier's 8 lanes, budget 64: a 90-token prompt behind lanes of 17,
    17, 3, 200 and 3 tokens was cut 16 + 64 + 10, not 64 + 26, and a sampled request drew other tokens). The same
    pattern at a quarter of the scale: the 22-token prompts were cut 2 + 16 + 4."""
    lengths = [5, 5, 1, 50, 1, 22, 22, 5]
    reqs = [Request(_prompt(n, 40 + i), 2) for i, n in enumerate(lengths)]
    lanes = _Cuts(backend)
    engine = Engine(lanes, lanes=8, prefill_budget=16)
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    for r, n in zip(reqs, lengths):
        assert lanes.cuts[tuple(r.prompt)] == [16] * (n // 16) + ([n % 16] if n % 16 else []), n
    assert _all_free(backend)


class _StepLog(ReferenceLanes):
    """Records which prompt (by its length) each prefill chunk of a step belongs to."""

    def __init__(self, backend):
        super().__init__(backend)
        self.step, self.log = 0, []

    def prefill(self, lane, ids, last):
        self.log.append((self.step, len(lane.prompt)))
        return super().prefill(lane, ids, last)


def _steps(engine, lanes, n, each=None):
    for _ in range(n):
        if each:
            each(lanes.step)
        engine.step()
        lanes.step += 1


def test_a_short_prompt_does_not_wait_behind_a_long_prefill(backend):
    """A prompt that is one chunk runs in the first step after it arrives, before a long prompt's next chunk (which
    no longer fits the step's budget and runs a step later): an agent's next turn does not queue behind another
    session's long prefill. The order changes no lane's tokens (each equals its run alone)."""
    long_req, short_req = Request(_prompt(80, 1), 3), Request(_prompt(10, 2), 3)
    lanes = _StepLog(backend)
    engine = Engine(lanes, lanes=4, prefill_budget=16)
    handles = {id(long_req): engine.submit(long_req)}
    _steps(engine, lanes, 2)                                     # the long prompt's first two chunks
    handles[id(short_req)] = engine.submit(short_req)
    _steps(engine, lanes, 1)
    assert lanes.log[-1] == (2, 10) and [s for s, n in lanes.log if n == 80] == [0, 1]
    _steps(engine, lanes, 1)
    assert lanes.log[-1] == (3, 80)                              # one step later, whole (16 tokens)
    engine.run_until_idle()
    for r in (long_req, short_req):
        assert handles[id(r)].tokens == alone(backend, r, 16)
    assert _all_free(backend)


def test_short_prompts_every_step_do_not_starve_a_long_one(backend):
    """A new one-chunk prompt every step goes first, but a long prompt passed over STARVE_STEPS steps in a row goes
    first in the next: it runs at least once every STARVE_STEPS + 1 steps and finishes."""
    from ninfer_gen.engine.engine import STARVE_STEPS

    long_req = Request(_prompt(96, 3), 1)
    lanes = _StepLog(backend)
    engine = Engine(lanes, lanes=4, prefill_budget=16)
    handle = engine.submit(long_req)
    _steps(engine, lanes, 40, each=lambda i: engine.submit(Request(_prompt(12, 100 + i), 1)))
    ran = [s for s, n in lanes.log if n == 96]
    assert len(ran) == 6 and ran[0] == STARVE_STEPS              # 96 tokens in chunks of 16, all run
    assert max(b - a for a, b in zip(ran, ran[1:])) <= STARVE_STEPS + 1, ran
    assert sum(n == 12 for _, n in lanes.log) >= 30              # the short prompts ran too
    assert handle.tokens == alone(backend, long_req, 16)
    engine.run_until_idle()
    assert _all_free(backend)
