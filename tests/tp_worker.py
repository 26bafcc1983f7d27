"""What one rank of tests/test_tensor_parallel.py runs (a module-level function: ranks are spawned): the
tiny spec's seeded random weights at --tp `tp`, a prefill, decode steps, a verify and its commit, then
greedy generation with and without drafts. Also run with tp = 1 in the test's own process."""
SPEC = "model_specs/qwen3.8-tiny.yaml"


def run_rank(rank: int, tp: int, root: str, prompt: list[int], tokens: int) -> dict:
    import os

    import ninfer_gen

    os.chdir(root)
    model = ninfer_gen.load(SPEC, backend="reference", device="cpu", tp=tp, max_context=512)
    be = model.backend
    seq = be.new_sequence()
    prefill, _ = be.prefill(seq, prompt)
    steps, token = [], int(prefill[-1].argmax())
    for _ in range(4):
        logits, _ = be.run("step", [seq], [[token]])
        steps.append(logits)
        token = int(logits[-1].argmax())
    verify, _ = be.verify(seq, [token, 7, 11, 13])
    be.commit(seq, 2)
    after, _ = be.run("step", [seq], [[17]])
    be.release(seq)
    return {"rank": rank, "prefill": prefill, "steps": steps, "verify": verify, "after_commit": after,
            "plain": model.generate(prompt, tokens, draft=0), "drafted": model.generate(prompt, tokens, draft=3),
            "kv_heads": be.spec.model.attention.num_kv_heads, "value_heads": be.spec.model.linear_attention.num_value_heads}


def engine_rank(rank: int, tp: int, root: str) -> dict:
    """The cohort engine over ReplicatedLanes on the lead, `follow` on the other ranks (tp = 1: the plain
    engine): 6 requests of K = 0 and 3, greedy, seeded and unseeded sampling, one cancelled mid-stream."""
    import os

    import ninfer_gen
    from ninfer_gen.engine import Engine, Request
    from ninfer_gen.engine.replicated import ReplicatedLanes, follow
    from ninfer_gen.sampling import SamplingParams

    os.chdir(root)
    model = ninfer_gen.load(SPEC, backend="reference", device="cpu", tp=tp, max_context=256)
    lanes = model.lanes(4)
    if rank:
        return {"usage": follow(lanes)}
    lanes = ReplicatedLanes(lanes) if tp > 1 else lanes
    engine = Engine(lanes, lanes=4, max_queue=8, prefill_budget=8)
    sampled = [SamplingParams(temperature=0.9, top_k=20, seed=5), SamplingParams(temperature=0.9)]
    handles = [engine.submit(Request([3 + i, 40 + 7 * i] * (3 + 2 * i), 20, sampled[i - 4] if i >= 4 else
                                     SamplingParams(), draft=3 if i % 2 else 0)) for i in range(6)]
    for _ in range(3):
        engine.step()
    engine.cancel(handles[2].id)
    engine.run_until_idle()
    out = {"tokens": [h.tokens for h in handles], "finish": [h.result().finish for h in handles],
           "usage": lanes.usage()}
    if tp > 1:
        lanes.close()
    return out
