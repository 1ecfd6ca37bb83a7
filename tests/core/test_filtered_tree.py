"""`build_filtered_tree`: the best-first tree among admitted candidates, against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_ddtree.core.filtered_tree import build_filtered_tree
from vllm_ddtree.core.tree import build_draft_trees, fixed_point_logprobs


def _draft(seed: int, depth: int, topk: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(depth, vocab, generator=gen).log_softmax(-1)
    top = logprobs.topk(topk, dim=-1)
    return top.values, top.indices


def _paths(tree) -> list[tuple[int, ...]]:
    """Every valid node's token path (root excluded), in node order."""
    tokens, parents, count = tree.token_ids[0].tolist(), tree.parents[0].tolist(), int(tree.num_nodes[0])
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, count):
        paths.append(paths[parents[node]] + (tokens[node],))
    return paths


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 4, 9, 20])
def test_admitting_everything_gives_the_batched_builders_tree(seed, budget):
    values, indices = _draft(seed, 4, 5)
    ours = build_filtered_tree(7, values, indices, budget, lambda parent, token: True)
    batched = build_draft_trees(torch.tensor([7]), values.unsqueeze(0), indices.unsqueeze(0), budget)
    for name in ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes"):
        assert torch.equal(getattr(ours, name), getattr(batched, name)), name


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [3, 8, 30])
def test_a_path_filter_keeps_the_best_admitted_paths(seed, budget):
    """Brute force: every path of the draft's top-k grid whose every prefix passes the filter, the
    `budget` best by score; the filter here forbids tokens by (depth, token) and pairs of neighbours."""
    depth, topk = 3, 4
    values, indices = _draft(seed, depth, topk)
    fixed = fixed_point_logprobs(values).tolist()

    def allowed(path: tuple[int, ...]) -> bool:
        return (path[-1] + len(path)) % 3 != 0 and not (len(path) > 1 and (path[-1] + path[-2]) % 5 == 0)

    tree_paths: list[tuple[int, ...]] = [()]

    def admit(parent: int, token: int) -> bool:
        path = tree_paths[parent] + (token,)
        if allowed(path):
            tree_paths.append(path)
            return True
        return False

    tree = build_filtered_tree(7, values, indices, budget, admit)
    assert _paths(tree) == tree_paths
    candidates = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(topk), repeat=d):
            path = tuple(indices[i, r].item() for i, r in enumerate(ranks))
            if all(allowed(path[: i + 1]) for i in range(d)):
                candidates.append((sum(fixed[i][r] for i, r in enumerate(ranks)), path))
    best = sorted(candidates, key=lambda c: (-c[0], len(c[1])))[:budget]
    assert set(tree_paths[1:]) == {path for _, path in best}
    parents, depths = tree.parents[0].tolist(), tree.depths[0].tolist()
    for node in range(1, int(tree.num_nodes[0])):
        assert 0 <= parents[node] < node and depths[node] == depths[parents[node]] + 1
