"""Where a GDN layer's state lives between speculative steps, and how a tree step leaves it where the
next step reads it (vLLM's chain layout, written here in plain torch).

vLLM's layout for a request with spec columns `slots` [R, num_spec + 1] (block-table columns):
- recurrent state: the state after window token t is kept in slot column t; the next step starts from
  column num_accepted - 1 (num_accepted = accepted drafts + 1, counting the root);
- convolution: one rolling buffer per request (slot column 0), [C, L] with L = W - 1 + num_spec. A step
  with previous count n reads its window history at columns n-1 .. n+W-3 and leaves the buffer as
  (columns n .. n+W-3 of the old buffer) ++ (its window inputs in window order). So window token k sits
  at column W-2+k, and the history the next step reads is the W-1 columns ending at its last accepted
  token.

A tree step writes node i where the chain writes token i (state in column i, input at column W-2+i).
After the walk, the accepted path a_0 = 0, a_1, ..., a_{m-1} is moved to where a chain of m accepted
tokens would have left it: input of a_k to column W-2+k (every k: the next windows span up to W-1 of
them) and the state of a_{m-1} to column m-1 (the only state the next step reads). A path with
a_k == k (a chain) moves nothing.
"""

from __future__ import annotations

import torch

from vllm_ddtree.core.accept import TreeAcceptance
from vllm_ddtree.core.kv_plan import kv_compaction_plan


def read_conv_history(buffer: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor, width: int) -> torch.Tensor:
    """[R, C, W-1]: the committed conv inputs before this step's root, oldest first.

    buffer: [S, C, L] all rolling buffers; slots: [R] each request's buffer; num_accepted: [R] the
    previous step's count (1 after a prefill or a plain decode).
    """
    rows = buffer.index_select(0, slots)
    columns = (num_accepted - 1).view(-1, 1) + torch.arange(width - 1, device=buffer.device)
    return rows.gather(2, columns.unsqueeze(1).expand(-1, rows.shape[1], -1))


def write_conv_window_(buffer: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor, x: torch.Tensor, width: int) -> None:
    """Roll each request's buffer as vLLM's chain step does: keep the last W-2 history inputs, then this
    step's inputs x [R, N, C] in node order from column W-2 (N <= L - W + 2; later columns untouched)."""
    history = read_conv_history(buffer, slots, num_accepted, width)
    window = torch.cat([history[:, :, 1:], x.transpose(1, 2).to(buffer.dtype)], dim=2)
    buffer[slots, :, : window.shape[2]] = window


def compact_conv_windows_(buffer: torch.Tensor, slots: torch.Tensor, acceptance: TreeAcceptance, width: int) -> None:
    """Move the accepted path's conv inputs to the chain's columns: a_k's (W-2+a_k) to W-2+k."""
    plan = kv_compaction_plan(acceptance)
    src, dst = (width - 2) + plan.src_offsets, (width - 2) + plan.dst_offsets  # [R, D]
    rows = slots.view(-1, 1).expand_as(src)
    moved = buffer[rows, :, src]  # [R, D, C], gathered before any write
    buffer[rows, :, dst] = moved


def accepted_state_move(acceptance: TreeAcceptance) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_columns, dst_columns) [R]: the last accepted node's state column and num_accepted - 1."""
    last = (acceptance.num_accepted - 1).view(-1, 1)
    return acceptance.accepted_nodes.gather(1, last).squeeze(1), last.squeeze(1)


def compact_recurrent_states_(states: torch.Tensor, slots: torch.Tensor, acceptance: TreeAcceptance) -> None:
    """Copy the deepest accepted node's recurrent state to spec column num_accepted - 1.

    states: [S, ...] the layer's state pool; slots: [R, num_spec + 1] the requests' spec columns.
    """
    src, dst = accepted_state_move(acceptance)
    src_slots, dst_slots = slots.gather(1, src.view(-1, 1)).squeeze(1), slots.gather(1, dst.view(-1, 1)).squeeze(1)
    states.index_copy_(0, dst_slots, states.index_select(0, src_slots))
