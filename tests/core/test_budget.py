"""Adaptive budget: candidates, warm-up, hold, exploration and convergence to the fastest shape."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core.budget import AdaptiveBudget, TreeShape, batch_bucket, candidate_shapes, nested_shapes


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


def simulate(policy: AdaptiveBudget, rates: dict[TreeShape, float], steps: int, num_requests: int = 4) -> list[TreeShape]:
    """Run the policy against a fixed throughput per shape (tokens/step / seconds/step)."""
    chosen = []
    for _ in range(steps):
        shape = policy.choose(num_requests)
        chosen.append(shape)
        policy.observe(num_requests, shape, 0.01, {shape: rates[shape] * 0.01})
    return chosen


def test_climbs_to_the_fastest_shape_without_trying_far_ones():
    shapes = candidate_shapes(64, 7)  # off, 4, chain of 7, 8, 16, 32, 64
    peak = shapes.index(TreeShape(16))
    rates = {s: 100.0 - 10 * abs(i - peak) for i, s in enumerate(shapes)}
    policy = AdaptiveBudget(shapes, hold=3, warmup=1, explore=0.0)
    chosen = simulate(policy, rates, 60)
    assert chosen[0] == TreeShape(8)  # start: the first tree of >= 8 nodes
    assert all(chosen[3 * i] == chosen[3 * i + 1] == chosen[3 * i + 2] for i in range(20))  # held 3 steps
    assert set(chosen[-30:]) == {TreeShape(16)}
    assert TreeShape(64) not in chosen and TreeShape(0, 1) not in chosen


def test_walks_down_to_off_when_speculation_does_not_pay():
    shapes = candidate_shapes(64, 7)
    policy = AdaptiveBudget(shapes, explore=0.0)
    chosen = simulate(policy, {s: 100.0 - s.budget for s in shapes}, 60)
    assert set(chosen[-15:]) == {TreeShape(0, 1)}
    assert TreeShape(64) not in chosen


def test_switches_when_the_fastest_shape_changes_and_falls_back_to_off():
    shapes = candidate_shapes(16, 7)
    policy = AdaptiveBudget(shapes, explore=0.1, decay=0.8)
    simulate(policy, {s: 100.0 + s.budget for s in shapes}, 200)  # big trees pay (100.0 + budget)
    late = simulate(policy, {s: 100.0 - s.budget for s in shapes}, 400)[-100:]  # now nothing pays
    assert late.count(TreeShape(0, 1)) >= 85


def test_batch_sizes_learn_separately():
    shapes = candidate_shapes(8, 7)
    policy = AdaptiveBudget(shapes, explore=0.0)
    for _ in range(60):
        for n, fast in ((1, TreeShape(8)), (16, TreeShape(0, 1))):
            shape = policy.choose(n)
            policy.observe(n, shape, 0.01, {shape: 2.0 if shape == fast else 1.0})
    assert policy.choose(1) == TreeShape(8)
    assert policy.choose(16) == TreeShape(0, 1)


def test_exploration_is_seeded():
    shapes = candidate_shapes(64, 7)
    rates = {s: float(i) for i, s in enumerate(shapes)}
    runs = [simulate(AdaptiveBudget(shapes, explore=0.3, seed=5), rates, 200) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0][-120:])) > 1  # exploration does leave the best shape
    assert torch.tensor([s == max(rates, key=rates.get) for s in runs[0][-120:]]).float().mean() > 0.6


def test_nested_shapes_are_the_prefix_trees_of_the_used_shape():
    shapes = candidate_shapes(32, 7)  # off, 4, chain 7, 8, 16, 32
    assert nested_shapes(shapes, TreeShape(16)) == [TreeShape(0, 1), TreeShape(4), TreeShape(8), TreeShape(16)]
    assert nested_shapes(shapes, TreeShape(7, 1)) == [TreeShape(0, 1), TreeShape(7, 1)]
    assert nested_shapes(shapes, TreeShape(0, 1)) == [TreeShape(0, 1)]


def test_counterfactual_tokens_need_only_timing_to_compare():
    """Tokens of nested trees come with every step of the big one; a shape is ranked once it is timed."""
    shapes = candidate_shapes(16, 7)
    policy = AdaptiveBudget(shapes, explore=0.0, warmup=1)
    tokens = {TreeShape(0, 1): 1.0, TreeShape(4): 2.0, TreeShape(8): 2.5, TreeShape(16): 2.6}
    policy.observe(1, TreeShape(16), 0.02, tokens)
    assert policy.tokens_per_second(0, TreeShape(16)) == 2.6 / 0.02
    assert policy.tokens_per_second(0, TreeShape(8)) is None  # counted, not yet timed
    policy.observe(1, TreeShape(8), 0.01, {s: tokens[s] for s in nested_shapes(shapes, TreeShape(8))})
    assert policy.tokens_per_second(0, TreeShape(8)) == 2.5 / 0.01
