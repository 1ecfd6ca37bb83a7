"""Element indices of token rows in vLLM's CPU paged KV cache, through a probed layout: the tests' reader."""

from __future__ import annotations

import torch

from vllm_ddtree.vllm.paged_kv import RegionLayout


def row_index(layout: RegionLayout, slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[2, S, num_kv_heads, head_size] flat element indices (keys, values) of the tokens at `slots` [S]
    in a contiguous cache [num_blocks, num_kv_heads, block_size, 2 * head_size] of this layout."""
    block_size, head_size = layout.key_offsets.shape
    region = 2 * block_size * head_size
    blocks, rows = slots.long() // block_size, slots.long() % block_size
    regions = (blocks[:, None] * num_kv_heads + torch.arange(num_kv_heads)) * region  # [S, num_kv_heads]
    offsets = torch.stack([layout.key_offsets, layout.value_offsets])  # [2, block_size, head_size]
    return regions[None, :, :, None] + offsets[:, rows, None, :]
