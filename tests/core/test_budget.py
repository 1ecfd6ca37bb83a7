"""Adaptive budget: path probabilities, the batch-wide cut and the online models equal slow oracles."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.strategies import draft_tables
from vllm_ddtree.core import build_draft_trees
from vllm_ddtree.core.budget import (
    AdaptiveBudget,
    StepCostModel,
    best_node_count,
    best_node_order,
    node_counts,
    path_probabilities,
)


@given(draft_tables(), st.integers(0, 20))
def test_path_probability_is_the_product_along_parent_pointers(table, budget):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    probs = path_probabilities(tree, logprobs)
    for r in range(roots.shape[0]):
        for i in range(tree.token_ids.shape[1]):
            if not tree.valid[r, i]:
                assert probs[r, i] == 0.0
                continue
            total, node = 0.0, i
            while node > 0:
                total += float(logprobs[r, tree.depths[r, node] - 1, tree.ranks[r, node]])
                node = int(tree.parents[r, node])
            assert math.isclose(float(probs[r, i]), math.exp(total), rel_tol=1e-9, abs_tol=1e-300)


@given(draft_tables(), st.integers(0, 20), st.data())
def test_every_cut_keeps_tree_prefixes_and_takes_the_most_probable_nodes(table, budget, data):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    probs = path_probabilities(tree, logprobs)
    requests, values = best_node_order(probs)
    count = data.draw(st.integers(0, values.shape[0]))
    counts = node_counts(requests, roots.shape[0], count)
    assert int(counts.sum()) == count
    chosen, rest = [], []
    for r in range(roots.shape[0]):
        n = int(counts[r])
        assert n <= int(tree.num_nodes[r]) - 1
        chosen += probs[r, 1 : 1 + n].tolist()
        rest += [p for p in probs[r, 1 + n : int(tree.num_nodes[r])].tolist() if p > 0]
        # a prefix of a best-first tree is prefix-closed: every chosen node's parent is chosen
        assert all(int(tree.parents[r, i]) < 1 + n for i in range(1, 1 + n))
    assert sorted(chosen, reverse=True) == values[:count].tolist()
    assert not rest or not chosen or max(rest) <= min(chosen)


@given(
    st.lists(st.floats(0.0, 1.0), max_size=30),
    st.integers(1, 8),
    st.floats(0.05, 2.0),
    st.floats(1e-4, 1.0),
    st.floats(0.0, 0.1),
)
def test_best_count_maximises_expected_tokens_per_second(probs, num_requests, calibration, base, per_node):
    values = torch.tensor(sorted(probs, reverse=True), dtype=torch.float64)
    count = best_node_count(values, num_requests, calibration, base, per_node)

    def rate(m: int) -> float:
        return (num_requests + calibration * float(values[:m].sum())) / (base + per_node * m)

    best = max(rate(m) for m in range(len(probs) + 1))
    assert math.isclose(rate(count), best, rel_tol=1e-9)
    assert all(rate(m) < best * (1 - 1e-12) for m in range(count))  # smallest maximiser


def test_step_cost_model_recovers_a_linear_cost():
    model = StepCostModel()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        requests = int(torch.randint(1, 17, (1,), generator=gen))
        extra = int(torch.randint(0, 600, (1,), generator=gen))
        model.observe(requests, extra, 0.004 + 0.0005 * requests + 0.00002 * extra)
    a0, a1, w = model.coefficients()
    assert math.isclose(a0, 0.004, rel_tol=1e-3) and math.isclose(a1, 0.0005, rel_tol=1e-3)
    assert math.isclose(w, 0.00002, rel_tol=1e-3)


def _trained_policy(per_node_seconds: float, calibration: float) -> AdaptiveBudget:
    policy = AdaptiveBudget(explore=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):  # noiseless costs, varied sizes
        extra = int(torch.randint(0, 200, (1,), generator=gen))
        policy.cost.observe(4, extra, 0.01 + per_node_seconds * extra)
    policy.calibration.observe(predicted=100.0, accepted=100.0 * calibration)
    policy._steps = policy.warmup_steps
    return policy


def test_policy_verifies_nothing_when_nodes_cost_more_than_they_win_and_everything_when_free():
    tables = torch.log_softmax(torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(2)), -1).topk(8, -1)
    tree = build_draft_trees(torch.zeros(4, dtype=torch.long), tables.values, tables.indices, 16)
    probs = path_probabilities(tree, tables.values)
    assert _trained_policy(per_node_seconds=1.0, calibration=1.0).choose(probs).sum() == 0
    free = _trained_policy(per_node_seconds=0.0, calibration=1.0).choose(probs)
    assert torch.equal(free, tree.num_nodes - 1)


def test_warmup_cycles_through_sizes_and_is_seeded():
    probs = torch.tensor([[1.0, 0.9, 0.5, 0.2, 0.1]])
    runs = []
    for _ in range(2):
        policy = AdaptiveBudget(seed=3, explore=0.5)
        runs.append([int(policy.choose(probs).sum()) for _ in range(policy.warmup_steps + 20)])
    assert runs[0][:5] == [4, 0, 2, 1, 3]
    assert runs[0] == runs[1]
