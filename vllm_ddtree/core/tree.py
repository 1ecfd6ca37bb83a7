"""Best-first DDTree construction from a DFlash draft's per-depth top-k, batched over requests.

The rule (DDTree, arXiv 2604.12989): a depth-d node is a token path x_1..x_d and its score is
sum_{i<=d} log q_i(x_i), where q_i is the draft's distribution at block position i. A child never
scores above its parent, so the `budget` best nodes form a prefix-closed tree: the tree that maximises
expected acceptance under that surrogate.

Order and ties. Nodes are ranked by the key (score descending, depth ascending, rank path ascending
lexicographically), where the rank path lists each node's rank in its depth's top-k. Scores are
accumulated left to right in float64; ties mean exact equality of those sums. A parent always precedes
its children and a sibling of lower rank precedes one of higher rank, so the top-`budget` set under
this key is prefix-closed. Nodes with score -inf are never included.

Batched algorithm (no per-request Python loops, no host syncs). Depth by depth, keep the `budget` best
depth-d paths (a "layer", stored in key order). Every node of the final tree is in its depth's layer,
and every member of a depth-d layer extends a member of the depth-(d-1) layer. A candidate made of the
parent of key-rank i and the child token of rank j is dominated by the (i+1)(j+1)-1 candidates with
smaller i' <= i, j' <= j, so only pairs with (i+1)(j+1) <= budget are ever scored. Finally one stable
sort of all layers (depth-major) by score picks the `budget` best nodes in key order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, padded to N = budget + 1 nodes per request.

    All tensors are [R, N]. Column 0 is the root: the last committed token, at depth 0, which the
    verify pass places at the request's next position `start`. Invariants:
    - valid nodes are exactly columns 0 .. num_nodes-1; the root is always valid;
    - parents[:, 0] == -1 and 0 <= parents[r, i] < i for every other valid node;
    - depths[r, i] == depths[r, parents[r, i]] + 1; a node's RoPE position is start + depth;
    - siblings carry distinct tokens; valid nodes are in best-first (key) order;
    - padded nodes have parent -1, depth 0, rank 0 and the root's token.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    valid: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int
    """Static bound on depths (the number of draft depths given); bounds every path walk."""

    @property
    def num_requests(self) -> int:
        return self.token_ids.shape[0]

    @property
    def nodes_per_request(self) -> int:
        return self.token_ids.shape[1]


@lru_cache(maxsize=256)
def _candidate_pairs(layer_width: int, topk: int, budget: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent key-rank i, child rank j) pairs with (i+1)(j+1) <= budget; the only ones that can win."""
    parent = torch.arange(layer_width)
    children_per_parent = torch.clamp(budget // (parent + 1), max=topk)
    parent_idx = torch.repeat_interleave(parent, children_per_parent)
    group_start = torch.cumsum(children_per_parent, 0) - children_per_parent
    child_rank = torch.arange(parent_idx.numel()) - torch.repeat_interleave(group_start, children_per_parent)
    return parent_idx.to(device), child_rank.to(device)


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    return inverse.scatter_(1, perm, torch.arange(perm.shape[1], device=perm.device).expand_as(perm))


def build_draft_trees(
    root_token_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    top_token_ids: torch.Tensor,
    budget: int,
) -> DraftTree:
    """Build one best-first tree per request.

    Args:
        root_token_ids: [R] the last committed token of each request (the verify root).
        top_logprobs: [R, L, K] log q_i of the draft's top-K tokens at depth i+1, sorted descending
            along K; entries are finite or -inf. L = block_size - 1 is the maximum depth.
        top_token_ids: [R, L, K] the matching token ids (distinct within each [r, i] row).
        budget: number of non-root nodes; the verify pass sees budget + 1 tokens per request.

    Returns:
        A DraftTree with N = budget + 1 columns (see its invariants).
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    num_req, max_depth, topk = top_logprobs.shape
    device = top_logprobs.device
    topk = min(topk, max(budget, 1))
    logprobs = top_logprobs[:, :, :topk].to(torch.float64)
    token_table = top_token_ids[:, :, :topk]

    # Flat candidate store, depth-major; entry 0 is the root with score +inf so it always ranks first.
    scores = [torch.full((num_req, 1), float("inf"), dtype=torch.float64, device=device)]
    parent_flat = [torch.full((num_req, 1), -1, dtype=torch.long, device=device)]
    depths = [torch.zeros((num_req, 1), dtype=torch.long, device=device)]
    ranks = [torch.zeros((num_req, 1), dtype=torch.long, device=device)]
    tokens = [root_token_ids.view(num_req, 1).long()]

    layer_score = torch.zeros((num_req, 1), dtype=torch.float64, device=device)
    layer_lexpos = torch.zeros((num_req, 1), dtype=torch.long, device=device)
    layer_offset, flat_size = 0, 1  # flat index of the parent layer's first entry; entries so far
    for depth in range(1, max_depth + 1 if budget > 0 else 1):
        parent_idx, child_rank = _candidate_pairs(layer_score.shape[1], topk, budget, str(device))
        cand_score = layer_score[:, parent_idx] + logprobs[:, depth - 1, child_rank]
        cand_lex = layer_lexpos[:, parent_idx] * topk + child_rank
        # Key order within a depth: score descending, then rank path ascending (lex sort, then stable).
        by_lex = torch.argsort(cand_lex, dim=1)
        by_key = by_lex.gather(1, torch.sort(cand_score.gather(1, by_lex), dim=1, descending=True, stable=True)[1])
        keep = by_key[:, : min(budget, parent_idx.numel())]

        kept_parent = parent_idx[keep]
        kept_rank = child_rank[keep]
        layer_score = cand_score.gather(1, keep)
        layer_lexpos = _inverse_permutation(torch.argsort(cand_lex.gather(1, keep), dim=1))
        scores.append(layer_score)
        parent_flat.append(layer_offset + kept_parent)
        depths.append(torch.full_like(kept_rank, depth))
        ranks.append(kept_rank)
        tokens.append(token_table[:, depth - 1].gather(1, kept_rank))
        layer_offset, flat_size = flat_size, flat_size + keep.shape[1]

    flat_score = torch.cat(scores, 1)
    num_cols = budget + 1
    if flat_score.shape[1] < num_cols:  # fewer distinct paths than the budget: pad with -inf
        pad = num_cols - flat_score.shape[1]
        flat_score = torch.nn.functional.pad(flat_score, (0, pad), value=float("-inf"))
    order = torch.sort(flat_score, dim=1, descending=True, stable=True)[1][:, :num_cols]
    valid = flat_score.gather(1, order) > float("-inf")

    def pick(parts: list[torch.Tensor], fill: torch.Tensor | int) -> torch.Tensor:
        flat = torch.cat(parts, 1)
        flat = torch.nn.functional.pad(flat, (0, flat_score.shape[1] - flat.shape[1]))
        return torch.where(valid, flat.gather(1, order), fill)

    final_of_flat = torch.full_like(flat_score, -1, dtype=torch.long)
    final_of_flat.scatter_(1, order, torch.arange(num_cols, device=device).expand(num_req, num_cols))
    picked_parent_flat = pick(parent_flat, -1)
    parents = torch.where(picked_parent_flat >= 0, final_of_flat.gather(1, picked_parent_flat.clamp(min=0)), -1)
    root = root_token_ids.view(num_req, 1).long().expand(num_req, num_cols)
    return DraftTree(
        token_ids=pick(tokens, root),
        parents=parents,
        depths=pick(depths, 0),
        ranks=pick(ranks, 0),
        valid=valid,
        num_nodes=valid.sum(1),
        max_depth=max_depth,
    )


def tree_attention_mask(tree: DraftTree) -> torch.Tensor:
    """[R, N, N] bool: mask[r, i, j] is True iff node j is node i or one of its ancestors.

    Together with the whole committed prefix this is what node i attends to in the verify pass.
    Padded nodes see only themselves. Built by walking parent pointers max_depth times.
    """
    num_req, num_nodes = tree.parents.shape
    self_idx = torch.arange(num_nodes, device=tree.parents.device).expand(num_req, num_nodes)
    mask = torch.zeros((num_req, num_nodes, num_nodes), dtype=torch.bool, device=tree.parents.device)
    current = self_idx
    for _ in range(tree.max_depth + 1):
        mask.scatter_(2, torch.where(current >= 0, current, self_idx).unsqueeze(2), True)
        current = torch.where(current >= 0, tree.parents.gather(1, current.clamp(min=0)), -1)
    return mask
