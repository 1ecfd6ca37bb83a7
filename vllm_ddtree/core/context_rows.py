"""Which deferred draft-context rows no request can ever read, once some requests have finished.

DFlash keeps every committed token's context as K/V in the draft's layers, computed from the target's
hidden states. Steps without speculation defer those rows and store them later in one pass. A finished
request's rows in its last, partial KV block need no store: the engine caches full blocks only, so that
block is freed without a hash, no prefix-cache hit ever reads it, and its next owner writes it anew.
With prefix caching off, no block of a finished request is ever read again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def unreadable_context_rows(
    positions: torch.Tensor,
    slots: torch.Tensor,
    finished_blocks: Sequence[Sequence[int]],
    block_size: int,
    prefix_caching: bool,
) -> torch.Tensor:
    """[n] bool: the deferred rows (positions [n], KV slots [n], slot = block id x block_size + offset)
    that no request can read, given the KV block tables of the requests that finished (or were
    preempted: their blocks are freed alike).

    A finished request's rows are those in a block of its table. Invariants the caller keeps: a freed
    request's rows held are stored or dropped before its blocks can be given to another request, so no
    row belongs to a block's earlier owner; and every row held is stored before each draft pass, and
    rows leave the held set all at once or by whole blocks, so a request's rows held are
    the tokens it computed since, its highest position the last token it computed. That token's block
    is partial unless the token ends it; a partial block holds the request's only uncached rows.
    The finished requests' tables are read on the host (lists); the rows stay on their device. Host rows
    go through numpy (`_unreadable_on_host`), device rows through torch (`_unreadable_in_torch`): the
    same rule, op for op."""
    device = slots.device
    if not finished_blocks or slots.numel() == 0:
        return torch.zeros(slots.shape, dtype=torch.bool, device=device)
    if device.type == "cpu" and positions.device.type == "cpu":
        return torch.from_numpy(_unreadable_on_host(positions.numpy(), slots.numpy(), finished_blocks, block_size, prefix_caching))
    return _unreadable_in_torch(positions, slots, finished_blocks, block_size, prefix_caching)


def _unreadable_in_torch(
    positions: torch.Tensor, slots: torch.Tensor, finished_blocks: Sequence[Sequence[int]], block_size: int, prefix_caching: bool
) -> torch.Tensor:
    """`unreadable_context_rows` of rows on a device (the tables built on the host, then moved)."""
    device = slots.device
    num_finished = len(finished_blocks)
    tables = torch.full((num_finished, max(1, *map(len, finished_blocks))), -1, dtype=torch.long)  # [F, W], -1 pads
    for f, table in enumerate(finished_blocks):
        tables[f, : len(table)] = torch.as_tensor(list(table), dtype=torch.long)
    listed = tables >= 0
    if not bool(listed.any()):  # no finished request holds a block
        return torch.zeros(slots.shape, dtype=torch.bool, device=device)
    finished_ids, order = tables[listed].sort()  # the finished requests' blocks, sorted, and their owners
    owners = torch.arange(num_finished).unsqueeze(1).expand_as(tables)[listed][order]
    tables, finished_ids, owners = tables.to(device), finished_ids.to(device), owners.to(device)

    blocks = (slots // block_size).long()
    at = torch.searchsorted(finished_ids, blocks).clamp(max=finished_ids.numel() - 1)
    owner = torch.where(finished_ids[at] == blocks, owners[at], -1)  # [n]: finished request, or -1
    owned = owner >= 0
    if not prefix_caching:
        return owned
    row_owner = owner.clamp(min=0)
    last = torch.full((num_finished,), -1, dtype=positions.dtype, device=device)  # each one's last position
    last = last.scatter_reduce(0, row_owner, torch.where(owned, positions, -1), reduce="amax")
    partial = (last + 1) % block_size != 0  # False for a request without rows (-1 + 1)
    last_block = tables.gather(1, (last.clamp(min=0) // block_size).long().unsqueeze(1)).squeeze(1)
    return owned & partial[row_owner] & (blocks == last_block[row_owner])


def _unreadable_on_host(
    positions: np.ndarray, slots: np.ndarray, finished_blocks: Sequence[Sequence[int]], block_size: int, prefix_caching: bool
) -> np.ndarray:
    """`unreadable_context_rows` of host rows, step for step in numpy: a dozen vector ops where torch's
    two dozen small ops each cost tens of microseconds once a forward has evicted the caches (a server
    finishes a request every few steps)."""
    lengths = [len(table) for table in finished_blocks]
    if not any(lengths):  # no finished request holds a block
        return np.zeros(slots.shape, dtype=bool)
    width = max(lengths)
    tables = np.full((len(finished_blocks), width), -1, dtype=np.int64)  # [F, W], -1 pads
    for f, table in enumerate(finished_blocks):
        tables[f, : len(table)] = table
    listed = tables >= 0
    order = np.argsort(tables[listed], kind="stable")
    finished_ids = tables[listed][order]  # the finished requests' blocks, sorted, and their owners
    owners = np.broadcast_to(np.arange(len(finished_blocks))[:, None], tables.shape)[listed][order]

    blocks = slots.astype(np.int64) // block_size
    at = np.minimum(np.searchsorted(finished_ids, blocks), finished_ids.size - 1)
    owner = np.where(finished_ids[at] == blocks, owners[at], -1)  # [n]: finished request, or -1
    owned = owner >= 0
    if not prefix_caching:
        return owned
    last = np.full(len(finished_blocks), -1, dtype=np.int64)  # each one's last position
    np.maximum.at(last, owner[owned], positions[owned].astype(np.int64))
    partial = (last + 1) % block_size != 0  # False for a request without rows (-1 + 1)
    last_block = tables[np.arange(len(finished_blocks)), np.maximum(last, 0) // block_size]
    row_owner = np.maximum(owner, 0)
    return owned & partial[row_owner] & (blocks == last_block[row_owner])
