"""GPU tier for CompileOptions.fold_in_verify (fused rounds with no commit step: each verify folds the previous
round's records of the other record set first): on the shipped small model, a cohort of 4 lanes (greedy and
seeded sampled, K = 3, lanes joining and finishing at different times, a prefix-cache second turn) gives the same
tokens as a build with a commit step (fold_in_verify off; on is the default since session 21), bit for bit, and its
round graph launches fewer kernels (no commit step: two folds per GDN layer gone).
Run: pytest -m gpu tests/gpu/test_fold_in_verify_gpu.py -q -s"""
import pytest

from cohort_run import cohort_tokens, load_small

pytestmark = pytest.mark.gpu


def _run(fold_in_verify: bool):
    from compiler.options import CompileOptions

    tokens, lanes = cohort_tokens(load_small(CompileOptions(fold_in_verify=fold_in_verify)))
    return tokens, lanes.round_graph(4, "greedy").launches


def test_rounds_that_fold_inside_the_verify_give_the_commit_steps_tokens():
    committed, rounds = _run(False)
    folded, fewer = _run(True)
    for i, (a, b) in enumerate(zip(committed, folded)):
        assert a == b, f"request {i}: the folding rounds part from the commit step's"
    print(f"a C4 round: {rounds} launches with a commit step, {fewer} folding inside the verify")
    assert rounds - fewer > 0
