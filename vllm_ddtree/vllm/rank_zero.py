"""What every tensor-parallel rank must agree on, taken from TP rank 0 (both runner layers, docs/v2_runner.md D15).

Every rank runs the whole step: its draft and target forwards end in their own all-reduces, and nothing
guarantees bitwise-equal logits on every rank (hence equal ties), equal draws where a request has no
seed, or equal step timings for the budget policy. So the draft's top-K, the target's tokens and the
policy's tree shape are broadcast from TP rank 0: every rank builds the same trees, walks the same paths
and commits the same tokens (each then compacts its own K/V shard). Every rank calls these at the same
points of the same steps (collectives); at TP=1 each returns its input.
"""

from __future__ import annotations

import torch
from vllm.distributed import get_tp_group

from vllm_ddtree.core import TreeShape


def from_rank_zero(tensor: torch.Tensor) -> torch.Tensor:
    """TP rank 0's `tensor` (same shape and dtype on every rank) on every rank."""
    return get_tp_group().broadcast(tensor.contiguous(), src=0)


def shape_from_rank_zero(shape: TreeShape) -> TreeShape:
    """TP rank 0's tree shape (each rank's budget policy times its own steps)."""
    group = get_tp_group()
    if group.world_size == 1:
        return shape
    shared = group.broadcast(torch.tensor([shape.budget, shape.topk or 0]), src=0)
    return TreeShape(int(shared[0]), int(shared[1]) or None)
