"""Move token rows inside vLLM's logical per-layer paged KV cache, whatever its physical stride order.

TRITON_ATTN and FLASH_ATTN hand each layer's cache over as a logical [num_blocks, num_kv_heads,
block_size, 2 * head_size] tensor whose physical order (NHD, HND, or layer-interleaved) lives only in
its strides; slot s is row s % block_size of block s // block_size. Indexing the logical tensor reads
and writes through those strides, so one gather and one scatter per cache move the keys and values of
every kv head at once, with fixed shapes and no host synchronisation (capturable in a CUDA graph).
"""

from __future__ import annotations

import torch


def move_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the token rows at `src_slots` [M] to `dst_slots` [M] of `kv_cache` in place: every source
    is read before any row is written, and an entry with src == dst is a no-op. Destinations must be
    distinct, and a no-op entry's slot must not be another entry's destination."""
    block_size = kv_cache.shape[2]
    src_slots, dst_slots = src_slots.long(), dst_slots.long()
    rows = kv_cache[src_slots // block_size, :, src_slots % block_size]  # [M, num_kv_heads, 2 * head_size]
    kv_cache[dst_slots // block_size, :, dst_slots % block_size] = rows
