"""Candidate shapes and the buckets the policy times them in (`vllm_ddtree.core.budget.shapes`)."""

from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core.budget import TreeShape, batch_bucket, candidate_shapes, context_bucket, step_bucket


@given(st.integers(1, 2048), st.integers(0, 15))
def test_candidates_are_off_chain_and_doubling_trees_up_to_the_cap(cap, depth):
    shapes = candidate_shapes(cap, depth)
    assert shapes[0] == TreeShape(0, 1)
    assert len(set(shapes)) == len(shapes)
    assert all(s.budget <= cap for s in shapes) and shapes[-1] == TreeShape(cap)
    if depth:
        assert TreeShape(min(cap, depth), 1) in shapes
    trees = [s.budget for s in shapes if s.topk is None]
    assert all(b == cap or b & (b - 1) == 0 for b in trees)
    assert [s.budget for s in shapes] == sorted(s.budget for s in shapes)


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 16, 31)] == [0, 1, 1, 2, 2, 3, 4, 4]


def test_context_buckets_double_from_512_tokens_and_keep_batch_buckets_apart():
    assert [context_bucket(t) for t in (0, 511.9, 512, 1023, 1024, 2047, 2048, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 11]
    assert [context_bucket(t) for t in (float("nan"), float("inf"), -5.0)] == [0, 0, 0]
    assert [step_bucket(n, 100.0) for n in (1, 4, 16)] == [batch_bucket(n) for n in (1, 4, 16)]  # short contexts: the batch's
    buckets = {step_bucket(n, t) for n in (1, 2, 4, 8, 2**20) for t in (0, 600, 1500, 3000, 10**5)}
    assert len(buckets) == 25  # every (batch, context) pair its own bucket
