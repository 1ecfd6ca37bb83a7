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
