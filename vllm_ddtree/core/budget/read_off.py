"""What smaller shapes would have accepted, read off one verified tree.

Rules:
- A best-first tree of b nodes is the first b nodes of a bigger one, and the walk of the bigger tree
  passes the same nodes with the same target tokens, so the b-node tree would have accepted exactly
  the accepted path's nodes of index <= b (off: none). Every step of a tree measures every smaller
  tree's tokens on the same text: paired, noise-free comparisons (`nested_shapes`, `accepted_by_shape`).
- The chain is no prefix of a tree, but a best-first tree at least as deep holds the chain's nodes as
  far as it reaches (each depth's rank-0 path node is that depth's best node), so the chain's tokens
  come with every tree step too (`chain_accepted`); measured on its own steps only, the chain would be
  compared with the trees on other text. Where a tree ends right below the chain's accepted run the
  read-off is a lower bound, which would favour the trees; with the draft's rank-0 tokens kept with the
  trees, the target's token at the run's last node settles the chain's next node, so the read-off is
  exact there and a lower bound only one depth further down.
- The bonus token is the same whatever the shape; only the accepted draft tokens differ
  (`tokens_by_shape`).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.core.budget.shapes import TreeShape
from vllm_ddtree.core.tree import DraftTree


def nested_shapes(shapes: list[TreeShape], used: TreeShape) -> list[TreeShape]:
    """Candidates whose tree is a prefix of a `used`-shaped tree: off, `used` itself, and for a tree
    (no top-k cap) every smaller tree."""
    return [s for s in shapes if s.is_off or s == used or (used.topk is None and s.topk is None and s.budget <= used.budget)]


def chain_accepted(
    tree: DraftTree, accepted_nodes: torch.Tensor, chain_depth: int, target_token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Draft tokens [R] the chain (each depth's rank-0 token, `chain_depth` deep) would have accepted
    in this step, read off a verified tree and its accepted path accepted_nodes [R, D] (root first,
    -1 padded): the accepted path's leading run of rank-0 nodes, capped at `chain_depth`.

    The chain walks the same nodes with the same target tokens while the path stays on rank 0, and
    stops where the path leaves it (the target's token is not the rank-0 one) or stops below a rank-0
    child (the target rejected it). Where the run is the whole path and its last node u has no rank-0
    child in the tree (the tree ends there: shallower than `chain_depth`, or cut), the chain's next
    node is the draft's rank-0 token one depth down (`tree.chain_token_ids`, when kept) and the
    target's token at u (target_token_ids [R, N], when given) tells whether the chain accepts it: one
    more token if so, and then a lower bound (the target's token at that node is unknown), as without
    the chain's tokens. Host tensors (computed in numpy).
    """
    ranks, nodes = tree.ranks.numpy(), accepted_nodes.numpy()
    path = nodes[:, 1:]
    on_rank0 = (path >= 0) & (np.take_along_axis(ranks, np.maximum(path, 0), 1) == 0)
    run = on_rank0.cumprod(1).sum(1)
    if tree.chain_token_ids is not None and target_token_ids is not None:
        chain_tokens, target = tree.chain_token_ids.numpy(), target_token_ids.numpy()
        rows = np.arange(run.size)
        drafted = (path >= 0).sum(1)
        last = nodes[rows, drafted]  # the path's last node (the root when nothing was accepted)
        rank0_child = (tree.valid.numpy() & (tree.parents.numpy() == last[:, None]) & (ranks == 0)).any(1)
        below = run < min(chain_depth, chain_tokens.shape[1])
        next_token = chain_tokens[rows, np.minimum(run, chain_tokens.shape[1] - 1)]
        run = run + ((run == drafted) & ~rank0_child & below & (target[rows, last] == next_token))
    return torch.from_numpy(np.minimum(run, chain_depth))


def accepted_by_shape(
    shapes: list[TreeShape],
    used: TreeShape,
    tree: DraftTree,
    accepted_nodes: torch.Tensor,
    verified: torch.Tensor,
    target_token_ids: torch.Tensor | None = None,
) -> dict[TreeShape, int]:
    """Draft tokens accepted in one step by the `used` shape and by every candidate whose tokens can be
    read off it, all requests together: the nested smaller trees (a b-node best-first tree accepts the
    path nodes of index <= b) and, when the step's trees are trees (no top-k cap), the chain
    (`chain_accepted`). Only the requests with verified drafts (`verified` [R] bool) count; shapes
    bigger than the smallest of their trees are left out (the scheduler may have cut trees), and so is
    everything but `used` when no request verified drafts. One host sync for all shapes.

    tree [R, N] and accepted_nodes [R, D] (root first, -1 padded) are the step's trees and walk, and
    target_token_ids [R, N] the target's token at every node (the chain's read-off goes one depth
    further with them), host tensors (computed in numpy: a handful of tiny arrays per step).
    """
    verified = verified.numpy()
    if not verified.any():
        return {used: 0}
    nested, chain = read_off_shapes(shapes, used, int(tree.num_nodes.numpy()[verified].min()) - 1)
    nodes = accepted_nodes.numpy()
    path = nodes[verified, 1:, None]
    budgets = np.array([shape.budget for shape in nested])
    counts = ((path > 0) & (path <= budgets)).sum((0, 1)).tolist()
    if chain is not None:
        counts.append(int(chain_accepted(tree, accepted_nodes, chain.budget, target_token_ids).numpy()[verified].sum()))
        nested.append(chain)
    return dict(zip(nested, counts))


def read_off_shapes(shapes: list[TreeShape], used: TreeShape, smallest: int) -> tuple[list[TreeShape], TreeShape | None]:
    """The candidates `accepted_by_shape` reads off a step of `used`-shaped trees whose smallest verified
    tree has `smallest` drafts: the nested shapes that fit (`used` always), and the chain when it is
    read off trees (None otherwise)."""
    nested = [shape for shape in nested_shapes(shapes, used) if shape == used or shape.budget <= smallest]
    chain = next((shape for shape in shapes if shape.is_chain), None)
    with_chain = chain is not None and chain not in nested and used.topk is None and chain.budget <= smallest
    return nested, chain if with_chain else None


def tokens_by_shape(committed: int, used: TreeShape, accepted: dict[TreeShape, int]) -> dict[TreeShape, int]:
    """Tokens a step committed (`committed`, under `used`) and would have committed under each shape of
    `accepted` (draft tokens accepted per shape, `accepted_by_shape`): the bonus tokens are the same
    whatever the shape, only the accepted draft tokens differ."""
    if not accepted:
        return {used: committed}
    bonus = committed - accepted.get(used, 0)
    return {shape: bonus + gain for shape, gain in accepted.items()}
