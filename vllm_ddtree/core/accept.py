"""Tree acceptance walk, batched: which path of the draft tree the target agrees with.

Rule (DDTree / SpecInfer "naive" tree verification): at node u take the target's token t_u (the argmax
for greedy decoding, one sample of the processed target distribution with temperature). If t_u is the
token of a child of u, descend to that child and repeat; otherwise t_u is the bonus token and the step
ends. Siblings carry distinct tokens, so at most one child matches and the accepted nodes form a path.

Batched form, no loop over nodes: node i != root "matches" when token[i] == t_{parent(i)}. A node is
accepted iff it and all its ancestors match, i.e. iff no node on its ancestor-or-self row of the tree
attention mask fails to match. The accepted path is then ordered by depth. This is the reference
(host and device tensors alike); the engine walks its host trees with the compiled sequential walk,
`host_tree.accept_tree_on_host`, which the property tests hold equal to it.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    Whole-batch torch ops, no loop over nodes and no host sync on a device.
    """
    num_req, num_nodes = tree.token_ids.shape
    if num_nodes == 1:  # roots alone (no drafts anywhere in the batch): the target's token is the bonus
        bonus = target_token_ids[:, 0]
        return TreeAcceptance(torch.zeros_like(tree.parents), torch.ones_like(bonus), bonus.unsqueeze(1).clone(), bonus)
    if ancestor_mask is None:
        ancestor_mask = tree_attention_mask(tree)
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
    output.scatter_(1, (num_accepted - 1).unsqueeze(1), bonus.unsqueeze(1).to(output.dtype))
    return TreeAcceptance(accepted_nodes, num_accepted, output, bonus)
