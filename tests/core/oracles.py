"""Slow, obviously-correct reference implementations of the core's rules (one request at a time)."""

from __future__ import annotations

import math

import torch


def best_paths_oracle(logprobs: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """Rank paths of one request ([L, K] sorted log-probs), best first, the first `budget` without a
    -inf log-prob. Scores: exact integer sums in units of 2^-20 nats (log-probs floored at -1000).
    Within a depth: score descending, then the parent's place in its own depth, then the token rank;
    across depths: score descending, then the shallower path."""
    depth_max, topk = logprobs.shape
    topk = min(topk, max(budget, 1))
    table = [[None if x == -math.inf else round(max(x, -1000.0) * 2**20) for x in row] for row in logprobs.double().tolist()]
    ranked: list[tuple[float, int, int, tuple[int, ...]]] = []  # (-score, depth, place in depth, path)
    previous = [((), 0)]  # depth-(d-1) paths in order, with their scores (None: through a -inf)
    for depth in range(1, depth_max + 1):
        children = []
        for place, (path, score) in enumerate(previous):
            for rank in range(topk):
                term = table[depth - 1][rank]
                child = None if score is None or term is None else score + term
                children.append((child is None, -(child or 0), place, rank, path + (rank,), child))
        children.sort(key=lambda c: c[:4])
        previous = [(c[4], c[5]) for c in children]
        ranked += [(-score, depth, place, path) for place, (path, score) in enumerate(previous) if score is not None]
    ranked.sort()
    return [path for *_, path in ranked[:budget]]


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


def best_transition_paths_oracle(transitions: torch.Tensor, budget: int, topk: int) -> list[tuple[int, ...]]:
    """Candidate paths of one request ([L, K, K] transition log-probs, row 0 read at depth 1), best
    first, the first `budget` without a -inf log-prob, by enumerating every path depth by depth. A
    node's children: its row's candidates by log-prob descending (ties: lower index), the first `topk`.
    Scores: exact integer sums in units of 2^-20 nats (log-probs floored at -1000). Within a depth:
    score descending, then the parent's place in its own depth, then the child's rank; across depths:
    score descending, then the shallower path."""
    depth_max, num_candidates, _ = transitions.shape
    table = [[[None if x == -math.inf else round(max(x, -1000.0) * 2**20) for x in row] for row in rows] for rows in transitions.double().tolist()]
    ranked: list[tuple[int, int, int, tuple[int, ...]]] = []  # (-score, depth, place in depth, path)
    previous: list[tuple[tuple[int, ...], int | None]] = [((), 0)]
    for depth in range(1, depth_max + 1):
        children = []
        for place, (path, score) in enumerate(previous):
            row = table[depth - 1][path[-1] if path else 0]
            by_rank = sorted(range(num_candidates), key=lambda c: (row[c] is None, -(row[c] or 0), c))[:topk]
            for rank, candidate in enumerate(by_rank):
                child = None if score is None or row[candidate] is None else score + row[candidate]
                children.append((child is None, -(child or 0), place, rank, path + (candidate,), child))
        children.sort(key=lambda c: c[:4])
        previous = [(c[4], c[5]) for c in children]
        ranked += [(-score, depth, place, path) for place, (path, score) in enumerate(previous) if score is not None]
    ranked.sort()
    return [path for *_, path in ranked[:budget]]
