"""KV-compaction plan: move the accepted nodes' K/V rows to the front of the verify window.

The verify pass writes node i of a request at window row start + i (linear slots). Each accepted node
attended only to the committed prefix and its own ancestors, so its K/V equal what sequential decoding
would have written; only their rows change: the k-th node of the accepted path (root k = 0) moves from
row start + accepted_nodes[k] to row start + k. Node indices increase along a path, so src >= dst, and
a later move never reads a row an earlier move wrote: copying in increasing k is safe in place, and so
is gathering all sources before writing.

Shapes stay fixed ([R, D], D = max path length <= N): entries past the accepted path are identity
moves of rows inside the request's own window that no real move writes, so the plan needs no masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.core.accept import TreeAcceptance


@dataclass(frozen=True)
class KVCompactionPlan:
    """src_offsets, dst_offsets: [R, D] row offsets inside each request's verify window (root = 0).
    is_move: [R, D] True where a real move happens (src != dst)."""

    src_offsets: torch.Tensor
    dst_offsets: torch.Tensor
    is_move: torch.Tensor


def kv_compaction_plan(acceptance: TreeAcceptance) -> KVCompactionPlan:
    nodes = acceptance.accepted_nodes
    dst = torch.arange(nodes.shape[1], device=nodes.device).expand_as(nodes)
    src = torch.where(nodes >= 0, nodes, dst)
    return KVCompactionPlan(src_offsets=src, dst_offsets=dst, is_move=src != dst)


def compact_rows_(buffer: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Apply a plan to a row-major buffer [rows, ...] in place (gather first, then write)."""
    buffer.index_copy_(0, dst_rows, buffer.index_select(0, src_rows))
