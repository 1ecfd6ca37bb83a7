"""Tree acceptance walk, batched: which path of the draft tree the target agrees with.

Rule (DDTree / SpecInfer "naive" tree verification): at node u take the target's token t_u (the argmax
for greedy decoding, one sample of the processed target distribution with temperature). If t_u is the
token of a child of u, descend to that child and repeat; otherwise t_u is the bonus token and the step
ends. Siblings carry distinct tokens, so at most one child matches and the accepted nodes form a path.

Batched form, no loop over nodes: node i != root "matches" when token[i] == t_{parent(i)}. A node is
accepted iff it and all its ancestors match, i.e. iff no node on its ancestor-or-self row of the tree
attention mask fails to match. The accepted path is then ordered by depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.core.tree import DraftTree, tree_attention_mask


@dataclass(frozen=True)
class TreeAcceptance:
    """Result of one verify step for R requests; D = max path length = min(max_depth, budget) + 1.

    - accepted_nodes [R, D]: node indices of the accepted path, root first, padded with -1;
    - num_accepted [R]: path length including the root = tokens committed this step
      (accepted draft tokens + 1 bonus token);
    - output_token_ids [R, D]: vLLM's form, the accepted draft tokens then the bonus token, padded -1;
    - bonus_token_ids [R]: the target's token at the deepest accepted node.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    output_token_ids: torch.Tensor
    bonus_token_ids: torch.Tensor


def max_path_length(tree: DraftTree) -> int:
    """Static bound on the accepted path length (root included) for this tree shape."""
    return min(tree.max_depth, tree.nodes_per_request - 1) + 1


def accept_tree(
    tree: DraftTree,
    target_token_ids: torch.Tensor,
    ancestor_mask: torch.Tensor | None = None,
) -> TreeAcceptance:
    """Walk every tree of the batch with the target's per-node tokens.

    Args:
        tree: the verified trees.
        target_token_ids: [R, N] the target's token at every node (entries of padded nodes ignored).
        ancestor_mask: tree_attention_mask(tree), if the caller already has it.
    """
    num_req, num_nodes = tree.token_ids.shape
    if num_nodes == 1:  # roots alone (no drafts anywhere in the batch): the target's token is the bonus
        bonus = target_token_ids[:, 0]
        return TreeAcceptance(torch.zeros_like(tree.parents), torch.ones_like(bonus), bonus.unsqueeze(1).clone(), bonus)
    if tree.token_ids.device.type == "cpu" and target_token_ids.device.type == "cpu":
        return _accept_on_host(tree, target_token_ids, ancestor_mask)
    if ancestor_mask is None:
        ancestor_mask = tree_attention_mask(tree)
    return _accept_batched(tree, target_token_ids, ancestor_mask)


def _accept_batched(tree: DraftTree, target_token_ids: torch.Tensor, ancestor_mask: torch.Tensor) -> TreeAcceptance:
    """The walk in torch ops (device tensors: no host sync)."""
    num_req, num_nodes = tree.token_ids.shape
    path_len = max_path_length(tree)
    target_at_parent = target_token_ids.gather(1, tree.parents.clamp(min=0))
    matches = tree.valid & ((tree.token_ids == target_at_parent) | (tree.parents < 0))
    accepted = tree.valid & ~(ancestor_mask & ~matches.unsqueeze(1)).any(dim=2)

    node_idx = torch.arange(num_nodes, device=tree.token_ids.device).expand(num_req, num_nodes)
    slots = torch.full((num_req, path_len + 1), -1, dtype=torch.long, device=tree.token_ids.device)
    # One accepted node per depth; rejected nodes land in the spare last column.
    slots.scatter_(1, torch.where(accepted, tree.depths, path_len), node_idx)
    accepted_nodes = slots[:, :path_len]
    num_accepted = accepted.sum(dim=1)

    deepest = accepted_nodes.gather(1, (num_accepted - 1).unsqueeze(1))
    bonus = target_token_ids.gather(1, deepest).squeeze(1)
    drafted = accepted_nodes[:, 1:]
    output = torch.full_like(accepted_nodes, -1)
    output[:, :-1] = torch.where(drafted >= 0, tree.token_ids.gather(1, drafted.clamp(min=0)), -1)
    output.scatter_(1, (num_accepted - 1).unsqueeze(1), bonus.unsqueeze(1))
    return TreeAcceptance(accepted_nodes, num_accepted, output, bonus)


