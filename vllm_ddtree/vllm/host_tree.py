"""The host's per-step tree work, compiled by numba (a dependency of vLLM): the draft trees (and the
draft's chain), their ancestor masks, the tree-attention bias of the verify windows, the acceptance
walk (for a greedy step, together with reading each node's token off its logits row), and what each
candidate shape would have accepted (the budget policy's read-off).

Each function returns exactly what its reference in `vllm_ddtree.core` (or, for the window bias, the
numpy formula its docstring states) returns, field by field and dtype by dtype; the property tests
hold them equal. They exist for cost, not for a different rule: at batch 1 the references are dozens of
small numpy/torch ops each, and every op costs several microseconds once the forward pass has evicted
the caches, while the work itself is a few hundred integer operations. Trees on a device take the
core's batched torch ops (no host round trip), so every function here is host-only by contract.

`warm_up()` compiles (or loads from numba's on-disk cache) every kernel; the runner calls it at start so
that no step pays a compilation (the adaptive policy times steps).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit

from vllm_ddtree.core.accept import TreeAcceptance, accept_tree, max_path_length
from vllm_ddtree.core.budget import TreeShape, read_off_shapes
from vllm_ddtree.core.tree import MAX_BUDGET, MIN_LOGPROB, NEG_INF, SCORE_BITS, DraftTree, build_draft_trees, chain_token_ids_of

def _compiled(function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """numba's compiled `function` (with njit `options`), cached on disk where numba finds a writable
    place (next to this file, else the user's cache directory), else compiled anew in every process."""
    try:
        return njit(cache=True, nogil=True, **options)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return njit(nogil=True, **options)(function)


_HEAP_FIELDS = 5
"""A heap entry: (-score, depth, parent, rank, parent score); the first four order it (they are unique
per candidate, so the fifth never breaks a tie)."""


@_compiled
def _before(heap: np.ndarray, a: int, b: int) -> bool:
    for field in range(_HEAP_FIELDS - 1):
        if heap[a, field] != heap[b, field]:
            return heap[a, field] < heap[b, field]
    return False


@_compiled
def _swap(heap: np.ndarray, a: int, b: int) -> None:
    for field in range(_HEAP_FIELDS):
        heap[a, field], heap[b, field] = heap[b, field], heap[a, field]


@_compiled
def _push(heap: np.ndarray, size: int, negative: int, depth: int, parent: int, rank: int, parent_score: int) -> int:
    heap[size, 0], heap[size, 1], heap[size, 2], heap[size, 3], heap[size, 4] = negative, depth, parent, rank, parent_score
    child = size
    while child > 0 and _before(heap, child, (child - 1) // 2):
        _swap(heap, child, (child - 1) // 2)
        child = (child - 1) // 2
    return size + 1


@_compiled
def _pop(heap: np.ndarray, size: int) -> int:
    """Drop the first entry (read heap[0] before); returns the new size."""
    size -= 1
    _swap(heap, 0, size)
    node = 0
    while True:
        first = node
        for child in (2 * node + 1, 2 * node + 2):
            if child < size and _before(heap, child, first):
                first = child
        if first == node:
            return size
        _swap(heap, node, first)
        node = first


@_compiled
def _fixed_point(logprobs: np.ndarray, topk: int) -> np.ndarray:
    """`core.tree.fixed_point_logprobs` of logprobs[:, :, :topk], float64 (numpy's round and rint both
    round half to even)."""
    num_req, max_depth, _ = logprobs.shape
    scores = np.empty((num_req, max_depth, topk), dtype=np.int64)
    for r in range(num_req):
        for d in range(max_depth):
            for k in range(topk):
                value = logprobs[r, d, k]
                usable = value > -np.inf  # NaN is no probability either
                scores[r, d, k] = np.int64(np.rint(max(value, MIN_LOGPROB) * (1 << SCORE_BITS))) if usable else NEG_INF
    return scores


@_compiled
def _best_first(
    roots: np.ndarray, logprobs: np.ndarray, tokens: np.ndarray, budget: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The core's lazy best-first search (`_build_by_heap`, whose docstring states the order), every
    request of the batch in one call. logprobs, tokens [R, L, K']: the draft's top-K' log-probs and token
    ids, of which the first K = min(K', budget) are candidates. Returns fields [4, R, budget + 1] (token
    ids, parents, depths, ranks), valid [R, budget + 1] and counts [R]."""
    num_req, max_depth, topk = logprobs.shape
    topk = min(topk, budget)
    scores = _fixed_point(logprobs, topk)
    width = budget + 1
    fields = np.zeros((4, num_req, width), dtype=np.int64)
    fields[1] = -1
    counts = np.empty(num_req, dtype=np.int64)
    heap = np.empty((width + 1, _HEAP_FIELDS), dtype=np.int64)  # each pop pushes at most two
    for r in range(num_req):
        fields[0, r] = roots[r]
        size = 0
        if scores[r, 0, 0] != NEG_INF:
            size = _push(heap, size, -scores[r, 0, 0], 1, 0, 0, 0)
        built = 1
        while size > 0 and built < width:
            negative, depth, parent, rank, parent_score = heap[0, 0], heap[0, 1], heap[0, 2], heap[0, 3], heap[0, 4]
            size = _pop(heap, size)
            fields[0, r, built], fields[1, r, built], fields[2, r, built], fields[3, r, built] = tokens[r, depth - 1, rank], parent, depth, rank
            if rank + 1 < topk and scores[r, depth - 1, rank + 1] != NEG_INF:
                size = _push(heap, size, -(parent_score + scores[r, depth - 1, rank + 1]), depth, parent, rank + 1, parent_score)
            if depth < max_depth and scores[r, depth, 0] != NEG_INF:
                size = _push(heap, size, negative - scores[r, depth, 0], depth + 1, built, 0, -negative)
            built += 1
        counts[r] = built
    valid = np.arange(width).reshape(1, width) < counts.reshape(num_req, 1)
    return fields, valid, counts


@_compiled
def _chain_tokens(logprobs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    num_req, max_depth, _ = logprobs.shape
    chain = np.full((num_req, max_depth), -1, dtype=np.int64)
    for r in range(num_req):
        for d in range(max_depth):
            if not logprobs[r, d, 0] > -np.inf:  # NaN is no probability either
                break
            chain[r, d] = tokens[r, d, 0]
    return chain


def build_draft_trees_on_host(
    root_token_ids: torch.Tensor, top_logprobs: torch.Tensor, top_token_ids: torch.Tensor, budget: int, with_chain: bool = False
) -> DraftTree:
    """`vllm_ddtree.core.build_draft_trees` (its arguments, its trees), compiled for host tensors; with
    `with_chain`, the trees also keep the draft's chain (`chain_token_ids_of(top_logprobs, top_token_ids)`)."""
    max_depth = top_logprobs.shape[1]
    if budget == 0 or max_depth == 0 or not 0 <= budget <= MAX_BUDGET:  # roots alone, or the core's error
        trees = build_draft_trees(root_token_ids, top_logprobs, top_token_ids, budget)
        return dataclasses.replace(trees, chain_token_ids=chain_token_ids_of(top_logprobs, top_token_ids)) if with_chain else trees
    logprobs, tokens = np.ascontiguousarray(top_logprobs.double().numpy()), _int64(top_token_ids)
    fields, valid, counts = _best_first(_int64(root_token_ids.reshape(-1)), logprobs, tokens, budget)
    token_ids, parents, depths, ranks = torch.from_numpy(fields).unbind(0)
    return DraftTree(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        ranks=ranks,
        valid=torch.from_numpy(valid),
        num_nodes=torch.from_numpy(counts),
        max_depth=max_depth,
        chain_token_ids=torch.from_numpy(_chain_tokens(logprobs, tokens)) if with_chain else None,
    )


@_compiled
def _ancestor_masks(parents: np.ndarray) -> np.ndarray:
    num_req, num_nodes = parents.shape
    mask = np.zeros((num_req, num_nodes, num_nodes), dtype=np.bool_)
    for r in range(num_req):
        for i in range(num_nodes):
            node, steps = i, 0
            while node >= 0 and steps <= num_nodes:  # a tree's path ends at the root (parent -1)
                mask[r, i, node] = True
                node, steps = parents[r, node], steps + 1
    return mask


def tree_attention_mask_on_host(tree: DraftTree) -> torch.Tensor:
    """`vllm_ddtree.core.tree_attention_mask` ([R, N, N] bool: node j is node i or an ancestor of it),
    compiled for host trees: each row is its node's walk up the parents."""
    return torch.from_numpy(_ancestor_masks(_int64(tree.parents)))


@_compiled
def _scheduled_are_trees(
    token_ids: np.ndarray, tree_tokens: np.ndarray, valid: np.ndarray, num_nodes: np.ndarray, starts: np.ndarray, num_drafts: np.ndarray
) -> bool:
    for r in range(tree_tokens.shape[0]):
        if num_nodes[r] != 1 + num_drafts[r]:
            return False
        for i in range(num_nodes[r]):
            if valid[r, i] and token_ids[r, starts[r] + i] != tree_tokens[r, i]:
                return False
    return True


@_compiled
def _verify_layout(
    parents: np.ndarray,
    depths: np.ndarray,
    valid: np.ndarray,
    width: int,
    root_rows: np.ndarray,
    starts: np.ndarray,
    num_drafts: np.ndarray,
    token_ids: np.ndarray,
    tree_tokens: np.ndarray,
    num_nodes: np.ndarray,
) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """With token_ids of any rows, first `_scheduled_are_trees` (else False and empty arrays)."""
    num_req = parents.shape[0]
    if token_ids.shape[0] > 0 and not _scheduled_are_trees(token_ids, tree_tokens, valid, num_nodes, starts, num_drafts):
        empty = np.empty(0, dtype=np.int64)
        return False, np.empty((0, 0), dtype=np.int64), np.empty((0, 0), dtype=np.int64), np.empty(0, dtype=np.bool_), \
            np.empty((0, 0, 0), dtype=np.bool_), empty, empty, empty, 0
    node_rows = np.empty((num_req, width), dtype=np.int64)
    logit_rows = np.empty((num_req, width), dtype=np.int64)
    branching = np.zeros(num_req, dtype=np.bool_)
    first, selected, max_depth = 0, 0, 0
    for r in range(num_req):
        count = 0
        for i in range(width):
            offset = i if valid[r, i] else 0
            node_rows[r, i], logit_rows[r, i] = root_rows[r] + offset, first + offset
            if valid[r, i]:
                count += 1
                branching[r] |= parents[r, i] != i - 1
                max_depth = max(max_depth, depths[r, i])
        first += 1 + num_drafts[r]
        if branching[r]:
            selected += count
    rows = np.empty(selected, dtype=np.int64)
    tree_positions = np.empty(selected, dtype=np.int64)
    linear_positions = np.empty(selected, dtype=np.int64)
    k = 0
    for r in range(num_req):
        if not branching[r]:
            continue
        for i in range(width):
            if valid[r, i]:
                rows[k], tree_positions[k], linear_positions[k] = node_rows[r, i], starts[r] + depths[r, i], starts[r] + i
                k += 1
    return True, node_rows, logit_rows, branching, _ancestor_masks(parents[:, :width]), rows, tree_positions, linear_positions, max_depth


@dataclasses.dataclass(frozen=True)
class VerifyLayout:
    """Where a step's tree nodes go in the verify batch, R requests, their trees' first `width` columns
    (the rest, if any, padding), from one compiled pass over the trees:
    node_rows [R, width]: batch row of node i, root_rows[r] + i (padded nodes: the root's row);
    node_logit_rows [R, width]: its row of the step's logits, which hold 1 + num_drafts[r] rows per
    request in batch order (padded nodes: the root's row);
    branching [R]: the tree is not a chain (some valid node's parent is not the node before it);
    ancestor_mask [R, width, width]: `core.tree_attention_mask` of the trees;
    rows [M]: batch rows of the branching trees' valid nodes (request-major, node order), with their
    tree_positions [M] (start + depth: RoPE positions of the verify pass) and linear_positions [M]
    (start + i: positions once each window is read as a chain);
    max_depth: the deepest valid node's depth."""

    node_rows: np.ndarray
    node_logit_rows: np.ndarray
    branching: np.ndarray
    ancestor_mask: np.ndarray
    rows: np.ndarray
    tree_positions: np.ndarray
    linear_positions: np.ndarray
    max_depth: int


def verify_layout(
    tree: DraftTree,
    width: int,
    root_rows: np.ndarray,
    starts: np.ndarray,
    num_drafts: np.ndarray,
    token_ids: np.ndarray | None = None,
) -> VerifyLayout | None:
    """The `VerifyLayout` of host trees [R, >= width] (every valid node in the first `width` columns)
    whose roots sit at batch rows root_rows [R] and positions starts [R] with num_drafts [R] scheduled
    drafts. With token_ids ([>= R, L]: each request's tokens by position), None unless every tree was
    scheduled whole (num_nodes [R] = 1 + num_drafts) and every valid node's token is the scheduled one,
    token_ids[r, starts[r] + i]. (One compiled call: this runs at every step with drafts.)"""
    ids = _NO_TOKEN_IDS if token_ids is None else np.ascontiguousarray(token_ids, dtype=token_ids.dtype if token_ids.dtype == np.int32 else np.int64)
    ok, *fields = _verify_layout(
        _int64(tree.parents), _int64(tree.depths), np.ascontiguousarray(tree.valid.numpy()), width, _int64_array(root_rows),
        _int64_array(starts), _int64_array(num_drafts), ids, _int64(tree.token_ids), _int64(tree.num_nodes),
    )
    return VerifyLayout(*fields) if ok else None


_NO_TOKEN_IDS = np.zeros((0, 0), dtype=np.int32)
"""`verify_layout`'s token ids when nothing is checked (vLLM's dtype: no other compilation)."""


def _int64_array(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int64)


@_compiled
def _tree_windows(
    ancestor_mask: np.ndarray,
    starts: np.ndarray,
    num_nodes: np.ndarray,
    valid: np.ndarray,
    req_indices: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    num_req, width = valid.shape
    tail_first = starts // block_size
    window_blocks = (starts + num_nodes + block_size - 1) // block_size
    bias = np.empty((num_req, (window_blocks - tail_first).max(), 1, 1, width, block_size), dtype=np.float32)
    for t in range(num_req):
        for k in range(bias.shape[1]):
            for i in range(width):
                row = i if valid[t, i] else 0
                for b in range(block_size):
                    column = (tail_first[t] + k) * block_size + b - starts[t]  # node index, < 0 in the prefix
                    sees = column < 0 or (column < num_nodes[t] and ancestor_mask[t, row, column])
                    bias[t, k, 0, 0, i, b] = 0.0 if sees else -np.inf
    runs = np.empty((window_blocks.sum(), 6), dtype=np.int64)
    num_runs = 0
    for t in range(num_req):
        blocks = block_table[req_indices[t]]
        lo = 0
        for hi in range(1, window_blocks[t] + 1):
            if hi < window_blocks[t] and blocks[hi] == blocks[hi - 1] + 1:
                continue
            masked = max(0, hi - max(tail_first[t], lo))  # the run's last blocks, those that hold nodes
            run = runs[num_runs]
            run[0], run[1], run[2], run[3] = t, blocks[lo], hi - lo, hi - lo - masked
            run[4], run[5] = hi - tail_first[t] - masked, hi - tail_first[t]
            num_runs, lo = num_runs + 1, hi
    return bias, runs[:num_runs]


def tree_windows(
    ancestor_mask: torch.Tensor,
    starts: torch.Tensor,
    num_nodes: torch.Tensor,
    valid: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> tuple[np.ndarray, list[list[int]]]:
    """The verify windows of T branching trees (request t: positions 0 .. starts[t] + num_nodes[t] - 1,
    in whole cache blocks) as runs of consecutive cache blocks, and the additive tree mask of their tail.

    bias [T, K, 1, 1, N, block_size] float32: tail block k of request t is window block
    starts[t] // block_size + k (K the longest tail); node i (a padded node: the root's row) sees position
    p = (starts[t] // block_size + k) * block_size + b (bias 0, else -inf) iff p < starts[t] (the prefix)
    or p - starts[t] is a node < num_nodes[t] on its row of ancestor_mask [T, N, N].
    runs: [t, first cache block, blocks, bias_from, lo, hi] in window order per request: the run's
    blocks from bias_from on are its tail blocks, whose bias is bias[t, lo:hi] (lo = hi: none).
    req_indices [T] are the trees' rows of block_table [num_reqs, max blocks]."""
    bias, runs = _tree_windows(
        np.ascontiguousarray(ancestor_mask.numpy()), _int64(starts), _int64(num_nodes), np.ascontiguousarray(valid.numpy()),
        _int64(req_indices), np.ascontiguousarray(block_table.numpy()), block_size,  # vLLM's table: int32
    )
    return bias, runs.tolist()


@_compiled
def _walk(
    tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray, target: np.ndarray, path_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    num_req, num_nodes = tokens.shape
    accepted_nodes = np.full((num_req, path_len), -1, dtype=np.int64)
    num_accepted = np.empty(num_req, dtype=np.int64)
    output = np.full((num_req, path_len), -1, dtype=np.int64)
    bonus = np.empty(num_req, dtype=np.int64)
    for r in range(num_req):
        node, length = 0, 1
        accepted_nodes[r, 0] = 0
        while length < path_len:
            child = node + 1  # children come after their parent
            while child < num_nodes and not (valid[r, child] and parents[r, child] == node and tokens[r, child] == target[r, node]):
                child += 1
            if child == num_nodes:
                break
            accepted_nodes[r, length], output[r, length - 1] = child, tokens[r, child]
            node, length = child, length + 1
        num_accepted[r], bonus[r] = length, target[r, node]
        output[r, length - 1] = bonus[r]
    return accepted_nodes, num_accepted, output, bonus


def accept_tree_on_host(tree: DraftTree, target_token_ids: torch.Tensor) -> TreeAcceptance:
    """`vllm_ddtree.core.accept_tree` (the same acceptance, dtypes included), compiled for host tensors:
    the walk itself, from the root down the child whose token is the target's at its parent (siblings
    carry distinct tokens: at most one matches)."""
    if tree.nodes_per_request == 1:  # roots alone
        return accept_tree(tree, target_token_ids)
    target = target_token_ids.numpy()
    accepted_nodes, num_accepted, output, bonus = _walk(
        _int64(tree.token_ids), _int64(tree.parents), np.ascontiguousarray(tree.valid.numpy()), _int64(target_token_ids), max_path_length(tree)
    )
    return TreeAcceptance(*map(torch.from_numpy, (accepted_nodes, num_accepted, output, bonus.astype(target.dtype, copy=False))))


@_compiled
def _greedy_walk(
    row_tokens: np.ndarray, num_drafts: np.ndarray, tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray, path_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    num_req, num_nodes = tokens.shape
    target = np.empty((num_req, num_nodes), dtype=np.int64)
    first = 0  # request r's first logits row
    for r in range(num_req):
        for i in range(num_nodes):
            target[r, i] = row_tokens[first + i] if valid[r, i] else row_tokens[first]
        first += 1 + num_drafts[r]
    accepted_nodes, num_accepted, output, bonus = _walk(tokens, parents, valid, target, path_len)
    rows = np.full((num_req, num_nodes), -1, dtype=np.int32)
    rows[:, :path_len] = output
    return target, accepted_nodes, num_accepted, output, bonus, rows


def accept_greedy_rows_on_host(
    tree: DraftTree, num_drafts: torch.Tensor, row_tokens: torch.Tensor
) -> tuple[torch.Tensor, TreeAcceptance, torch.Tensor]:
    """A greedy step's node tokens, walk and output in one compiled call: (target_token_ids [R, N],
    `accept_tree_on_host(tree, target_token_ids)`, vLLM's output rows [R, N] int32: output_token_ids,
    -1 padded). row_tokens [rows] int64: the target's token at every row of the step's logits, which
    hold 1 + num_drafts[r] rows per request in batch order; node i of request r takes the row
    (sum of 1 + num_drafts[q] for q < r) + i, a padded node its root's (`TreeStep.node_logit_rows`).
    One call instead of the index arithmetic, the gather, the walk and the padding: each is a few
    microseconds of work, but each costs tens once the forward has evicted the caches."""
    target, accepted_nodes, num_accepted, output, bonus, rows = _greedy_walk(
        _int64(row_tokens), _int64(num_drafts), _int64(tree.token_ids), _int64(tree.parents),
        np.ascontiguousarray(tree.valid.numpy()), max_path_length(tree),
    )
    acceptance = TreeAcceptance(*map(torch.from_numpy, (accepted_nodes, num_accepted, output, bonus)))
    return torch.from_numpy(target), acceptance, torch.from_numpy(rows)


@_compiled
def _kv_moves(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_req, path_len = nodes.shape
    moves = np.empty((3, nodes.size), dtype=np.int64)
    count = 0
    for r in range(num_req):
        for k in range(path_len):
            if nodes[r, k] >= 0 and nodes[r, k] != k:
                moves[0, count], moves[1, count], moves[2, count] = r, nodes[r, k], k
                count += 1
    return moves[0, :count].copy(), moves[1, :count].copy(), moves[2, :count].copy()


def kv_moves_on_host(acceptance: TreeAcceptance) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real moves of `vllm_ddtree.core.kv_compaction_plan(acceptance)` (its entries with is_move), in
    its row-major order: (requests, src_offsets, dst_offsets) [M] int64. One compiled pass instead of
    the plan's torch operations, which a host step reads back anyway to skip the identity entries."""
    return _kv_moves(_int64(acceptance.accepted_nodes))


@_compiled
def _accepted_counts(
    nodes: np.ndarray,
    verified: np.ndarray,
    budgets: np.ndarray,
    ranks: np.ndarray,
    parents: np.ndarray,
    valid: np.ndarray,
    chain_depth: int,
    chain_tokens: np.ndarray,
    target: np.ndarray,
) -> np.ndarray:
    """Per budget, the verified requests' accepted path nodes of index 1 .. budget; then, with
    chain_depth > 0, the chain's read-off (`chain_accepted`; one depth further when chain_tokens has
    columns)."""
    num_req, path_len = nodes.shape
    counts = np.zeros(budgets.size + 1, dtype=np.int64)
    for r in range(num_req):
        if not verified[r]:
            continue
        drafted = 0
        for k in range(1, path_len):
            node = nodes[r, k]
            if node >= 0:
                drafted += 1
            for b in range(budgets.size):
                if 0 < node <= budgets[b]:
                    counts[b] += 1
        if chain_depth <= 0:
            continue
        run = 0
        while run < path_len - 1 and nodes[r, run + 1] >= 0 and ranks[r, nodes[r, run + 1]] == 0:
            run += 1
        depth = chain_tokens.shape[1]
        if depth > 0 and run == drafted and run < min(chain_depth, depth):
            last = nodes[r, drafted]
            rank0_child = False
            for j in range(parents.shape[1]):
                rank0_child |= valid[r, j] and parents[r, j] == last and ranks[r, j] == 0
            if not rank0_child and target[r, last] == chain_tokens[r, run]:
                run += 1
        counts[budgets.size] += min(run, chain_depth)
    return counts


def accepted_by_shape_on_host(
    shapes: list[TreeShape],
    used: TreeShape,
    tree: DraftTree,
    accepted_nodes: torch.Tensor,
    verified: np.ndarray,
    target_token_ids: torch.Tensor | None = None,
) -> dict[TreeShape, int]:
    """`vllm_ddtree.core.accepted_by_shape` (its counts; verified [R] bool as a numpy array), compiled."""
    if not verified.any():
        return {used: 0}
    nested, chain, budgets = _read_off(tuple(shapes), used, int(tree.num_nodes.numpy()[verified].min()) - 1)
    read_ahead = chain is not None and tree.chain_token_ids is not None and target_token_ids is not None
    none = np.zeros((0, 0), dtype=np.int64)
    counts = _accepted_counts(
        _int64(accepted_nodes), np.ascontiguousarray(verified, dtype=np.bool_), budgets,
        _int64(tree.ranks), _int64(tree.parents), np.ascontiguousarray(tree.valid.numpy()), 0 if chain is None else chain.budget,
        _int64(tree.chain_token_ids) if read_ahead else none, _int64(target_token_ids) if read_ahead else none,
    ).tolist()
    return dict(zip(nested if chain is None else [*nested, chain], counts))  # without the chain, its count is dropped


@functools.lru_cache(maxsize=256)
def _read_off(shapes: tuple[TreeShape, ...], used: TreeShape, smallest: int) -> tuple[list[TreeShape], TreeShape | None, np.ndarray]:
    """`read_off_shapes` and the nested shapes' budgets, once per (shapes, used, smallest): a step's
    read-off otherwise rebuilds the same lists. Shared: callers never modify them."""
    nested, chain = read_off_shapes(list(shapes), used, smallest)
    return nested, chain, np.array([shape.budget for shape in nested], dtype=np.int64)


def _int64(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor as a C-contiguous int64 array (a view when it is one): every kernel is compiled for
    one layout and dtype per argument, so no step meets a new signature and its compilation."""
    return np.ascontiguousarray(tensor.numpy(), dtype=np.int64)


def warm_up() -> None:
    """Compile every kernel for the argument types the runner passes (or load them from the cache)."""
    roots = torch.zeros(1, dtype=torch.long)
    logprobs = torch.tensor([[[-0.5, -1.0], [-0.2, -2.0]]])
    tree = build_draft_trees_on_host(roots, logprobs, torch.tensor([[[1, 2], [3, 4]]]), 3, with_chain=True)
    acceptance = accept_tree_on_host(tree, torch.zeros_like(tree.token_ids))
    accept_greedy_rows_on_host(tree, tree.num_nodes - 1, torch.zeros(int(tree.num_nodes.sum()), dtype=torch.long))
    kv_moves_on_host(acceptance)
    shapes = [TreeShape(0, 1), TreeShape(2, 1), TreeShape(3)]
    for used in shapes[1:]:
        accepted_by_shape_on_host(shapes, used, tree, acceptance.accepted_nodes, np.ones(1, dtype=np.bool_), torch.zeros_like(tree.token_ids))
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    tree_windows(tree_attention_mask_on_host(tree), torch.tensor([5]), tree.num_nodes, tree.valid, torch.zeros(1, dtype=torch.long), table, 4)
    rows = np.zeros(1, dtype=np.int64)
    for dtype in (np.int32, np.int64):  # vLLM's token ids, and the tests'
        verify_layout(tree, tree.nodes_per_request, rows, rows, tree.num_nodes.numpy() - 1, np.zeros((1, 8), dtype=dtype))
