"""The reference best-first builder equals a brute-force enumeration, its output keeps its invariants, and
the device builder builds the same trees."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.oracles import ancestor_mask_oracle, best_paths_oracle, rank_paths
from tests.core.strategies import draft_tables
from vllm_ddtree.core import DraftTree, build_draft_trees, tree_attention_mask


def check_invariants(tree: DraftTree, roots: torch.Tensor, logprobs: torch.Tensor, token_ids: torch.Tensor) -> None:
    num_req, num_cols = tree.token_ids.shape
    for r in range(num_req):
        n = int(tree.num_nodes[r])
        assert tree.valid[r, :n].all() and not tree.valid[r, n:].any()
        assert tree.parents[r, 0] == -1 and tree.depths[r, 0] == 0 and tree.token_ids[r, 0] == roots[r]
        children: dict[int, set[int]] = {}
        for i in range(1, n):
            p = int(tree.parents[r, i])
            assert 0 <= p < i
            d = int(tree.depths[r, i])
            assert d == int(tree.depths[r, p]) + 1 and 1 <= d <= tree.max_depth
            assert tree.token_ids[r, i] == token_ids[r, d - 1, tree.ranks[r, i]]
            assert logprobs[r, d - 1, tree.ranks[r, i]] > float("-inf")
            siblings = children.setdefault(p, set())
            assert int(tree.token_ids[r, i]) not in siblings
            siblings.add(int(tree.token_ids[r, i]))
        for i in range(n, num_cols):
            assert tree.parents[r, i] == -1 and tree.depths[r, i] == 0 and tree.ranks[r, i] == 0
            assert tree.token_ids[r, i] == roots[r]


@given(draft_tables(), st.integers(0, 40))
def test_builder_equals_brute_force_top_budget_paths(table, budget):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    assert tree.token_ids.shape == (roots.shape[0], budget + 1)
    check_invariants(tree, roots, logprobs, token_ids)
    for r in range(roots.shape[0]):
        n = int(tree.num_nodes[r])
        built = rank_paths(tree.parents[r].tolist(), tree.ranks[r].tolist(), n)
        assert built == best_paths_oracle(logprobs[r], budget)  # same set, same best-first order


@given(draft_tables(), st.integers(0, 12))
def test_one_candidate_per_depth_gives_the_oracle_chain(table, budget):
    """K = 1 (and budget 1): every tree is the draft's chain, cut at the budget and the first -inf."""
    roots, logprobs, token_ids = (table[0], table[1][:, :, :1], table[2][:, :, :1])
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    check_invariants(tree, roots, logprobs, token_ids)
    for r in range(roots.shape[0]):
        built = rank_paths(tree.parents[r].tolist(), tree.ranks[r].tolist(), int(tree.num_nodes[r]))
        assert built == best_paths_oracle(logprobs[r], budget)


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_builder_matches_oracle_on_softmax_logprobs(num_req, depth, topk, budget, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_req, depth, 50, generator=gen) * 3
    top = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
    roots = torch.zeros(num_req, dtype=torch.long)
    tree = build_draft_trees(roots, top.values, top.indices, budget)
    check_invariants(tree, roots, top.values, top.indices)
    for r in range(num_req):
        built = rank_paths(tree.parents[r].tolist(), tree.ranks[r].tolist(), int(tree.num_nodes[r]))
        assert built == best_paths_oracle(top.values[r], budget)


@given(draft_tables(), st.integers(0, 40))
def test_tree_is_prefix_closed_and_scores_are_best_first(table, budget):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    for r in range(roots.shape[0]):
        n = int(tree.num_nodes[r])
        paths = rank_paths(tree.parents[r].tolist(), tree.ranks[r].tolist(), n)
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)
        scores = [sum(float(logprobs[r, d, k]) for d, k in enumerate(p)) for p in paths]
        assert scores == sorted(scores, reverse=True)


@given(draft_tables(), st.integers(0, 40))
def test_attention_mask_equals_dense_parent_walk(table, budget):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    mask = tree_attention_mask(tree)
    for r in range(roots.shape[0]):
        assert torch.equal(mask[r], ancestor_mask_oracle(tree.parents[r].tolist(), tree.valid[r].tolist()))


