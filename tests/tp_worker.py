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
