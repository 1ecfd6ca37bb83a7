"""Reading and moving CPU paged-KV rows through the probed layout agrees with vLLM's own cache writer."""

from __future__ import annotations

import pytest
import torch

from tests.adapter.paged_rows import row_index


def read_rows(kv_cache: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [S, num_kv_heads, head_size], at a `paged_kv.row_index`."""
    rows = kv_cache.view(-1)[index]
    return rows[0], rows[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_size"), [(32, 64), (128, 128)])
def test_rows_written_by_vllm_read_back_and_move(dtype, block_size, head_size):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_ddtree.vllm.paged_kv import cache_bits, move_rows, probe_layout, read_blocks

    isa = _get_attn_isa(dtype, block_size, head_size)
    num_blocks, num_heads = 5, 2
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:24]
    keys = torch.randn(24, num_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(24, num_heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)

    layout = probe_layout(isa, block_size, head_size, dtype)
    read_keys, read_values = read_rows(cache, row_index(layout, slots, num_heads))
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)

    # Whole blocks in block-table order: position p of a request is row p % block_size of its block p // block_size.
    block_ids = torch.tensor([[3, 0, 4], [1, 1, 2]])
    block_keys, block_values = read_blocks(cache, block_ids, layout)
    positions = torch.arange(3 * block_size)
    for r in range(2):
        row_slots = block_ids[r, positions // block_size] * block_size + positions % block_size
        expect_keys, expect_values = read_rows(cache, row_index(layout, row_slots, num_heads))
        assert torch.equal(block_keys[r], expect_keys.transpose(0, 1))
        assert torch.equal(block_values[r], expect_values.transpose(0, 1))

    # Overlapping move (a later source is an earlier destination): sources are read before writing.
    src, dst = slots[4:12], slots[:8]
    move_rows(cache_bits(cache), layout, num_heads, src.numpy(), dst.numpy())
    moved_keys, moved_values = read_rows(cache, row_index(layout, dst, num_heads))
    assert torch.equal(moved_keys, keys[4:12]) and torch.equal(moved_values, values[4:12])