def test_budget_zero_gives_root_only():
    logprobs = torch.log_softmax(torch.randn(2, 3, 5), -1).sort(-1, descending=True).values
    tree = build_draft_trees(torch.tensor([3, 4]), logprobs, torch.arange(5).expand(2, 3, 5), 0)
    assert tree.token_ids.tolist() == [[3], [4]] and tree.num_nodes.tolist() == [1, 1]


def test_budget_one_is_the_top_token_at_depth_one():
    logprobs = torch.tensor([[[-0.1, -2.0], [-0.5, -1.0]]])
    tree = build_draft_trees(torch.tensor([9]), logprobs, torch.tensor([[[7, 8], [5, 6]]]), 1)
    assert tree.token_ids.tolist() == [[9, 7]] and tree.parents.tolist() == [[-1, 0]]


def test_budget_above_all_paths_takes_every_path_and_pads():
    logprobs = torch.log(torch.tensor([[[0.6, 0.4], [0.7, 0.3]]]))
    tree = build_draft_trees(torch.tensor([1]), logprobs, torch.tensor([[[2, 3], [4, 5]]]), 10)
    assert int(tree.num_nodes[0]) == 1 + 2 + 4
    assert tree.valid[0].tolist() == [True] * 7 + [False] * 4
    assert tree.token_ids.shape == (1, 11)


def test_depth_one_is_a_star_of_the_top_tokens():
    logprobs = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    tree = build_draft_trees(torch.tensor([0]), logprobs, torch.tensor([[[4, 5, 6]]]), 3)
    assert tree.token_ids.tolist() == [[0, 4, 5, 6]] and tree.parents.tolist() == [[-1, 0, 0, 0]]


def test_ties_prefer_shallower_then_lower_ranks():
    # Every log-prob is log(1/2): all depth-1 nodes tie with each other, and depth 2 is worse.
    logprobs = torch.full((1, 2, 2), -0.5)
    tree = build_draft_trees(torch.tensor([0]), logprobs, torch.tensor([[[1, 2], [3, 4]]]), 4)
    assert rank_paths(tree.parents[0].tolist(), tree.ranks[0].tolist(), 5) == [(0,), (1,), (0, 0), (0, 1)]
    # An exact tie across depths (score -1 at depth 1 and depth 2) goes to the shallower node.
    logprobs = torch.tensor([[[-0.5, -1.0], [-0.5, -2.0]]])
    tree = build_draft_trees(torch.tensor([0]), logprobs, torch.tensor([[[1, 2], [3, 4]]]), 2)
    assert rank_paths(tree.parents[0].tolist(), tree.ranks[0].tolist(), 3) == [(0,), (1,)]


def test_neg_inf_logprobs_are_never_nodes():
    logprobs = torch.tensor([[[0.0, float("-inf")], [float("-inf"), float("-inf")]]])
    tree = build_draft_trees(torch.tensor([0]), logprobs, torch.tensor([[[1, 2], [3, 4]]]), 5)
    assert int(tree.num_nodes[0]) == 2 and tree.token_ids[0, 1] == 1


@given(st.one_of(draft_tables(max_requests=4, max_depth=5, max_topk=5), draft_tables(max_depth=16, max_topk=1)), st.integers(1, 40))
def test_device_builder_builds_the_reference_trees(table, budget):
    """`_build_batched` (the device tensors' builder, run here on host tensors) and the reference
    `_build_by_heap` build identical trees, field by field and dtype by dtype: trees, chains (K = 1),
    -inf cuts (`draft_tables` draws them)."""
    from vllm_ddtree.core.tree import _build_batched, _build_by_heap

    roots, logprobs, token_ids = table
    topk = min(logprobs.shape[2], budget)
    root = roots.view(-1, 1).long()
    reference, device = _build_by_heap(root, logprobs, token_ids, budget, topk), _build_batched(root, logprobs, token_ids, budget, topk)
    for name in ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes"):
        a, b = getattr(reference, name), getattr(device, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert reference.max_depth == device.max_depth
