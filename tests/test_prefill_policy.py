"""The prefill pacer (engine.prefill_policy): its budget from measured step costs, and the engine with a gap bound
on the reference lanes under a fake clock whose prefill costs a + b·n and whose round costs r — while a long
prompt prefills beside decoding lanes, every decoding lane's gap stays under the bound (without the bound it does
not), the long prompt's TTFT pays for it, and the decoding lanes' tokens are the same either way."""
import pytest

from compiler.spec import load_spec
from ninfer_gen.api import TINY_SPEC
from ninfer_gen.engine import Engine, Request
from ninfer_gen.engine.prefill_policy import PrefillPacer
from ninfer_gen.lanes.reference import ReferenceLanes
from ninfer_gen.reference import ReferenceBackend
from ninfer_gen.weights.random_weights import random_weights

A, B, R = 0.002, 1e-4, 0.01        # a prefill chunk: A + B·n seconds; a round: R seconds (the fake clock's)


def test_pacer_budget():
    p = PrefillPacer(0.03, most=256)
    assert p.budget(decoding=True) == 16 and p.budget(decoding=False) == 256      # nothing measured yet
    p.rounded(R)
    p.prefilled(128, A + B * 128)
    assert p.budget(True) == 128                   # (0.03 − 0.01) / 1.16e-4 = 172 tokens → the 128 bucket
    for _ in range(2):                              # small chunks' overhead makes tokens look dearer
        p.prefilled(16, A + B * 16)
    assert p.budget(True) == 64
    assert PrefillPacer(10.0, most=256, token_s=1e-4, round_s=R).budget(True) == 256   # capped by the budget
    assert PrefillPacer(0.011, most=256, token_s=1e-4, round_s=R).budget(True) == 16   # the floor: progress
    with pytest.raises(ValueError, match="positive"):
        PrefillPacer(0.0, most=256)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed(ReferenceLanes):
    """The reference lanes, each call advancing the fake clock by the cost model above."""

    def __init__(self, backend, clock: Clock):
        super().__init__(backend)
        self.clock = clock

    def prefill(self, lane, ids, last):
        self.clock.now += A + B * len(ids)
        return super().prefill(lane, ids, last)

    def round(self, lanes):
        self.clock.now += R
        return super().round(lanes)


@pytest.fixture(scope="module")
def backend(one_thread_module):
    spec = load_spec(TINY_SPEC)
    return ReferenceBackend(spec, random_weights(spec), device="cpu", max_sequences=4, max_context=2048)


def _run(backend, bound):
    clock = Clock()
    engine = Engine(Timed(backend, clock), lanes=4, prefill_budget=256, clock=clock, max_gap_s=bound)
    running = [engine.submit(Request([3 + i, 9, 27], 60)) for i in range(3)]
    for _ in range(4):
        engine.step()
    long = engine.submit(Request([5 + i % 500 for i in range(1200)], 4))
    stamps = {h: [] for h in running}
    while long.final is None or any(h.final is None for h in running):
        engine.step()
        for h in running:
            if h.poll():
                stamps[h].append(clock.now)
    gaps = [b - a for h in running for a, b in zip(stamps[h], stamps[h][1:])]
    return max(gaps), long.final.stats.ttft_s, [h.tokens for h in running], engine


def test_a_gap_bound_holds_while_a_long_prompt_prefills(backend):
    bound = 0.03
    free_gap, free_ttft, free_tokens, _ = _run(backend, None)
    paced_gap, paced_ttft, paced_tokens, engine = _run(backend, bound)
    print(f"\n1,200-token prompt beside 3 decoding lanes: largest gap {free_gap * 1e3:.1f} ms unpaced, "
          f"{paced_gap * 1e3:.1f} ms with a {bound * 1e3:.0f} ms bound; TTFT {free_ttft * 1e3:.0f} → "
          f"{paced_ttft * 1e3:.0f} ms")
    assert free_gap > bound and paced_gap <= bound + 1e-9
    assert paced_ttft > free_ttft                   # the long prompt pays for the others' smooth stream
    assert paced_tokens == free_tokens              # chunking another request never changes a lane's tokens
    assert engine.pacer.budget(decoding=True) == 128 and engine.pacer.budget(decoding=False) == 256
