"""Smaller shapes' accepted tokens read off a verified tree, against each shape's own walk
(`vllm_ddtree.core.budget.read_off`)."""

from __future__ import annotations

import dataclasses
import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.strategies import draft_tables
from vllm_ddtree.core import accept_tree, build_draft_trees, chain_token_ids_of
from vllm_ddtree.core.budget import OFF, TreeShape, accepted_by_shape, candidate_shapes, chain_accepted, nested_shapes, tokens_by_shape


def test_nested_shapes_are_the_prefix_trees_of_the_used_shape():
    shapes = candidate_shapes(32, 7)  # off, 4, chain 7, 8, 16, 32
    assert nested_shapes(shapes, TreeShape(16)) == [TreeShape(0, 1), TreeShape(4), TreeShape(8), TreeShape(16)]
    assert nested_shapes(shapes, TreeShape(7, 1)) == [TreeShape(0, 1), TreeShape(7, 1)]
    assert nested_shapes(shapes, TreeShape(0, 1)) == [TreeShape(0, 1)]


def prefix_target(token_ids: torch.Tensor, seed: int, vocab: int = 16):
    """A deterministic target: its token after request r's draft path `prefix` (a tuple of tokens).
    Often the draft's rank-0 token at the next depth (long rank-0 runs), else rank 1 or any token."""
    rng, memo = random.Random(seed), {}
    depth, topk = token_ids.shape[1:]

    def target(r: int, prefix: tuple[int, ...]) -> int:
        if (r, prefix) not in memo:
            u, d = rng.random(), len(prefix)
            ranked = token_ids[r, d].tolist() if d < depth else []
            memo[r, prefix] = ranked[0] if u < 0.7 and ranked else ranked[1] if u < 0.85 and topk > 1 and ranked else rng.randrange(vocab)
        return memo[r, prefix]

    return target


def node_paths(tree, r: int) -> list[tuple[int, ...]]:
    """Token path (root excluded) of every node of request r."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.nodes_per_request):
        parent = int(tree.parents[r, i])
        paths.append(paths[parent] + (int(tree.token_ids[r, i]),) if tree.valid[r, i] else ())
    return paths


def chain_walk(r: int, logprobs: torch.Tensor, token_ids: torch.Tensor, target, chain_depth: int) -> list[int]:
    """The tokens request r's chain (each depth's rank-0 token, cut at -inf) accepts in its own verify walk."""
    chain: list[int] = []
    while len(chain) < min(chain_depth, token_ids.shape[1]) and logprobs[r, len(chain), 0] > float("-inf"):
        if target(r, tuple(chain)) != int(token_ids[r, len(chain), 0]):
            break
        chain.append(int(token_ids[r, len(chain), 0]))
    return chain


@given(draft_tables(max_depth=6), st.integers(0, 40), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_chain_tokens_read_off_a_tree_equal_the_chains_own_walk(table, budget, chain_depth, seed):
    """Against the chain's own verify walk under the same target: equal, except where the tree ends
    just below the chain's accepted run (then a lower bound), which best-first trees do only when they
    hold no node one depth deeper."""
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    target = prefix_target(token_ids, seed)
    target_at_nodes = torch.tensor([[target(r, p) for p in node_paths(tree, r)] for r in range(roots.shape[0])])
    read_off = chain_accepted(tree, accept_tree(tree, target_at_nodes).accepted_nodes, chain_depth)
    for r in range(roots.shape[0]):
        chain = chain_walk(r, logprobs, token_ids, target, chain_depth)
        run = int(read_off[r])
        assert run <= len(chain)
        if run < len(chain):
            depths = tree.depths[r][tree.valid[r]]
            assert not (depths == run + 1).any()


@given(draft_tables(max_depth=6), st.integers(0, 40), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_the_chains_tokens_take_its_read_off_one_depth_further(table, budget, chain_depth, seed):
    """With the draft's rank-0 tokens kept with the trees and the target's tokens at the nodes, the
    read-off equals the chain's own walk, or, where the tree ends below the accepted run, stands one
    token above the read-off without them and still below the walk (the target's token at the chain's
    next node is unknown)."""
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    target = prefix_target(token_ids, seed)
    target_at_nodes = torch.tensor([[target(r, p) for p in node_paths(tree, r)] for r in range(roots.shape[0])])
    accepted_nodes = accept_tree(tree, target_at_nodes).accepted_nodes
    without = chain_accepted(tree, accepted_nodes, chain_depth)
    kept = dataclasses.replace(tree, chain_token_ids=chain_token_ids_of(logprobs, token_ids))
    assert torch.equal(chain_accepted(kept, accepted_nodes, chain_depth), without)  # no target tokens: as before
    read_off = chain_accepted(kept, accepted_nodes, chain_depth, target_at_nodes)
    for r in range(roots.shape[0]):
        chain = chain_walk(r, logprobs, token_ids, target, chain_depth)
        run = int(read_off[r])
        assert int(without[r]) <= run <= len(chain)
        if run < len(chain):
            assert run == int(without[r]) + 1
            assert not (tree.depths[r][tree.valid[r]] == int(without[r]) + 1).any()


@given(draft_tables(max_depth=6), st.sampled_from([4, 8, 16, 32]), st.integers(0, 2**31 - 1), st.data())
def test_accepted_by_shape_equals_each_nested_trees_own_walk(table, budget, seed, data):
    """Each nested tree's accepted tokens, read off the big tree's walk, equal what that smaller tree's
    own walk accepts under the same target; requests without drafts do not count; the chain's entry is
    `chain_accepted`'s."""
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    target = prefix_target(token_ids, seed)
    num_req = roots.shape[0]
    target_at_nodes = torch.tensor([[target(r, p) for p in node_paths(tree, r)] for r in range(num_req)])
    accepted_nodes = accept_tree(tree, target_at_nodes).accepted_nodes
    verified = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_req, max_size=num_req)))
    shapes = candidate_shapes(32, token_ids.shape[1])
    used = TreeShape(budget)
    tree = dataclasses.replace(tree, chain_token_ids=chain_token_ids_of(logprobs, token_ids))
    counts = accepted_by_shape(shapes, used, tree, accepted_nodes, verified, target_at_nodes)
    if not verified.any():
        assert counts == {used: 0}
        return
    smallest = int(tree.num_nodes[verified].min()) - 1
    for shape, count in counts.items():
        if shape.is_chain:
            assert count == int(chain_accepted(tree, accepted_nodes, shape.budget, target_at_nodes)[verified].sum())
            continue
        assert shape == used or shape.budget <= smallest
        small = build_draft_trees(roots, logprobs, token_ids, shape.budget)
        own = accept_tree(small, target_at_nodes[:, : small.nodes_per_request]).num_accepted - 1
        assert count == int(own[verified].sum()), shape
    assert OFF in counts and counts[OFF] == 0 and used in counts


def test_tokens_by_shape_keeps_the_bonus_tokens():
    accepted = {OFF: 0, TreeShape(4): 3, TreeShape(8): 5}
    assert tokens_by_shape(9, TreeShape(8), accepted) == {OFF: 4, TreeShape(4): 7, TreeShape(8): 9}
    assert tokens_by_shape(4, OFF, {}) == {OFF: 4}
