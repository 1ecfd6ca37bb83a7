"""TreeStep.build: every request of the batch gets a tree (its root alone without drafts), proposed
trees outlive steps the scheduler skips a request in, and drafts that are not the proposed tree are
verified as a chain and counted."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_ddtree.core import build_draft_trees
from vllm_ddtree.vllm.tree_step import Proposals, TreeStep


def proposed_trees(roots: list[int], budget: int = 6):
    """Best-first trees over a 2-candidate draft table: tokens 10 + depth (rank 0), 20 + depth (rank 1)."""
    depth = 3
    logprobs = torch.tensor([[-0.1, -0.5]] * depth).expand(len(roots), depth, 2).contiguous()
    token_ids = torch.tensor([[10 + d, 20 + d] for d in range(depth)]).expand(len(roots), depth, 2).contiguous()
    return build_draft_trees(torch.tensor(roots), logprobs, token_ids, budget)


def token_rows(starts: list[int], trees, rows: list[int], num_drafts: list[int]) -> np.ndarray:
    """Each request's tokens by position with its tree's first num_drafts nodes after the root."""
    tokens = np.zeros((len(starts), 64), dtype=np.int64)
    for r, (start, row, n) in enumerate(zip(starts, rows, num_drafts)):
        tokens[r, start] = 5
        if row >= 0:
            tokens[r, start : start + 1 + n] = trees.token_ids[row, : 1 + n].numpy()
    return tokens


def test_a_request_skipped_for_a_step_keeps_its_proposed_tree():
    store = Proposals()
    trees = proposed_trees([5, 5])
    store.add(trees, ["a", "b"])
    # step 1 schedules only "a" (with drafts) and a prefill "c"; step 2 schedules "b" with its drafts
    step1 = TreeStep.build(["a", "c"], np.array([0, 9]), np.array([7, 30]), np.array([4, 0]),
                           token_rows([7, 30], trees, [0, -1], [4, 0]), store)
    assert step1.num_chain_fallbacks == 0
    assert torch.equal(step1.tree.parents[0, :5], trees.parents[0, :5])
    assert step1.tree.num_nodes.tolist() == [5, 1] and (step1.num_drafts > 0).tolist() == [True, False]
    step2 = TreeStep.build(["b"], np.array([0]), np.array([12]), np.array([6]), token_rows([12], trees, [1], [6]), store)
    assert step2.num_chain_fallbacks == 0
    assert torch.equal(step2.tree.parents[0], trees.parents[1, :7])
    assert torch.equal(step2.tree.depths[0], trees.depths[1, :7])


def test_drafts_that_are_not_the_proposed_tree_are_verified_as_a_chain_and_counted():
    store = Proposals()
    trees = proposed_trees([5])
    store.add(trees, ["a"])
    tokens = token_rows([3], trees, [0], [4])
    tokens[0, 3 + 2] = 99  # the scheduler's drafts differ from the tree at node 2
    step = TreeStep.build(["a"], np.array([0]), np.array([3]), np.array([4]), tokens, store)
    assert step.num_chain_fallbacks == 1
    assert step.tree.parents[0].tolist() == [-1, 0, 1, 2, 3] and step.tree.depths[0].tolist() == [0, 1, 2, 3, 4]
    unknown = TreeStep.build(["z"], np.array([0]), np.array([3]), np.array([2]), tokens, Proposals())
    assert unknown.num_chain_fallbacks == 1


def test_vllms_placeholder_drafts_are_verified_as_a_chain_and_not_counted():
    """vLLM's scheduler pads a request joining a decoding batch with one token to compute to 1 + k rows of
    placeholder drafts (-1): no proposal holds them; they are verified as a chain (rejected: no target token
    is -1) and are no fallback. Real drafts without a proposal still are."""
    tokens = np.full((2, 64), 5)
    tokens[0, 4:7] = -1  # request "new": root at 3, three placeholders
    tokens[1, 21:23] = 9  # request "lost": root at 20, two drafts nobody proposed
    step = TreeStep.build(["new", "lost"], np.array([0, 4]), np.array([3, 20]), np.array([3, 2]), tokens, Proposals())
    assert step.num_chain_fallbacks == 1
    assert step.tree.parents[0].tolist() == [-1, 0, 1, 2] and step.tree.token_ids[0].tolist() == [5, -1, -1, -1]


def test_rows_of_logits_and_draw_positions():
    store = Proposals()
    trees = proposed_trees([5, 5])
    store.add(trees, ["a", "b"])
    step = TreeStep.build(["p", "a", "b"], np.array([9, 10, 15]), np.array([9, 20, 40]), np.array([0, 4, 2]),
                          np.concatenate([np.full((1, 64), 5), token_rows([20, 40], trees, [0, 1], [4, 2])]), store)
    assert step.num_chain_fallbacks == 0
    rows = step.node_logit_rows()
    assert rows[0, 0] == 0 and rows[1, :5].tolist() == [1, 2, 3, 4, 5] and rows[2, :3].tolist() == [6, 7, 8]
    assert step.draw_positions()[1, :5].tolist() == (21 + step.tree.depths[1, :5]).tolist()
    assert step.node_rows()[1, :5].tolist() == [10, 11, 12, 13, 14]
    assert step.node_rows()[0].tolist() == [9] * step.tree.nodes_per_request


def test_whole_proposed_trees_are_taken_as_built_by_the_general_path():
    """When the batch is the drafter's batch in its order and every tree was scheduled whole, the step
    reuses the drafter's tensors (`Proposals.whole`); the step equals the one gathered request by
    request (the same store entries offered in another order, then put back in order)."""
    trees = proposed_trees([5, 5], budget=5)
    trees = dataclasses.replace(trees, num_nodes=torch.tensor([6, 6]))
    args = (np.array([0, 6]), np.array([7, 30]), np.array([5, 5]), token_rows([7, 30], trees, [0, 1], [5, 5]))
    fast_store, slow_store = Proposals(), Proposals()
    fast_store.add(trees, ["a", "b"])
    slow_store.add(trees, ["a", "b"])
    assert slow_store.whole(["b", "a"]) is None  # another order: not whole
    fast = TreeStep.build(["a", "b"], *args, fast_store)
    general = TreeStep.build(["a", "b"], *args, _GatherOnly(slow_store))
    assert fast_store.whole(["a", "b"]) is None  # taken
    for name in ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes"):
        assert torch.equal(getattr(fast.tree, name), getattr(general.tree, name)), name
    assert fast.tree.max_depth == general.tree.max_depth
    assert torch.equal(fast.ancestor_mask, general.ancestor_mask) and fast.num_chain_fallbacks == general.num_chain_fallbacks == 0
    mismatch = token_rows([7, 30], trees, [0, 1], [5, 5])
    mismatch[1, 32] = 99
    store = Proposals()
    store.add(trees, ["a", "b"])
    step = TreeStep.build(["a", "b"], *args[:3], mismatch, store)
    assert step.num_chain_fallbacks == 1 and torch.equal(step.tree.parents[0], trees.parents[0])  # b alone, as the general path
    cut = (np.array([0, 6]), np.array([7, 30]), np.array([5, 3]), token_rows([7, 30], trees, [0, 1], [5, 3]))
    steps = []
    for store in (Proposals(), Proposals()):  # b's tree cut to 3 drafts: not scheduled whole, gathered
        store.add(trees, ["a", "b"])
        steps.append(TreeStep.build(["a", "b"], *cut, store if not steps else _GatherOnly(store)))
    for name in ("token_ids", "parents", "depths", "valid", "num_nodes"):
        assert torch.equal(getattr(steps[0].tree, name), getattr(steps[1].tree, name)), name
    assert steps[0].tree.num_nodes.tolist() == [6, 4] and steps[0].num_chain_fallbacks == 0


class _GatherOnly(Proposals):
    """A store that never hands out the drafter's tree whole: the general, per-request path."""

    def __init__(self, store: Proposals) -> None:
        super().__init__()
        self._latest = store._latest

    def whole(self, req_ids):
        return None
