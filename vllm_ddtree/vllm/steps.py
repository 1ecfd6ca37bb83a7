"""Step logic both runner layers share: what a walked `TreeStep` asks of the K/V cache and of the
draft's context, independent of where a runner keeps its inputs.

- `walk`: the acceptance walk over the step's sampled nodes, and vLLM's output rows;
- `kv_slot_moves`: the accepted nodes' K/V moves as (source, destination) KV slots, read on the host;
- `path_first`: the draft's context rows of every verify window in path order;
- `accepted_by_shape`: what each shape nested in the step's would have accepted (the budget clock's read-off);
- `verified_tokens`: the requests that verified drafts and the tokens they committed (what a mixed step
  reports to the budget clock).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.core import TreeShape, compact_rows_
from vllm_ddtree.vllm import host_tree
from vllm_ddtree.vllm.tree_step import TreeStep


def walk(step: TreeStep) -> torch.Tensor:
    """Fill `step.acceptance` from `step.target_token_ids`; returns vLLM's output rows [R, N] int32
    (accepted drafts + bonus, -1 padded). Both on the host."""
    assert step.target_token_ids is not None
    step.acceptance = host_tree.accept_tree_on_host(step.tree, step.target_token_ids)
    accepted_rows = step.acceptance.output_token_ids
    if accepted_rows.shape[1] == step.tree.nodes_per_request:  # roots alone, chains: no padding column
        return accepted_rows.to(torch.int32)
    output = torch.full((step.tree.num_requests, step.tree.nodes_per_request), -1, dtype=torch.int32)
    output[:, : accepted_rows.shape[1]] = accepted_rows
    return output


def kv_slot_moves(step: TreeStep) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(src_slots, dst_slots) [M]: the real moves that put each accepted path's K/V at rows start + k
    (`TreeStep.kv_moves`), as KV slots of the step's `node_slots`; None when nothing moves (a path
    through first children, a batch of chains). Needs `step.acceptance` and `step.node_slots`."""
    assert step.acceptance is not None and step.node_slots is not None
    requests, src, dst = step.kv_moves()
    if not requests.size:
        return None
    host_slots = step.node_slots.numpy()
    return torch.from_numpy(host_slots[requests, src]), torch.from_numpy(host_slots[requests, dst])


def path_first(step: TreeStep, aux_hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each verify window rewritten as root + accepted nodes (path order) then the rest: row root_row + k
    holds the k-th path node (copies; the inputs are the target's outputs). The draft then sees the layout
    of an accepted chain prefix followed by rejected rows, which vLLM's DFlash code handles. The rows'
    positions must be linear (start + k) too; each runner layer restores those."""
    requests, src, dst = step.kv_moves()
    if not requests.size:  # every accepted path already sits in path order
        return aux_hidden_states
    device = aux_hidden_states[0].device
    root_rows = step.root_rows.numpy()[requests]
    src, dst = torch.from_numpy(root_rows + src).to(device), torch.from_numpy(root_rows + dst).to(device)
    reordered = []
    for states in aux_hidden_states:
        states = states.clone()
        compact_rows_(states, src, dst)
        reordered.append(states)
    return reordered


def accepted_by_shape(shapes: list[TreeShape], used: TreeShape, step: TreeStep) -> dict[TreeShape, int]:
    """Drafts each of `shapes` nested in `used` (the shape this step's trees were drafted for) would have
    accepted on this step's walked trees; {used: 0} for roots alone (no draft to accept)."""
    if not step.has_drafts:
        return {used: 0}
    assert step.acceptance is not None and step.target_token_ids is not None
    return host_tree.accepted_by_shape_on_host(
        shapes, used, step.tree, step.acceptance.accepted_nodes, step.num_drafts.numpy() > 0, step.target_token_ids
    )


def verified_tokens(step: TreeStep, committed: np.ndarray) -> tuple[int, int]:
    """(requests of `step` that verified drafts, the tokens they committed), from committed [R], the
    tokens each request committed: what a step that also prefilled reports to the budget clock
    (`StepClock.step_sampled`). A request with drafts decodes, so none of them is a discarded prefill."""
    verified = step.num_drafts.numpy() > 0
    return int(np.count_nonzero(verified)), int(committed[verified].sum())