def _accept_on_host(tree: DraftTree, target_token_ids: torch.Tensor, ancestor_mask: torch.Tensor | None) -> TreeAcceptance:
    """`_accept_batched` step for step in numpy, for host tensors (numpy's per-op cost is a fraction of
    torch's on arrays this small); the same acceptance, dtypes included. A batch of chains takes
    `_accept_chains_on_host`. Otherwise, without the ancestor mask a
    node's acceptance (it and all its ancestors match) is found by pointer doubling: after k rounds
    `accepted` covers each node's 2^k nearest path nodes, and `up` points 2^k parent steps up (the root
    points to itself), so ceil(log2(max_depth)) rounds cover every path (the root always matches)."""
    tokens, parents, depths, valid = (t.numpy() for t in (tree.token_ids, tree.parents, tree.depths, tree.valid))
    target = target_token_ids.numpy()
    num_req, num_nodes = tokens.shape
    path_len = max_path_length(tree)
    rows = np.arange(num_req)
    index = np.arange(num_nodes)
    if ancestor_mask is None and bool(((parents == index - 1) | ~valid).all()):  # chains: the commonest trees
        return _accept_chains_on_host(tokens, target, valid, path_len)
    matches = valid & ((tokens == np.take_along_axis(target, np.maximum(parents, 0), 1)) | (parents < 0))
    if ancestor_mask is not None:
        accepted = valid & ~(ancestor_mask.numpy() & ~matches[:, None, :]).any(2)
    else:
        accepted, up, span = matches, np.where(parents < 0, index, parents), 1
        while span < tree.max_depth:
            accepted = accepted & np.take_along_axis(accepted, up, 1)
            up, span = np.take_along_axis(up, up, 1), 2 * span
    slots = np.full((num_req, path_len + 1), -1, dtype=np.int64)
    # One accepted node per depth; rejected nodes land in the spare last column.
    slots[rows[:, None], np.where(accepted, depths, path_len)] = index
    accepted_nodes = slots[:, :path_len]
    num_accepted = accepted.sum(1)
    bonus = target[rows, accepted_nodes[rows, num_accepted - 1]]
    drafted = accepted_nodes[:, 1:]
    output = np.full(accepted_nodes.shape, -1, dtype=tokens.dtype)
    output[:, :-1] = np.where(drafted >= 0, np.take_along_axis(tokens, np.maximum(drafted, 0), 1), -1)
    output[rows, num_accepted - 1] = bonus
    return TreeAcceptance(
        torch.from_numpy(accepted_nodes), torch.from_numpy(num_accepted.astype(np.int64)), torch.from_numpy(output), torch.from_numpy(bonus)
    )


def _accept_chains_on_host(tokens: np.ndarray, target: np.ndarray, valid: np.ndarray, path_len: int) -> TreeAcceptance:
    """`_accept_on_host` for a batch of chains (node i's parent is node i - 1): the walk accepts the
    longest run of nodes 1, 2, ... whose token is the target's at the node before, and node k of the
    path is node k of the chain."""
    rows = np.arange(tokens.shape[0])
    index = np.arange(path_len)
    matches = valid[:, 1:path_len] & (tokens[:, 1:path_len] == target[:, : path_len - 1])
    drafted = np.logical_and.accumulate(matches, axis=1).sum(1).astype(np.int64)  # accepted draft nodes
    bonus = target[rows, drafted]
    output = np.full((tokens.shape[0], path_len), -1, dtype=tokens.dtype)
    output[:, :-1] = np.where(index[1:] <= drafted[:, None], tokens[:, 1:path_len], -1)
    output[rows, drafted] = bonus
    return TreeAcceptance(
        torch.from_numpy(np.where(index <= drafted[:, None], index, -1)),
        torch.from_numpy(drafted + 1),
        torch.from_numpy(output),
        torch.from_numpy(bonus),
    )
