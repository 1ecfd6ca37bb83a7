"""`build_transition_trees` (DFlash2's selector scores: a node's score is its path's log-probability
under the transitions between adjacent depths) against an exhaustive enumeration; with every row of a
depth equal (the per-position marginals) it is `build_draft_trees`."""

from __future__ import annotations

import pytest
import torch

from tests.core.oracles import best_transition_paths_oracle
from vllm_ddtree.core import build_draft_trees
from vllm_ddtree.core.transition_tree import build_transition_trees

FIELDS = ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes")


def _draft(seed: int, num_req: int, depth: int, k: int, ties: bool, dead: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(roots [R], candidate ids [R, L, K] distinct per depth, transition log-probs [R, L, K, K]): quantized
    to a few values when `ties`, a fraction `dead` of them -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_req, depth, k, k, generator=gen)
    if ties:
        logits = logits.mul(2).round()
    logits[torch.rand(logits.shape, generator=gen) < dead] = float("-inf")
    transitions = logits.log_softmax(-1).nan_to_num(nan=float("-inf"))
    candidate_ids = torch.stack([torch.randperm(50, generator=gen)[:k] for _ in range(num_req * depth)]).view(num_req, depth, k)
    return torch.randint(0, 50, (num_req,), generator=gen), candidate_ids, transitions


def _candidate_paths(tree, candidate_ids: torch.Tensor, r: int) -> list[tuple[int, ...]]:
    """Each valid non-root node's candidate path, in node order (tokens are distinct per depth)."""
    index = [{token: c for c, token in enumerate(row)} for row in candidate_ids[r].tolist()]
    tokens, parents = tree.token_ids[r].tolist(), tree.parents[r].tolist()
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, int(tree.num_nodes[r])):
        paths.append(paths[parents[node]] + (index[len(paths[parents[node]])][tokens[node]],))
    return paths[1:]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [0, 1, 5, 17, 200])
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("ties,dead", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_builder_equals_exhaustive_enumeration(seed, budget, topk, ties, dead):
    roots, candidate_ids, transitions = _draft(seed, 2, 3, 4, ties, dead)
    tree = build_transition_trees(roots, candidate_ids, transitions, budget, topk)
    assert tree.token_ids.shape == (2, budget + 1)
    for r in range(2):
        n = int(tree.num_nodes[r])
        assert tree.valid[r, :n].all() and not tree.valid[r, n:].any() and tree.token_ids[r, 0] == roots[r]
        assert (tree.token_ids[r, n:] == roots[r]).all() and (tree.parents[r, n:] == -1).all()
        paths = _candidate_paths(tree, candidate_ids, r)
        assert paths == best_transition_paths_oracle(transitions[r], budget, topk)  # same set, best-first order
        for node, path in enumerate(paths, start=1):
            assert int(tree.depths[r, node]) == len(path) and 0 <= int(tree.parents[r, node]) < node


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 7, 30])
def test_equal_rows_give_the_marginal_builders_tree(seed, budget):
    """Rows equal within a depth (sorted descending): the transitions are per-position marginals."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.randn(3, 4, 50, generator=gen).mul(2).round().log_softmax(-1).topk(5, dim=-1)
    roots = torch.arange(3)
    transitions = top.values.unsqueeze(2).expand(3, 4, 5, 5)
    ours = build_transition_trees(roots, top.indices, transitions, budget)
    marginal = build_draft_trees(roots, top.values, top.indices, budget)
    for name in FIELDS:
        assert torch.equal(getattr(ours, name), getattr(marginal, name)), name


@pytest.mark.parametrize("seed", range(4))
def test_the_chain_is_the_rank_zero_walk(seed):
    roots, candidate_ids, transitions = _draft(seed, 3, 4, 3, ties=False, dead=0.2)
    tree = build_transition_trees(roots, candidate_ids, transitions, 4, with_chain=True)
    assert tree.chain_token_ids is not None
    for r in range(3):
        expected, previous = [], 0
        for depth in range(4):
            row = transitions[r, depth, previous]
            previous = int(row.argmax())
            expected.append(int(candidate_ids[r, depth, previous]) if row.max() > float("-inf") and (not expected or expected[-1] >= 0) else -1)
        assert tree.chain_token_ids[r].tolist() == expected
        chain = build_transition_trees(roots[r : r + 1], candidate_ids[r : r + 1], transitions[r : r + 1], 4, topk=1)
        assert chain.token_ids[0, 1 : int(chain.num_nodes[0])].tolist() == [t for t in expected if t >= 0]
