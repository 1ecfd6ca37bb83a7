"""Best-first DDTree construction from a DFlash draft's per-depth top-k, batched over requests.

The rule (DDTree, arXiv 2604.12989): a depth-d node is a token path x_1..x_d and its score is
sum_{i<=d} log q_i(x_i), where q_i is the draft's distribution at block position i. A child never
scores above its parent, so the `budget` best nodes form a prefix-closed tree: the tree that maximises
expected acceptance under that surrogate.

Scores are exact integers: log-probs in units of 2^-20 nats (floored at -1000 nats), so sums are
associative and ties are real ties. Order ("key"), a deterministic total order:
- within a depth: score descending; ties go to the child of the better-keyed parent, then to the
  lower-ranked token of the depth's top-k;
- across depths: score descending, then shallower first.
A parent precedes its children and a lower-ranked sibling precedes a higher-ranked one, so the top-
`budget` set under this key is prefix-closed. Nodes through a -inf log-prob are never built.

Two builders give the same trees (the property tests hold them equal, and equal to a brute-force
enumeration):
- `_build_by_heap`, the reference, for host tensors: a lazy best-first search with a heap per request,
  the rule read directly. The engine runs its compiled transliteration, `host_tree.build_draft_trees_on_host`.
- `_build_batched`, for device tensors: the same selection as whole-batch torch ops, no per-request
  loop and no host sync. Depth by depth it keeps a "layer": the `budget` best depth-d paths in key
  order. Every node of the final tree lies in its depth's layer, and every layer member extends a
  member of the previous layer. The candidate (parent of layer position i, token of rank j) is preceded
  in key order by all (i' <= i, j' <= j), so only the pairs with (i+1)(j+1) <= budget are scored. Keys
  pack (score, tie-breaker) into one unique int64, so a plain top-k gives each new layer in key order,
  and one last top-k over all layers picks the tree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import torch

SCORE_BITS = 20
"""Scores are integers in units of 2^-SCORE_BITS nats (about 1e-6)."""
MIN_LOGPROB = -1000.0
"""Finite log-probs are floored here (float32 probabilities vanish long before)."""
NEG_INF = -(1 << 40)
"""Fixed-point stand-in for -inf; path scores are clamped here, below every finite path's score."""
INVALID_SCORE = NEG_INF // 2
"""Path scores at or below this came through a -inf log-prob; such nodes are never built."""
MAX_BUDGET = 2048
"""Largest budget whose packed sort keys fit in int64 (|score| <= 2^40, tie-breakers < 2^22)."""


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
    chain_token_ids: torch.Tensor | None = None
    """[R, L] the draft's rank-0 token at each depth, -1 from the first depth whose rank-0 log-prob is
    -inf (the chain's tokens: `chain_token_ids_of`), where the caller keeps them: they let the chain's
    accepted tokens be read off these trees one depth further (`budget.chain_accepted`). The builders
    leave it None."""

    @property
    def num_requests(self) -> int:
        return self.token_ids.shape[0]

    @property
    def nodes_per_request(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def from_fields(cls, fields: torch.Tensor, num_nodes: torch.Tensor, max_depth: int,
                    chain_token_ids: torch.Tensor | None = None) -> DraftTree:
        """The trees of fields [4, R, N] (token ids, parents, depths, ranks; padded as the invariants
        say) with num_nodes [R] valid nodes each: the host builders' one conversion to tensors."""
        return cls(token_ids=fields[0], parents=fields[1], depths=fields[2], ranks=fields[3],
                   valid=torch.arange(fields.shape[2]) < num_nodes.unsqueeze(1), num_nodes=num_nodes,
                   max_depth=max_depth, chain_token_ids=chain_token_ids)


def chain_token_ids_of(top_logprobs: torch.Tensor, top_token_ids: torch.Tensor) -> torch.Tensor:
    """`DraftTree.chain_token_ids` of a draft's top-K [R, L, K] (host or device tensors)."""
    reachable = (top_logprobs[:, :, 0] > float("-inf")).long().cummin(1).values.bool()
    return torch.where(reachable, top_token_ids[:, :, 0].long(), -1)


@lru_cache(maxsize=64)
def _candidate_pairs(budget: int, topk: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent layer position i, token rank j) with (i+1)(j+1) <= budget, ordered by i then j: the
    only candidates that can enter a layer. Their position in this list is the within-depth tie-breaker."""
    parent = torch.arange(budget)
    children_per_parent = torch.clamp(budget // (parent + 1), max=topk)
    parent_idx = torch.repeat_interleave(parent, children_per_parent)
    group_start = torch.cumsum(children_per_parent, 0) - children_per_parent
    child_rank = torch.arange(parent_idx.numel()) - torch.repeat_interleave(group_start, children_per_parent)
    return parent_idx.to(device), child_rank.to(device)


@lru_cache(maxsize=64)
def _layout(budget: int, topk: int, max_depth: int, device: str) -> tuple[torch.Tensor, ...]:
    """Constants of one (budget, topk, max_depth): the within-depth tie-breakers [P]; the across-depth
    tie-breakers of the flat node space [1, L, budget]; the flat index, minus 1, of the previous layer's
    first node per depth [1, L, 1] (a parent at layer position i of depth d-1 is flat 1 + (d-2)*budget + i);
    the depth of every flat node [1, 1 + L * budget]; and 0 .. budget [budget + 1]."""
    num_pairs = _candidate_pairs(budget, topk, device)[0].numel()
    node_space = max_depth * budget
    depth_of = torch.arange(1, max_depth + 1, device=device).view(1, max_depth, 1)
    return (
        num_pairs - 1 - torch.arange(num_pairs, device=device),
        node_space - 1 - torch.arange(node_space, device=device).view(1, max_depth, budget),
        1 + (depth_of - 2) * budget,
        torch.cat([torch.zeros((1, 1), dtype=torch.long, device=device), depth_of.expand(1, max_depth, budget).flatten(1)], 1),
        torch.arange(budget + 1, device=device),
    )


def fixed_point_logprobs(top_logprobs: torch.Tensor) -> torch.Tensor:
    """Log-probs as int64 multiples of 2^-SCORE_BITS nats, floored at MIN_LOGPROB; -inf (and NaN, no
    probability either, as in the chain builders) -> NEG_INF."""
    usable = top_logprobs > float("-inf")
    floored = torch.where(usable, top_logprobs.to(torch.float64).clamp(min=MIN_LOGPROB), 0.0)
    fixed = torch.round(floored * (1 << SCORE_BITS)).to(torch.long)
    return torch.where(usable, fixed, NEG_INF)


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
            along K; entries are finite or -inf. L, the number of draft depths given (at most
            block_size - 1), is the maximum depth.
        top_token_ids: [R, L, K] the matching token ids (distinct within each [r, i] row).
        budget: number of non-root nodes; the verify pass sees budget + 1 tokens per request.

    Returns:
        A DraftTree with N = budget + 1 columns (see its invariants).
    """
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")
    num_req, max_depth, topk = top_logprobs.shape
    device = top_logprobs.device
    root = root_token_ids.view(num_req, 1).long()
    if budget == 0 or max_depth == 0:
        zeros = torch.zeros((num_req, budget + 1), dtype=torch.long, device=device)
        valid = torch.zeros((num_req, budget + 1), dtype=torch.bool, device=device)
        valid[:, 0] = True
        return DraftTree(root.expand_as(zeros).clone(), zeros - 1, zeros, zeros.clone(), valid, valid.sum(1), max_depth)

    topk = min(topk, budget)
    if device.type == "cpu":
        return _build_by_heap(root, top_logprobs, top_token_ids, budget, topk)
    return _build_batched(root, top_logprobs, top_token_ids, budget, topk)


def _build_batched(root: torch.Tensor, top_logprobs: torch.Tensor, top_token_ids: torch.Tensor, budget: int, topk: int) -> DraftTree:
    """The builder for device tensors (kept because trees built on a device stay there: one launch per
    op, no host sync; `benchmarks/gpu_step_check.py` times it). Must equal `_build_by_heap`."""
    num_req, max_depth, _ = top_logprobs.shape
    device = top_logprobs.device
    parent_pos, token_rank = _candidate_pairs(budget, topk, str(device))
    num_pairs = parent_pos.numel()
    # Within-depth key of candidate p: score * num_pairs + (num_pairs - 1 - p); scores enter scaled.
    tie_breaker, tie, parent_base, depth_flat, final_index = _layout(budget, topk, max_depth, str(device))
    pair_logprobs = fixed_point_logprobs(top_logprobs[:, :, :topk]).index_select(2, token_rank)  # [R, L, P]
    pair_keys = (pair_logprobs.transpose(0, 1) * num_pairs + tie_breaker).contiguous()  # [L, R, P]
    floor_key = NEG_INF * num_pairs

    # Layer 0 is the root alone, padded to `budget` positions with impossible parents.
    scaled_score = torch.full((num_req, budget), floor_key, dtype=torch.long, device=device)
    scaled_score[:, 0] = 0
    layer_scores, layer_choices = [], []
    for depth in range(max_depth):
        key = scaled_score.index_select(1, parent_pos).add_(pair_keys[depth]).clamp_(min=floor_key)
        best_keys, choice = torch.topk(key, budget, dim=1)
        scaled_score = best_keys.sub_(tie_breaker.take(choice))
        layer_scores.append(scaled_score)
        layer_choices.append(choice)

    # All layers depth-major; flat position of (depth d >= 1, layer position i) is 1 + (d-1)*budget + i.
    scores = torch.stack(layer_scores, 1).div_(num_pairs, rounding_mode="floor")  # [R, L, budget]
    choices = torch.stack(layer_choices, 1)
    node_space = max_depth * budget
    keys = torch.cat([torch.full((num_req, 1), torch.iinfo(torch.long).max, device=device), (scores * node_space + tie).flatten(1)], 1)
    top = torch.topk(keys, budget + 1, dim=1)
    order = top.indices
    valid = top.values >= (INVALID_SCORE + 1) * node_space

    choice_parent, choice_rank = parent_pos.take(choices), token_rank.take(choices)
    parent_flat = torch.cat([torch.full((num_req, 1), -1, device=device), (choice_parent + parent_base).clamp_(min=0).flatten(1)], 1)
    rank_flat = torch.cat([torch.zeros((num_req, 1), dtype=torch.long, device=device), choice_rank.flatten(1)], 1)
    token_flat = torch.cat([root, top_token_ids[:, :, :topk].gather(2, choice_rank).flatten(1)], 1)

    final_of_flat = torch.full_like(keys, -1)
    final_of_flat.scatter_(1, order, final_index.expand(num_req, budget + 1))
    parents = final_of_flat.gather(1, parent_flat.gather(1, order).clamp(min=0))
    parents[:, 0] = -1
    return DraftTree(
        token_ids=torch.where(valid, token_flat.gather(1, order), root),
        parents=torch.where(valid, parents, -1),
        depths=torch.where(valid, depth_flat.expand(num_req, -1).gather(1, order), 0),
        ranks=torch.where(valid, rank_flat.gather(1, order), 0),
        valid=valid,
        num_nodes=valid.sum(1),
        max_depth=max_depth,
    )


def _build_by_heap(root: torch.Tensor, top_logprobs: torch.Tensor, top_token_ids: torch.Tensor, budget: int, topk: int) -> DraftTree:
    """The reference builder: lazy best-first search, request by request, in Python.

    The heap holds each built node's next candidates: its first child (rank 0 one depth down) and its
    next sibling (same parent, next rank); a node's children and younger siblings never outrank it, so
    popping `budget` times yields the top of the key order. Heap entries order as the key does: score
    descending, then shallower, then (same depth) the child of the parent popped first, then the
    lower rank; candidates through a -inf log-prob are never pushed (log-probs are sorted, so neither
    are their younger siblings)."""
    max_depth = top_logprobs.shape[1]
    width = budget + 1
    roots = root.view(-1).tolist()
    token_ids = [[root_token] * width for root_token in roots]
    parents = [[-1] * width for _ in roots]
    depths = [[0] * width for _ in roots]
    ranks = [[0] * width for _ in roots]
    num_nodes = []
    fixed = fixed_point_logprobs(top_logprobs[:, :, :topk])
    for r, (scores, tokens) in enumerate(zip(fixed.tolist(), top_token_ids[:, :, :topk].tolist())):
        heap = [(-scores[0][0], 1, 0, 0, 0)] if scores[0][0] != NEG_INF else []  # (-score, depth, parent, rank, parent score)
        built = 1
        while heap and built < width:
            negative, depth, parent, rank, parent_score = heapq.heappop(heap)
            token_ids[r][built], parents[r][built], depths[r][built], ranks[r][built] = tokens[depth - 1][rank], parent, depth, rank
            if rank + 1 < topk and scores[depth - 1][rank + 1] != NEG_INF:
                heapq.heappush(heap, (-(parent_score + scores[depth - 1][rank + 1]), depth, parent, rank + 1, parent_score))
            if depth < max_depth and scores[depth][0] != NEG_INF:
                heapq.heappush(heap, (negative - scores[depth][0], depth + 1, built, 0, -negative))
            built += 1
        num_nodes.append(built)
    fields = torch.tensor([token_ids, parents, depths, ranks], dtype=torch.long)  # one conversion
    return DraftTree.from_fields(fields, torch.tensor(num_nodes, dtype=torch.long), max_depth)


def tree_attention_mask(tree: DraftTree) -> torch.Tensor:
    """[R, N, N] bool: mask[r, i, j] is True iff node j is node i or one of its ancestors.

    Together with the whole committed prefix this is what node i attends to in the verify pass.
    Padded nodes see only themselves. Computed as the reachability of M = I + (child -> parent edges):
    M^(2^k) holds the paths of up to 2^k parent steps, so ceil(log2(max_depth)) squarings (batched
    matrix products of 0/1 floats, exact: entries stay below N^2 << 2^24) reach every ancestor. Host
    and device tensors alike; the engine's host trees take `host_tree.tree_attention_mask_on_host`."""
    num_req, num_nodes = tree.parents.shape
    device = tree.parents.device
    has_parent = tree.parents >= 0
    reach = torch.eye(num_nodes, device=device).expand(num_req, num_nodes, num_nodes).clone()
    reach.scatter_add_(2, tree.parents.clamp(min=0).unsqueeze(2), has_parent.unsqueeze(2).to(reach.dtype))
    steps = 1
    while steps < tree.max_depth:
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
        steps *= 2
    return reach > 0
