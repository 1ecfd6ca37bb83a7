"""Best-first DDTree of one request whose candidates pass a path-dependent filter (e.g. a grammar).

Same rule as `tree.build_draft_trees`: a depth-d node is a token path x_1..x_d scored
sum_{i<=d} log q_i(x_i) (the same fixed-point log-probs), and the tree holds the `budget` best nodes;
here only among the candidates `admit(parent, token)` accepts. A rejected candidate's subtree is never
built (the filter is a property of the path, so its extensions are rejected too), and the budget goes
to the next best admitted ones. Lazy best-first enumeration: a heap of candidates keyed by (score
descending, shallower first, lower rank first); popping an admitted node pushes its first child (rank 0
at the next depth) and its next sibling; a rejected one pushes only its next sibling. Children never
score above their parent and siblings come in rank order, so nodes are appended in key order and every
prefix of the node list is a best-first tree (parents precede children).

One request at a time, in Python: meant for the few requests whose filter needs per-node host work
(grammar states), whose cost dominates anyway.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from vllm_ddtree.core.tree import INVALID_SCORE, DraftTree, fixed_point_logprobs


def build_filtered_tree(
    root_token_id: int,
    top_logprobs: torch.Tensor,
    top_token_ids: torch.Tensor,
    budget: int,
    admit: Callable[[int, int], bool],
) -> DraftTree:
    """One request's tree [1, budget + 1] (DraftTree invariants), best-first among admitted candidates.

    top_logprobs, top_token_ids: [L, K] the draft's top-K log-probs (descending along K) and tokens at
    depths 1..L. admit(parent, token): whether `token` may follow the path of node `parent` (0: the
    root); called once per candidate considered, in key order; a True answer appends the node as the
    next index (so the caller can record that node's state, e.g. its grammar state).
    """
    max_depth, topk = top_logprobs.shape
    scores = fixed_point_logprobs(top_logprobs).tolist()
    tokens = top_token_ids.tolist()
    token_ids, parents, depths, ranks = [root_token_id], [-1], [0], [0]
    path_score = [0]
    heap: list[tuple[int, int, int, int]] = []  # (-score, depth, rank, parent)

    def push(parent: int, depth: int, rank: int) -> None:
        if depth <= max_depth and rank < topk:
            score = path_score[parent] + scores[depth - 1][rank]
            if score > INVALID_SCORE:
                heapq.heappush(heap, (-score, depth, rank, parent))

    push(0, 1, 0)
    while heap and len(token_ids) <= budget:
        negative_score, depth, rank, parent = heapq.heappop(heap)
        push(parent, depth, rank + 1)
        token = tokens[depth - 1][rank]
        if not admit(parent, token):
            continue
        node = len(token_ids)
        token_ids.append(token)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        path_score.append(-negative_score)
        push(node, depth + 1, 0)
    count = len(token_ids)
    pad = budget + 1 - count
    return DraftTree(
        token_ids=torch.tensor([token_ids + [root_token_id] * pad]),
        parents=torch.tensor([parents + [-1] * pad]),
        depths=torch.tensor([depths + [0] * pad]),
        ranks=torch.tensor([ranks + [0] * pad]),
        valid=torch.tensor([[True] * count + [False] * pad]),
        num_nodes=torch.tensor([count]),
        max_depth=max_depth,
    )
