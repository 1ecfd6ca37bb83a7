"""Context rows of steps without speculation, held for one store pass (`DDTreeProposer.defer_context`).

A step without speculation keeps its rows for the draft: the target's hidden states (the aux layers'
outputs, concatenated feature-wise), their positions and KV slots. They are appended to buffers
allocated once and reused after every store pass, one copy per part and no allocation per step. On
the host the copies go through numpy views: at batch 1 a step appends one row, and a torch op per
copy (slice, cat, clone) costs several times a numpy assignment once a forward has evicted the caches.

Rows leave either all at once (`take`: a draft pass reads the whole context) or by KV block
(`remove_where` with `rows_in_blocks`: the blocks of requests that finished or were preempted, whose
rows must be stored or dropped before those blocks can be given to other requests); the rows of
running requests stay for the next pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MIN_ROWS = 64
"""Rows the buffers start with; they double when a step's rows do not fit."""


class DeferredContext:
    """Rows appended step by step until `take` hands them over. Invariant: the first `rows` rows of each
    buffer are the rows appended since the last `take`, in order; `removed` of them were removed
    (`remove_where`: their slots -1); the others are held."""

    def __init__(self) -> None:
        self.rows = 0
        self.removed = 0
        self._states: torch.Tensor | None = None  # [capacity, features]
        self._positions: torch.Tensor | None = None  # [capacity]
        self._slots: torch.Tensor | None = None  # [capacity]
        self._host_views: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        """numpy views of the three buffers when they live on the host."""
        self._index_views: dict[str, tuple[torch.Tensor, int, np.ndarray]] = {}
        """The last positions and slots tensors (kept, so their memory stays the views'), their data
        pointers and numpy views: the runner hands the same persistent buffers every step, so their views
        are made once (making one costs microseconds once a forward has evicted the caches)."""

    @staticmethod
    def row_bytes(parts: Sequence[torch.Tensor]) -> int:
        """Bytes of one row of hidden states made of `parts`."""
        return sum(part.shape[-1] for part in parts) * parts[0].element_size()

    def add(self, parts: Sequence[torch.Tensor], count: int, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Append the first `count` rows of hidden states given as feature-wise parts [>= count, F_i]
        (concatenated in order), positions [>= count] and KV slots [>= count] (copied: the caller's
        buffers are rewritten by the next step)."""
        start, end = self.rows, self.rows + count
        if self._states is None or end > self._states.shape[0]:
            self._reserve(end, parts, positions, slots)
        host = self._host_views
        if host is not None:
            states, held_positions, held_slots = host
            offset = 0
            for part in parts:
                width = part.shape[-1]
                states[start:end, offset : offset + width] = _numpy(part)[:count]
                offset += width
            held_positions[start:end] = self._index_view("positions", positions)[:count]
            held_slots[start:end] = self._index_view("slots", slots)[:count]
        else:
            assert self._states is not None and self._positions is not None and self._slots is not None
            torch.cat([part[:count] for part in parts], dim=-1, out=self._states[start:end])
            self._positions[start:end].copy_(positions[:count], non_blocking=True)
            self._slots[start:end].copy_(slots[:count], non_blocking=True)
        self.rows = end

    def _index_view(self, name: str, tensor: torch.Tensor) -> np.ndarray:
        """`tensor`'s numpy view, reused while the caller hands the same tensor object over the same memory."""
        cached = self._index_views.get(name)
        if cached is None or cached[0] is not tensor or cached[1] != tensor.data_ptr():
            cached = self._index_views[name] = (tensor, tensor.data_ptr(), _numpy(tensor))
        return cached[2]

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The rows held (states [n, F], positions [n], slots [n]: views of the buffers, valid until the
        next `add`; copies when rows were removed), none held after; None when none were."""
        if not self.rows:
            return None
        assert self._states is not None and self._positions is not None and self._slots is not None
        rows, removed, self.rows, self.removed = self.rows, self.removed, 0, 0
        held = self._states[:rows], self._positions[:rows], self._slots[:rows]
        if removed:
            kept = held[2] >= 0
            held = held[0][kept], held[1][kept], held[2][kept]
        return held

    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and KV slots of the first `rows` rows, removed ones included (slot -1) (views of the
        buffers, valid until the next `add` or take)."""
        assert self._positions is not None and self._slots is not None
        return self._positions[: self.rows], self._slots[: self.rows]

    def rows_where(self, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the rows where `selected` [rows] (bool) is true: states [k, F], positions [k], slots [k]."""
        assert self._states is not None and self._positions is not None and self._slots is not None
        return self._states[: self.rows][selected], self._positions[: self.rows][selected], self._slots[: self.rows][selected]

    def remove_where(self, selected: torch.Tensor) -> None:
        """Remove the rows held where `selected` [rows] (bool) is true. A removed row keeps its place, its
        slot set to -1 (a slot no block holds), until `take` leaves it out: rows are removed on every
        finish, and moving the rows kept would copy them all each time."""
        assert self._slots is not None and selected.shape == (self.rows,)
        slots = self._slots[: self.rows]
        selected = selected & (slots >= 0)
        self.removed += int(selected.sum())
        slots[selected] = -1
        if self.removed == self.rows:
            self.rows = self.removed = 0

    def _reserve(self, rows: int, parts: Sequence[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Grow the buffers to at least `rows` rows (at least doubled) for hidden states like `parts`, the
        rows held kept. (A step's parts always have the widths and dtype of the first step's: numpy
        refuses other widths.)"""
        features = sum(part.shape[-1] for part in parts)
        states = self._states
        assert states is None or (states.shape[1] == features and states.dtype == parts[0].dtype), "one engine's rows keep one layout"
        capacity = max(rows, MIN_ROWS, 2 * (states.shape[0] if states is not None else 0))
        device = parts[0].device
        grown = (torch.empty((capacity, features), dtype=parts[0].dtype, device=device),
                 torch.empty(capacity, dtype=positions.dtype, device=device),
                 torch.empty(capacity, dtype=slots.dtype, device=device))
        if states is not None and self._positions is not None and self._slots is not None:
            for new, old in zip(grown, (states, self._positions, self._slots)):
                new[: self.rows] = old[: self.rows]
        self._states, self._positions, self._slots = grown
        self._host_views = tuple(_numpy(buffer) for buffer in grown) if device.type == "cpu" else None  # type: ignore[assignment]


def rows_in_blocks(slots: torch.Tensor, block_tables: Sequence[Sequence[int]], block_size: int) -> torch.Tensor:
    """[n] bool: the rows (KV slots [n], slot = block id x block_size + offset) in a block of any of
    `block_tables` (padding slots, -1, in none)."""
    blocks = sorted({block for table in block_tables for block in table})
    if not blocks or slots.numel() == 0:
        return torch.zeros(slots.shape, dtype=torch.bool, device=slots.device)
    if slots.device.type == "cpu":  # numpy's floor division and isin: two ops where torch takes four
        return torch.from_numpy(np.isin(slots.numpy().astype(np.int64) // block_size, blocks))
    return _rows_in_blocks_torch(slots, blocks, block_size)


def _rows_in_blocks_torch(slots: torch.Tensor, blocks: list[int], block_size: int) -> torch.Tensor:
    """`rows_in_blocks` of device rows, given the blocks listed (sorted, at least one)."""
    listed = torch.tensor(blocks, dtype=torch.long, device=slots.device)
    return torch.isin(slots.long().div(block_size, rounding_mode="floor"), listed)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's numpy view (bfloat16, which numpy lacks, as its bits: the rows are only copied)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
