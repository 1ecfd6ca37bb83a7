"""Deferred draft-context rows a finished request leaves unreadable: exactly those in its last, partial
KV block (every row of it with prefix caching off), against a simulation of block tables."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core import unreadable_context_rows
from vllm_ddtree.core.context_rows import _unreadable_in_torch


@st.composite
def deferred_piles(draw):
    """Requests with disjoint block tables, each with the tokens it computed and the rows of its last
    ones still deferred (since the last store), interleaved as steps leave them; some requests finished."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_requests = draw(st.integers(1, 6))
    free_blocks = list(range(64))
    random.Random(draw(st.integers(0, 2**31 - 1))).shuffle(free_blocks)
    requests = []
    for _ in range(num_requests):
        computed = draw(st.integers(0, 5 * block_size))
        lookahead = draw(st.integers(0, 1))  # a block reserved past the last computed token
        table = [free_blocks.pop() for _ in range(-(-computed // block_size) + lookahead)]
        first_deferred = draw(st.integers(0, computed))
        requests.append({"table": table, "computed": computed, "first_deferred": first_deferred,
                         "finished": draw(st.booleans())})
    rows = [(r, p) for r, req in enumerate(requests) for p in range(req["first_deferred"], req["computed"])]
    random.Random(draw(st.integers(0, 2**31 - 1))).shuffle(rows)
    rows.sort(key=lambda row: row[1])  # steps add positions in order; requests interleave within a step
    return block_size, requests, rows


def unreadable_oracle(block_size: int, requests: list[dict], rows: list[tuple[int, int]], prefix_caching: bool) -> list[bool]:
    """A finished request's row is unreadable unless its block is full of computed tokens (cached)."""
    full_blocks = [req["computed"] // block_size for req in requests]
    return [requests[r]["finished"] and (not prefix_caching or p // block_size >= full_blocks[r]) for r, p in rows]


@given(deferred_piles(), st.booleans())
def test_unreadable_rows_are_the_finished_requests_partial_blocks(pile, prefix_caching):
    block_size, requests, rows = pile
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    slots = torch.tensor([requests[r]["table"][p // block_size] * block_size + p % block_size for r, p in rows], dtype=torch.int64)
    finished = [req["table"] for req in requests if req["finished"]]
    expected = unreadable_oracle(block_size, requests, rows, prefix_caching)
    assert unreadable_context_rows(positions, slots, finished, block_size, prefix_caching).tolist() == expected  # numpy
    if finished and rows:  # (the public function answers the others before either path)
        assert _unreadable_in_torch(positions, slots, finished, block_size, prefix_caching).tolist() == expected  # devices' path


def test_nothing_is_unreadable_without_finished_requests_or_rows():
    positions, slots = torch.arange(5), torch.arange(5) + 40
    assert not unreadable_context_rows(positions, slots, [], 4, True).any()
    assert unreadable_context_rows(positions[:0], slots[:0], [[10, 11]], 4, True).shape == (0,)
    # a padding slot (-1) and a block past every table belong to no finished request
    for path in (unreadable_context_rows, _unreadable_in_torch):
        got = path(torch.tensor([0, 1, 0]), torch.tensor([-1, 5, 400]), [[1], []], 4, False)
        assert got.tolist() == [False, True, False]
        assert not path(positions, slots, [[], []], 4, True).any()  # finished requests without blocks
