"""Which deferred draft-context rows no request can ever read, once some requests have finished.

DFlash keeps every committed token's context as K/V in the draft's layers, computed from the target's
hidden states. Steps without speculation defer those rows and store them later in one pass. A finished
request's rows in its last, partial KV block need no store: the engine caches full blocks only, so that
block is freed without a hash, no prefix-cache hit ever reads it, and its next owner writes it anew.
With prefix caching off, no block of a finished request is ever read again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unreadable_context_rows(
    positions: torch.Tensor,
    slots: torch.Tensor,
    finished_blocks: Sequence[Sequence[int]],
    block_size: int,
    prefix_caching: bool,
) -> torch.Tensor:
    """[n] bool: the deferred rows (positions [n], KV slots [n], slot = block id x block_size + offset)
    that no request can read, given the KV block tables of the requests that finished.

    A finished request's rows are those in a block of its table. Invariants the caller keeps: the rows
    held are emptied (stored or dropped) whenever blocks may change hands, so no row belongs to a
    block's earlier owner; and they are stored before every draft pass, so a request's rows held are
    the tokens it computed since, its highest position the last token it computed. That token's block
    is partial unless the token ends it; a partial block holds the request's only uncached rows.
    Device ops only (no host sync)."""
    unreadable = torch.zeros(slots.shape, dtype=torch.bool, device=slots.device)
    if not finished_blocks or slots.numel() == 0:
        return unreadable
    blocks = slots // block_size
    for table in finished_blocks:
        owned = torch.isin(blocks, torch.as_tensor(list(table), dtype=blocks.dtype, device=blocks.device))
        if not prefix_caching:
            unreadable |= owned
            continue
        owned_positions = torch.where(owned, positions, -1)
        last_row = owned_positions.argmax()
        partial = (owned_positions[last_row] + 1) % block_size != 0  # False when it owns no row (-1 + 1)
        unreadable |= owned & (blocks == blocks[last_row]) & partial
    return unreadable
