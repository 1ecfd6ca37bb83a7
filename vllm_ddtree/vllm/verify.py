"""One step's tree-verify requests: the trees as scheduled, and what the verify forward needs from them.

The scheduler knows drafts only as flat token lists; the proposer hands it each tree's nodes in index
order (root excluded), so any prefix the scheduler keeps (token budget, max_model_len) is still a
prefix-closed tree: parents precede children. A request's verify window is 1 + n batch rows, row i
holding node i (row 0 the root, the last committed token). Rows keep vLLM's linear KV slots
(start + i); only their RoPE positions change to start + depth(i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.core import (
    DraftTree,
    KVCompactionPlan,
    TreeAcceptance,
    tree_attention_mask,
)
from vllm_ddtree.vllm.attention import TreeAttention


@dataclass(frozen=True)
class ProposedTree:
    """One request's proposed tree as plain lists over its nodes (root first, index order)."""

    token_ids: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int]

    @staticmethod
    def unbatch(trees: DraftTree) -> list[ProposedTree]:
        """One ProposedTree per request of a batch, valid nodes only."""
        columns = [t.tolist() for t in (trees.token_ids, trees.parents, trees.depths, trees.ranks)]
        return [
            ProposedTree(*(column[r][:n] for column in columns)) for r, n in enumerate(trees.num_nodes.tolist())
        ]


@dataclass(frozen=True)
class ScheduledTree:
    """A request of this step that verifies `draft_token_ids` (the scheduler's prefix of its tree)."""

    req_index: int
    first_row: int
    start: int
    root_token_id: int
    draft_token_ids: list[int]
    proposed: ProposedTree | None

    def shape(self) -> tuple[list[int], list[int], list[int]]:
        """(parents, depths, ranks) of root + scheduled nodes; a chain when the drafts are not our tree
        (e.g. the placeholder drafts vLLM schedules when the drafter was skipped): verifying any token
        list as a chain is exact."""
        n = 1 + len(self.draft_token_ids)
        proposed = self.proposed
        if proposed is not None and proposed.token_ids[1:n] == self.draft_token_ids:
            return proposed.parents[:n], proposed.depths[:n], proposed.ranks[:n]
        return list(range(-1, n - 1)), list(range(n)), [0] * n


@dataclass(frozen=True)
class TreeVerifyBatch:
    """The T tree-verify requests of a step, in batch order, with their trees padded to N nodes.

    req_indices, first_rows, starts: [T] batch index, batch row of the root, root position.
    tree: DraftTree [T, N]; ancestor_mask: tree_attention_mask(tree) [T, N, N].
    """

    req_indices: torch.Tensor
    first_rows: torch.Tensor
    starts: torch.Tensor
    tree: DraftTree
    ancestor_mask: torch.Tensor

    @classmethod
    def build(cls, scheduled: list[ScheduledTree]) -> TreeVerifyBatch:
        num_nodes = max(1 + len(s.draft_token_ids) for s in scheduled)
        tokens, parents, depths, ranks = [], [], [], []
        for s in scheduled:
            p, d, r = s.shape()
            pad = num_nodes - len(p)
            tokens.append([s.root_token_id, *s.draft_token_ids] + [s.root_token_id] * pad)
            parents.append(p + [-1] * pad)
            depths.append(d + [0] * pad)
            ranks.append(r + [0] * pad)
        sizes = torch.tensor([1 + len(s.draft_token_ids) for s in scheduled])
        valid = torch.arange(num_nodes).unsqueeze(0) < sizes.unsqueeze(1)
        depth_tensor = torch.tensor(depths)
        tree = DraftTree(
            token_ids=torch.tensor(tokens),
            parents=torch.tensor(parents),
            depths=depth_tensor,
            ranks=torch.tensor(ranks),
            valid=valid,
            num_nodes=sizes,
            max_depth=int(depth_tensor.max()),
        )
        return cls(
            req_indices=torch.tensor([s.req_index for s in scheduled]),
            first_rows=torch.tensor([s.first_row for s in scheduled]),
            starts=torch.tensor([s.start for s in scheduled]),
            tree=tree,
            ancestor_mask=tree_attention_mask(tree),
        )

    def node_rows(self) -> torch.Tensor:
        """[T, N] batch row of every node (padded nodes: the root's row)."""
        offsets = torch.arange(self.tree.nodes_per_request).unsqueeze(0)
        return self.first_rows.unsqueeze(1) + torch.where(self.tree.valid, offsets, 0)

    def node_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, RoPE positions) of the valid nodes for the verify pass: start + depth(i)."""
        positions = self.starts.unsqueeze(1) + self.tree.depths
        return self.node_rows()[self.tree.valid], positions[self.tree.valid]

    def linear_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, positions) of the valid nodes' rows once the window is read as a chain: start + i."""
        offsets = torch.arange(self.tree.nodes_per_request).unsqueeze(0)
        positions = self.starts.unsqueeze(1) + offsets
        return self.node_rows()[self.tree.valid], positions.expand_as(self.tree.valid)[self.tree.valid]

    def branching(self) -> torch.Tensor:
        """[T] bool: the request's tree is not a chain (some node's parent is not the node before it).
        A chain's tree mask is the causal mask, so vLLM's own attention is already exact for it."""
        previous = torch.arange(-1, self.tree.nodes_per_request - 1).unsqueeze(0)
        return ((self.tree.parents != previous) & self.tree.valid).any(1)

    def attention(self, block_table: torch.Tensor, block_size: int) -> TreeAttention | None:
        """What the tree-aware attention needs for the branching requests (None when every tree is a
        chain); block_table [num_reqs, max blocks] maps a request's positions to cache blocks
        (position p lives in block block_table[p // block_size], row p % block_size)."""
        branching = self.branching()
        if not bool(branching.any()):
            return None
        starts, tree = self.starts[branching], self.tree
        valid, num_nodes, ancestor_mask = tree.valid[branching], tree.num_nodes[branching], self.ancestor_mask[branching]
        num_req, width = valid.shape
        window_len = starts + num_nodes
        longest = int(window_len.max())
        block_ids = block_table[self.req_indices[branching]][:, : -(-longest // block_size)].long()
        pos = torch.arange(longest).unsqueeze(0)
        in_window = pos < window_len.unsqueeze(1)

        column = pos - starts.unsqueeze(1)  # tree node index of a window position, < 0 in the prefix
        in_tree = (column >= 0) & in_window
        ancestors = ancestor_mask.gather(2, column.clamp(0, width - 1).unsqueeze(1).expand(-1, width, -1))
        mask = (column < 0).unsqueeze(1) | (ancestors & in_tree.unsqueeze(1))
        mask = torch.where(valid.unsqueeze(2), mask, mask[:, :1])
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).unsqueeze(1)
        query_rows = self.node_rows()[branching].flatten()
        valid_nodes = valid.flatten().nonzero().squeeze(1)
        return TreeAttention(
            query_rows=query_rows,
            block_ids=block_ids,
            bias=bias,
            valid_nodes=valid_nodes,
            valid_rows=query_rows.index_select(0, valid_nodes),
        )


@dataclass(frozen=True)
class VerifiedStep:
    """A verify step's outcome, kept until the draft pass that follows it: the trees, the target's
    acceptance of them and the compaction plan (k-th accepted node -> window row k)."""

    batch: TreeVerifyBatch
    acceptance: TreeAcceptance
    plan: KVCompactionPlan
