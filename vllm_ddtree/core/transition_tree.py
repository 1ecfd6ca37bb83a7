"""Best-first DDTree over a draft whose candidates at adjacent depths are scored as transitions
(DFlash2's candidate selector), batched over requests, on the host.

The draft gives, per depth d = 1..L, K candidate tokens and transition log-probs
log p_d(c | c') of candidate c at depth d after candidate c' at depth d - 1 (at depth 1 the root is
the predecessor: row 0 is read). A depth-d node is a candidate path c_1..c_d and its score is
sum_{i<=d} log p_i(c_i | c_{i-1}), the path's log-probability under the selector's chain. A child
never scores above its parent, so the `budget` best nodes form a prefix-closed tree. With every row of
a depth equal (the per-position marginals, rows sorted descending) the score and the tree are those of
`tree.build_draft_trees`.

Scores are `tree.fixed_point_logprobs` integers (exact sums, real ties). A node's children are its
candidates in order of their transition log-prob (descending, ties to the lower candidate index), the
first `topk`; a child's rank is its place there. Order ("key"), as `tree.build_draft_trees`: score
descending, then shallower first, then (same depth) the child of the parent built first, then the lower
rank; a path through a -inf log-prob is never built. Built by a lazy best-first search per request: the
heap holds each built node's first child and next sibling, neither of which outranks it.
"""

from __future__ import annotations

import heapq

import torch

from vllm_ddtree.core.tree import MAX_BUDGET, NEG_INF, DraftTree, fixed_point_logprobs


def build_transition_trees(
    root_token_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
    transition_logprobs: torch.Tensor,
    budget: int,
    topk: int | None = None,
    with_chain: bool = False,
) -> DraftTree:
    """One best-first tree per request, scored by transitions.

    Args:
        root_token_ids: [R] the last committed token of each request (the verify root).
        candidate_ids: [R, L, K] the draft's candidate tokens per depth (distinct within each [r, d]).
        transition_logprobs: [R, L, K, K] log p_{d+1}(candidate c | candidate p at depth d) at
            [r, d, p, c], finite or -inf; at d = 0 only row p = 0 is read (the root precedes).
        budget: number of non-root nodes, in 0..MAX_BUDGET.
        topk: children kept per node (None: all K).
        with_chain: set `chain_token_ids`: the rank-0 walk's tokens (each depth's best successor of the
            previous depth's choice), -1 from its first -inf log-prob.

    Returns:
        A DraftTree with N = budget + 1 columns (host tensors; its invariants), ranks as above.
    """
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")
    num_req, max_depth, num_candidates = candidate_ids.shape
    width = min(num_candidates, topk or num_candidates, max(budget, 1))
    fixed = fixed_point_logprobs(transition_logprobs.cpu())
    # Each row's children in key order: descending score, ties to the lower candidate index.
    order = torch.sort(fixed, dim=-1, descending=True, stable=True).indices[..., :width]
    child_scores = fixed.gather(-1, order)
    roots = root_token_ids.view(-1).tolist()
    tokens_all, orders_all, scores_all = candidate_ids.cpu().tolist(), order.tolist(), child_scores.tolist()
    trees = [_one_tree(root, tokens_all[r], orders_all[r], scores_all[r], budget, width) for r, root in enumerate(roots)]
    columns = budget + 1
    num_nodes = [len(tree[0]) for tree in trees]
    padded = [[field + [pad] * (columns - len(field)) for field, pad in zip(tree, (root, -1, 0, 0))] for tree, root in zip(trees, roots)]
    table = torch.tensor(padded, dtype=torch.long).view(num_req, 4, columns).transpose(0, 1)  # one conversion
    chain = _chain_walk(candidate_ids.cpu(), order[..., 0], child_scores[..., 0]) if with_chain else None
    return DraftTree.from_fields(table, torch.tensor(num_nodes, dtype=torch.long), max_depth, chain)


def _one_tree(root: int, tokens: list, orders: list, scores: list, budget: int, width: int) -> tuple[list[int], ...]:
    """One request's nodes in key order (the module's rule): (token ids, parents, depths, ranks), root
    first. tokens [L][K]; orders / scores [L][K][width]: each row's children (candidate indices) in key
    order and their fixed-point log-probs."""
    max_depth = len(tokens)
    token_ids, parents, depths, ranks = [root], [-1], [0], [0]
    candidate_of, path_score = [0], [0]  # per built node: its candidate index, its score
    heap: list[tuple[int, int, int, int]] = []  # (-score, depth, parent, rank)

    def push(parent: int, depth: int, rank: int) -> None:
        if depth <= max_depth and rank < width:
            term = scores[depth - 1][candidate_of[parent] if depth > 1 else 0][rank]
            if term != NEG_INF:
                heapq.heappush(heap, (-(path_score[parent] + term), depth, parent, rank))

    if budget > 0:
        push(0, 1, 0)
    while heap and len(token_ids) <= budget:
        negative, depth, parent, rank = heapq.heappop(heap)
        candidate = orders[depth - 1][candidate_of[parent] if depth > 1 else 0][rank]
        node = len(token_ids)
        token_ids.append(tokens[depth - 1][candidate])
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        candidate_of.append(candidate)
        path_score.append(-negative)
        push(parent, depth, rank + 1)
        push(node, depth + 1, 0)
    return token_ids, parents, depths, ranks


def _chain_walk(candidate_ids: torch.Tensor, best: torch.Tensor, best_scores: torch.Tensor) -> torch.Tensor:
    """[R, L] the rank-0 walk's tokens: at each depth the best successor of the previous depth's choice
    (the root's row at depth 1); -1 from the first depth whose best log-prob is -inf."""
    num_req, max_depth, _ = candidate_ids.shape
    chain = torch.full((num_req, max_depth), -1, dtype=torch.long)
    previous = torch.zeros(num_req, dtype=torch.long)
    alive = torch.ones(num_req, dtype=torch.bool)
    rows = torch.arange(num_req)
    for depth in range(max_depth):
        choice = best[rows, depth, previous]
        alive &= best_scores[rows, depth, previous] != NEG_INF
        chain[:, depth] = torch.where(alive, candidate_ids[rows, depth, choice], -1)
        previous = choice
    return chain
