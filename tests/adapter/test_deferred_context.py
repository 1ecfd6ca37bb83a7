"""`DeferredContext` holds exactly the rows appended since the last `take`, in order: the concatenation a
list of per-step copies would give (hidden states as their parts concatenated feature-wise)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.vllm.deferred_context import MIN_ROWS, DeferredContext

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def step_scripts(draw):
    """Part widths, a states dtype, whether positions and slots come in the same buffers every step (the
    runner's persistent ones) or in new tensors, and per step: rows appended (spare rows after them in
    the caller's buffers), or a take."""
    widths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    persistent = draw(st.booleans())
    steps = draw(st.lists(st.one_of(st.just("take"), st.tuples(st.integers(0, 2 * MIN_ROWS + 3), st.integers(0, 3))), max_size=12))
    return widths, dtype, persistent, steps


@settings(max_examples=60, deadline=None)
@given(step_scripts(), st.integers(0, 2**31))
def test_taken_rows_are_the_appended_rows_in_order(script, seed):
    widths, dtype, persistent, steps = script
    generator = torch.Generator().manual_seed(seed)
    held = DeferredContext()
    index_buffers = (torch.zeros(2 * MIN_ROWS + 6, dtype=torch.int64), torch.zeros(2 * MIN_ROWS + 6, dtype=torch.int32))
    expected: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for step in steps:
        if step == "take":
            taken = held.take()
            if not any(rows.shape[0] for rows, _, _ in expected):
                assert taken is None
            else:
                want = [torch.cat(column) for column in zip(*expected)]
                assert taken is not None and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(taken, want))
            expected.clear()
            assert held.rows == 0
            continue
        count, spare = step
        parts = [torch.randn(count + spare, width, generator=generator).to(dtype) for width in widths]
        positions = torch.randint(0, 10**6, (count + spare,), generator=generator)
        slots = torch.randint(0, 10**6, (count + spare,), generator=generator, dtype=torch.int32)
        if persistent:  # the same buffer objects every step, rewritten in place
            index_buffers[0][: count + spare], index_buffers[1][: count + spare] = positions, slots
            positions, slots = index_buffers
        held.add(parts, count, positions, slots)
        expected.append((torch.cat([part[:count] for part in parts], dim=-1), positions[:count].clone(), slots[:count].clone()))
        parts[0].fill_(7)  # the caller's buffers are rewritten by the next step: the rows held are copies
        positions.fill_(-1)
        assert held.rows == sum(rows.shape[0] for rows, _, _ in expected)
    assert DeferredContext.row_bytes([torch.zeros(1, w, dtype=dtype) for w in widths]) == sum(widths) * torch.zeros(0, dtype=dtype).element_size()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2 * MIN_ROWS), min_size=1, max_size=4), st.data())
def test_removed_rows_are_left_out_and_the_others_kept_in_order(counts, data):
    """`rows_where` copies the selected rows; `remove_where` (twice, overlapping) removes rows; `take` then
    gives the rows never removed, in order, and a later `add` appends after them."""
    held = DeferredContext()
    appended = []
    for k, count in enumerate(counts):
        states = torch.arange(count * 3, dtype=torch.float32).view(count, 3) + 1000 * k
        positions, slots = torch.arange(count) + 100 * k, torch.arange(count, dtype=torch.int32) + 1000 * k
        held.add([states[:, :1], states[:, 1:]], count, positions, slots)
        appended.append((states, positions, slots))
    everything = [torch.cat(column) for column in zip(*appended)]
    masks = [torch.tensor(data.draw(st.lists(st.booleans(), min_size=held.rows, max_size=held.rows)), dtype=torch.bool)
             for _ in range(2)]
    copied = held.rows_where(masks[0])
    assert all(torch.equal(a, b[masks[0]]) for a, b in zip(copied, everything))
    for mask in masks:
        held.remove_where(mask)
    kept = ~(masks[0] | masks[1])
    assert held.rows - held.removed == int(kept.sum())
    held.add([torch.ones(1, 1), torch.ones(1, 2)], 1, torch.tensor([7]), torch.tensor([7], dtype=torch.int32))
    rest = held.take()
    assert rest is not None and held.rows == held.removed == 0
    assert all(torch.equal(a[:-1], b[kept]) for a, b in zip(rest, everything))
    assert rest[1][-1] == 7 and rest[0].shape[0] == int(kept.sum()) + 1
