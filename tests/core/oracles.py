"""Slow, obviously-correct reference implementations of the core's rules (one request at a time)."""

from __future__ import annotations

import itertools
import math

import torch


def best_paths_oracle(logprobs: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """All rank paths of one request ([L, K] sorted log-probs) ranked by (score desc, depth, ranks);
    the first `budget` with a finite score. Scores are left-to-right float64 sums."""
    depth_max, topk = logprobs.shape
    topk = min(topk, max(budget, 1))
    table = logprobs.double().tolist()
    paths = []
    for depth in range(1, depth_max + 1):
        for ranks in itertools.product(range(topk), repeat=depth):
            score = 0.0
            for d, r in enumerate(ranks):
                score += table[d][r]
            if score > -math.inf:
                paths.append((-score, depth, ranks))
    paths.sort()
    return [ranks for _, _, ranks in paths[:budget]]


def rank_paths(parents: list[int], ranks: list[int], num_nodes: int) -> list[tuple[int, ...]]:
    """Rank path of every non-root node, reconstructed by walking parents."""
    out = []
    for node in range(1, num_nodes):
        path, cur = [], node
        while cur > 0:
            path.append(ranks[cur])
            cur = parents[cur]
        out.append(tuple(reversed(path)))
    return out


def ancestor_mask_oracle(parents: list[int], valid: list[bool]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if not valid[i]:
            continue
        cur = parents[i]
        while cur >= 0:
            mask[i, cur] = True
            cur = parents[cur]
    return mask


def walk_oracle(tokens: list[int], parents: list[int], valid: list[bool], target: list[int]) -> tuple[list[int], int]:
    """The sequential walk with explicit child maps: (accepted node path incl. root, bonus token)."""
    children: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        if valid[i]:
            children[parents[i]][tokens[i]] = i
    path, cur = [0], 0
    while target[cur] in children[cur]:
        cur = children[cur][target[cur]]
        path.append(cur)
    return path, target[cur]
