"""The V2 layer's RoPE positions without an engine: a step built at relative positions (the V2 layer's
build) gives each branching tree's rows the shift depth(i) - i, which moves vLLM's linear positions to
start + depth in place and back again, and leaves every other row alone."""

from __future__ import annotations

import numpy as np
import torch

from tests.adapter.test_tree_step import proposed_trees
from vllm_ddtree.vllm.tree_step import Proposals, TreeStep
from vllm_ddtree.vllm.v2.runner import shift_positions_, tree_deltas


def test_depth_shift_moves_linear_positions_to_start_plus_depth_and_back():
    store = Proposals()
    trees = proposed_trees([5, 5])
    store.add(trees, ["a", "b"])
    num_drafts = np.array([6, 4])
    root_rows = np.array([3, 12])  # a prefill chunk's rows 0-2 first, a gap row 10-11 between (another request)
    window = [trees.token_ids[r, : 1 + n].tolist() + [5] * (6 - n) for r, n in enumerate(num_drafts)]
    step = TreeStep.build(["a", "b"], root_rows, np.zeros(2, dtype=np.int64), num_drafts, np.array(window), store)
    assert step.num_chain_fallbacks == 0 and step.has_branching
    starts = torch.tensor([40, 90])
    step.starts = starts
    positions = torch.arange(20, dtype=torch.int64) + 1000
    for r in range(2):  # vLLM's linear positions: start + i on each verify window
        positions[root_rows[r] : root_rows[r] + 1 + num_drafts[r]] = starts[r] + torch.arange(1 + num_drafts[r])
    linear = positions.clone()
    shift_positions_(positions, *tree_deltas(step))
    for r in range(2):
        nodes = step.tree.valid[r]
        assert torch.equal(positions[step.node_rows()[r][nodes]], starts[r] + step.tree.depths[r][nodes])
    touched = np.zeros(20, dtype=bool)
    touched[step.node_rows().flatten().numpy()] = True
    assert torch.equal(positions[~torch.from_numpy(touched)], linear[~torch.from_numpy(touched)])
    rows, deltas = tree_deltas(step)
    shift_positions_(positions, rows, -deltas)
    assert torch.equal(positions, linear)
