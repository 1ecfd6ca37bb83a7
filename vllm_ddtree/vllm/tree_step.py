"""One engine step of method 'ddtree', as one object: trees -> verify batch -> target tokens ->
acceptance -> KV plan.

Lifecycle (the runner owns at most one `TreeStep`, `DDTreeRunnerMixin.step`):
1. `_prepare_inputs`: `TreeStep.build` from the scheduler's batch and the previous step's `Proposals`
   (every request of the batch is in it: a request without drafts, e.g. a prefill, is a tree of its
   root alone); the runner then fills `node_slots` and the verify rows' RoPE positions.
2. `_build_attention_metadata`: the platform's attention reads `attention_rows()` for the masks of
   the branching trees.
3. `_sample`: `target_token_ids` (one token per node, by the core's sampling rule) and `acceptance`
   (the walk) are filled, and the accepted nodes' K/V move (`kv_moves`; on a device every entry of the
   core's `kv_compaction_plan`); the output rows are `acceptance.output_token_ids`.
4. `propose_draft_token_ids`: the drafter's context is put in path order (`kv_moves`); the drafter's new
   trees become the next step's `Proposals`.
The step is replaced by the next step's `build` (tests and benchmarks read it in between).

When the batch is exactly the drafter's batch, in its order, and every tree was scheduled whole (the
common case), the step takes the drafter's `DraftTree` as it is (`Proposals.whole`) instead of gathering
it back request by request.

The scheduler knows drafts only as flat token lists: the proposer hands it each tree's nodes in index
order (root excluded), so any prefix the scheduler keeps (token budget, max_model_len) is still a
prefix-closed tree (parents precede children). The trees themselves stay tensors (`Proposals`, each
request's latest tree until it is next scheduled) and are gathered back by request; a request whose scheduled drafts are not a prefix of its proposed tree (never
expected in synchronous scheduling) is verified as a chain, which is exact, and counted in
`num_chain_fallbacks` (logged by the runner). vLLM's placeholder drafts (`PLACEHOLDER_DRAFT`) are verified
as a chain too, and are no fallback.

A request's verify window is 1 + n batch rows, row i holding node i (row 0 the root, the last committed
token). Rows keep vLLM's linear KV slots (start + i); only their RoPE positions change to
start + depth(i).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.core import DraftTree, TreeAcceptance
from vllm_ddtree.vllm.host_tree import VerifyLayout, kv_moves_on_host, tree_attention_mask_on_host, verify_layout


@dataclass(frozen=True)
class ProposedTrees:
    """Proposed trees of some requests gathered for one step, [R, N] each (N = the step's width):
    found [R] says which requests have one; the other rows are meaningless."""

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    num_nodes: torch.Tensor
    found: torch.Tensor


class Proposals:
    """Each request's latest proposed tree, kept as a row of the drafter's batched `DraftTree` until
    the request is next scheduled (a request the scheduler skips for a step keeps its drafts, so its
    tree must outlive the next step), or finishes."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[DraftTree, int]] = {}

    def add(self, trees: DraftTree, req_ids: list[str]) -> None:
        """The drafter's trees, row i for req_ids[i]."""
        for row, req_id in enumerate(req_ids):
            self._latest[req_id] = (trees, row)

    def drop(self, req_ids: Iterable[str]) -> None:
        if not self._latest:  # steps without speculation keep none: no per-request loop
            return
        for req_id in req_ids:
            self._latest.pop(req_id, None)

    def whole(self, req_ids: list[str]) -> DraftTree | None:
        """The drafter's batched tree itself when it is exactly these requests' trees: one `DraftTree`
        whose row r is req_ids[r]; else None. (Whether each was scheduled whole is the caller's check.)
        Nothing is removed (`drop` once it is used)."""
        entries = [self._latest.get(req_id) for req_id in req_ids]
        first = entries[0]
        if first is None or first[0].num_requests != len(req_ids):
            return None
        trees = first[0]
        if any(entry is None or entry[0] is not trees or entry[1] != row for row, entry in enumerate(entries)):
            return None
        return trees

    def take(self, req_ids: list[str], width: int) -> ProposedTrees:
        """The trees of `req_ids` (removed from the store: a scheduled request is proposed anew), cut or
        padded to `width` nodes."""
        num_req = len(req_ids)
        out = ProposedTrees(
            token_ids=torch.zeros(num_req, width, dtype=torch.long),
            parents=torch.full((num_req, width), -1, dtype=torch.long),
            depths=torch.zeros(num_req, width, dtype=torch.long),
            ranks=torch.zeros(num_req, width, dtype=torch.long),
            num_nodes=torch.zeros(num_req, dtype=torch.long),
            found=torch.zeros(num_req, dtype=torch.bool),
        )
        groups: dict[int, tuple[DraftTree, list[int], list[int]]] = {}
        for index, req_id in enumerate(req_ids):
            entry = self._latest.pop(req_id, None)
            if entry is not None:
                trees, row = entry
                _, indices, rows = groups.setdefault(id(trees), (trees, [], []))
                indices.append(index)
                rows.append(row)
        for trees, indices, rows in groups.values():
            at, picked = torch.tensor(indices), torch.tensor(rows)
            span = min(width, trees.nodes_per_request)
            out.token_ids[at, :span] = trees.token_ids[picked, :span]
            out.parents[at, :span] = trees.parents[picked, :span]
            out.depths[at, :span] = trees.depths[picked, :span]
            out.ranks[at, :span] = trees.ranks[picked, :span]
            out.num_nodes[at] = trees.num_nodes[picked].clamp(max=span)
            out.found[at] = True
        return out


PLACEHOLDER_DRAFT = -1
"""vLLM's placeholder draft token: its scheduler pads a request that joins a decoding batch with one token
to compute (a one-token prompt, a prompt the prefix cache holds but for its last token, a resumed
request) to 1 + num_speculative_tokens rows of placeholder drafts (`Scheduler.schedule`, "pad new decode
requests to uniform spec decoding size", for CUDA graphs), whose input ids its runner clamps to 0. CPU
engines run `scheduler.UnpaddedScheduler`, which does not pad; CUDA engines run vLLM's scheduler."""


def _placeholders(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R] the request's scheduled drafts are vLLM's placeholders (`PLACEHOLDER_DRAFT`), which no proposal
    matches: verified as a chain, they are rejected (no target token is -1), wasted rows but no
    fallback."""
    return ((tokens == PLACEHOLDER_DRAFT) | ~valid)[:, 1:].all(1) & valid[:, 1:].any(1)


@dataclass(frozen=True)
class TreeRows:
    """The branching trees' rows, for the target's tree attention (chains need no mask: their tree mask
    is the causal one every attention kernel applies). T branching requests, N nodes.

    req_indices [T]: batch index; starts [T]: root position; num_nodes [T]; valid [T, N];
    ancestor_mask [T, N, N]; node_rows [T, N]: batch row of every node (padded nodes: the root's).
    """

    req_indices: torch.Tensor
    starts: torch.Tensor
    num_nodes: torch.Tensor
    valid: torch.Tensor
    ancestor_mask: torch.Tensor
    node_rows: torch.Tensor


@dataclass
class TreeStep:
    """R requests in batch order, their trees padded to N nodes (N = 1 + the most drafts scheduled).

    Built in `_prepare_inputs`:
      root_rows [R]: batch row of each root (its last scheduled row when it has no drafts);
      starts [R]: root position; num_drafts [R]: drafts scheduled (0: a tree of the root alone);
      tree: DraftTree [R, N]; layout: where its nodes go in the verify batch (`host_tree.VerifyLayout`:
      node and logits rows, branching, ancestor masks, positions, in one compiled pass; None when every
      tree is its root alone); ancestor_mask: tree_attention_mask(tree) [R, N, N];
      num_chain_fallbacks: requests verified as a chain because their drafts were not their tree's;
      has_drafts: some request verifies drafts (the step has a layout; False: every tree is its root
      alone, `roots_alone`).
    Filled by the runner:
      node_slots [R, N]: KV slot of every node's row (`_prepare_inputs`; steps with drafts only);
      target_token_ids [R, N], acceptance: `_sample`.
    """

    root_rows: torch.Tensor
    starts: torch.Tensor
    num_drafts: torch.Tensor
    tree: DraftTree
    layout: VerifyLayout | None = None
    num_chain_fallbacks: int = 0
    node_slots: torch.Tensor | None = None
    target_token_ids: torch.Tensor | None = None
    acceptance: TreeAcceptance | None = None

    @classmethod
    def build(
        cls,
        req_ids: list[str],
        root_rows: np.ndarray,
        starts: np.ndarray,
        num_drafts: np.ndarray,
        token_ids: np.ndarray,
        proposals: Proposals,
    ) -> TreeStep:
        """The step's trees. req_ids [R] in batch order; root_rows, starts, num_drafts [R] as above;
        token_ids [>= R, L]: each request's tokens by position, drafts included (vLLM's
        `input_batch.token_ids_cpu`), so node i's token is token_ids[r, start + i]. The requests'
        proposed trees are taken out of `proposals`."""
        num_req = len(req_ids)
        if not num_drafts.any():
            proposals.drop(req_ids)
            return cls.roots_alone(root_rows, starts, token_ids)
        num_nodes = 1 + num_drafts
        width = int(num_nodes.max())
        whole = proposals.whole(req_ids) if num_drafts.all() else None
        if whole is not None:  # scheduled whole? checked and laid out in one compiled pass
            layout = verify_layout(whole, width, root_rows, starts, num_drafts, token_ids)
            if layout is not None:
                proposals.drop(req_ids)
                return cls._of(_first_columns(whole, width, layout.max_depth), layout, root_rows, starts, num_drafts)
        offsets = np.arange(width)
        valid = offsets[None, :] < num_nodes[:, None]
        columns = starts[:, None] + np.where(valid, offsets[None, :], 0)
        tokens = torch.from_numpy(np.take_along_axis(token_ids[:num_req], columns, 1).astype(np.int64))
        chain = torch.arange(-1, width - 1).expand(num_req, width)
        parents, depths, ranks = chain.clone(), (chain + 1).clone(), torch.zeros(num_req, width, dtype=torch.long)
        valid_t = torch.from_numpy(valid)
        drafted = torch.from_numpy(num_drafts > 0)
        proposed = proposals.take(req_ids, width)
        same_tokens = ((proposed.token_ids == tokens) | ~valid_t)[:, 1:].all(1)
        use = drafted & proposed.found & (proposed.num_nodes >= torch.from_numpy(num_nodes)) & same_tokens
        fallbacks = int((drafted & ~use & ~_placeholders(tokens, valid_t)).sum())
        parents = torch.where(use.unsqueeze(1), proposed.parents, parents)
        depths = torch.where(use.unsqueeze(1), proposed.depths, depths)
        ranks = torch.where(use.unsqueeze(1), proposed.ranks, ranks)
        parents = torch.where(valid_t, parents, -1)
        depths = torch.where(valid_t, depths, 0)
        ranks = torch.where(valid_t, ranks, 0)
        tokens = torch.where(valid_t, tokens, tokens[:, :1])
        tree = DraftTree(
            token_ids=tokens,
            parents=parents,
            depths=depths,
            ranks=ranks,
            valid=valid_t,
            num_nodes=torch.from_numpy(num_nodes).long(),
            max_depth=int(depths.max()),
        )
        layout = verify_layout(tree, width, root_rows, starts, num_drafts)
        assert layout is not None
        return cls._of(tree, layout, root_rows, starts, num_drafts, num_chain_fallbacks=fallbacks)

    @classmethod
    def _of(
        cls, tree: DraftTree, layout: VerifyLayout, root_rows: np.ndarray, starts: np.ndarray, num_drafts: np.ndarray, num_chain_fallbacks: int = 0
    ) -> TreeStep:
        """The step of these trees, their layout and host arrays."""
        return cls(
            root_rows=torch.from_numpy(root_rows).long(),
            starts=torch.from_numpy(starts).long(),
            num_drafts=torch.from_numpy(num_drafts).long(),
            tree=tree,
            layout=layout,
            num_chain_fallbacks=num_chain_fallbacks,
        )

    @classmethod
    def roots_alone(cls, root_rows: np.ndarray, starts: np.ndarray, token_ids: np.ndarray) -> TreeStep:
        """A step without drafts (prefills, steps without speculation): every tree is its root alone.
        (Built from numpy arrays: the per-step cost of the commonest step at small batches.)"""
        num_req = len(root_rows)
        zeros = torch.from_numpy(np.zeros((num_req, 1), dtype=np.int64))
        tree = DraftTree(
            token_ids=torch.from_numpy(token_ids[np.arange(num_req), starts].astype(np.int64)[:, None]),
            parents=torch.from_numpy(np.full((num_req, 1), -1, dtype=np.int64)),
            depths=zeros,
            ranks=zeros,
            valid=torch.from_numpy(np.ones((num_req, 1), dtype=bool)),
            num_nodes=torch.from_numpy(np.ones(num_req, dtype=np.int64)),
            max_depth=0,
        )
        return cls(
            root_rows=torch.from_numpy(root_rows.astype(np.int64)),
            starts=torch.from_numpy(starts.astype(np.int64)),
            num_drafts=torch.from_numpy(np.zeros(num_req, dtype=np.int64)),
            tree=tree,
        )

    @functools.cached_property
    def ancestor_mask(self) -> torch.Tensor:
        if self.layout is None:  # roots alone
            return tree_attention_mask_on_host(self.tree)  # a step's trees are host tensors (`build`)
        return torch.from_numpy(self.layout.ancestor_mask)

    @property
    def has_drafts(self) -> bool:
        return self.layout is not None

    def node_rows(self) -> torch.Tensor:
        """[R, N] batch row of every node (padded nodes: the root's row). Computed once per step."""
        return self._node_rows

    def branching(self) -> torch.Tensor:
        """[R] bool: the request's tree is not a chain (some node's parent is not the node before it).
        Computed once per step."""
        return self._branching

    @functools.cached_property
    def _node_rows(self) -> torch.Tensor:
        if self.layout is None:  # roots alone
            return self.root_rows.unsqueeze(1)
        return torch.from_numpy(self.layout.node_rows)

    @functools.cached_property
    def has_branching(self) -> bool:
        """Some request's tree is not a chain: the step needs tree positions, masks and attention (a
        batch of chains keeps vLLM's linear positions and causal attention)."""
        return self.layout is not None and bool(self.layout.branching.any())

    @functools.cached_property
    def _branching(self) -> torch.Tensor:
        if self.layout is None:  # roots alone
            return torch.zeros(self.tree.num_requests, dtype=torch.bool)
        return torch.from_numpy(self.layout.branching)

    def tree_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, RoPE positions) of the branching trees' nodes for the verify pass: start + depth(i)
        (every other row already has its linear position)."""
        assert self.layout is not None
        return self.layout.rows, self.layout.tree_positions

    def linear_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) of the branching trees' nodes once each window is read as a chain:
        start + i (what the drafter expects once the accepted path is put first, `kv_moves`)."""
        assert self.layout is not None
        return self.layout.rows, self.layout.linear_positions

    def attention_rows(self) -> TreeRows | None:
        """The branching trees' rows for the tree attention; None when every tree is a chain."""
        if not self.has_branching:
            return None
        assert self.layout is not None
        if self.layout.branching.all():
            return TreeRows(
                req_indices=torch.arange(self.tree.num_requests),
                starts=self.starts,
                num_nodes=self.tree.num_nodes,
                valid=self.tree.valid,
                ancestor_mask=self.ancestor_mask,
                node_rows=self.node_rows(),
            )
        branching = self.branching()
        return TreeRows(
            req_indices=branching.nonzero().squeeze(1),
            starts=self.starts[branching],
            num_nodes=self.tree.num_nodes[branching],
            valid=self.tree.valid[branching],
            ancestor_mask=self.ancestor_mask[branching],
            node_rows=self.node_rows()[branching],
        )

    def kv_moves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(requests, src_offsets, dst_offsets) [M]: the K/V rows that move inside the verify windows once
        `acceptance` is known (`host_tree.kv_moves_on_host`: the real moves of the core's plan). Computed
        once per step."""
        return self._kv_moves

    @functools.cached_property
    def _kv_moves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        assert self.acceptance is not None
        return kv_moves_on_host(self.acceptance)

    def node_logit_rows(self) -> torch.Tensor:
        """[R, N] row of each node's logits in the step's logits, which hold 1 + num_drafts rows per
        request in batch order (vLLM's spec-decode logits; one row per request without drafts).
        Computed once per step."""
        return self._node_logit_rows

    @functools.cached_property
    def _node_logit_rows(self) -> torch.Tensor:
        if self.layout is None:  # roots alone: row r is request r's
            return torch.arange(self.tree.num_requests).unsqueeze(1)
        return torch.from_numpy(self.layout.node_logit_rows)

    def draw_positions(self) -> torch.Tensor:
        """[R, N] the sequence position of the token each node draws: root position + depth + 1."""
        return self.starts.unsqueeze(1) + self.tree.depths + 1


def _first_columns(trees: DraftTree, width: int, max_depth: int) -> DraftTree:
    """The trees' first `width` columns (the trees themselves when that is all of them; the rest are
    padding), with max_depth their deepest node's depth."""
    if width == trees.nodes_per_request:
        return DraftTree(trees.token_ids, trees.parents, trees.depths, trees.ranks, trees.valid, trees.num_nodes, max_depth, trees.chain_token_ids)
    return DraftTree(
        token_ids=trees.token_ids[:, :width],
        parents=trees.parents[:, :width],
        depths=trees.depths[:, :width],
        ranks=trees.ranks[:, :width],
        valid=trees.valid[:, :width],
        num_nodes=trees.num_nodes,
        max_depth=max_depth,
        chain_token_ids=trees.chain_token_ids,
    )
