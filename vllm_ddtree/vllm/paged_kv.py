"""Read and move token rows of vLLM's CPU paged KV cache without hard-coding its ISA-specific layout.

CPU_ATTN stores one layer's cache as [num_blocks, num_kv_heads, block_size, 2 * head_size]: per
(block, kv head) a contiguous region holding that block's keys, then its values, each in an order that
depends on the kernel ISA (e.g. "vec" keeps keys head-dim-major). `probe_layout` learns that order once
per (isa, block_size, head_size, dtype) by writing index probes with vLLM's own writer
(`cpu_attn_reshape_and_cache`) and reading them back; reads and moves are then plain index operations
on the regions. Only unquantized caches are supported: the probe fails unless the layout is a
permutation of the region.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_ddtree.vllm.host_tree import _compiled

_BASE = 16  # digits 1..16 are exact in every float dtype a KV cache uses


@dataclass(frozen=True)
class RegionLayout:
    """key_offsets / value_offsets [block_size, head_size]: where element (token offset t, dim d) of a
    block's keys / values lives inside its (block, kv head) region of 2 * block_size * head_size."""

    key_offsets: torch.Tensor
    value_offsets: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key_offsets.shape[0]

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """[2, block_size, head_size] int64: key_offsets and value_offsets stacked, as numpy (`move_rows`)."""
        return torch.stack([self.key_offsets, self.value_offsets]).numpy()

    @functools.cached_property
    def key_strides(self) -> tuple[int, int, int] | None:
        return _affine(self.key_offsets)

    @functools.cached_property
    def value_strides(self) -> tuple[int, int, int] | None:
        return _affine(self.value_offsets)


def _affine(offsets: torch.Tensor) -> tuple[int, int, int] | None:
    """(base, token stride, dim stride) if offsets[t, d] == base + t * token_stride + d * dim_stride
    (a strided view reads it: "vec" ISAs keep keys dim-major, values token-major), else None."""
    base = int(offsets[0, 0])
    token_stride = int(offsets[1, 0]) - base if offsets.shape[0] > 1 else 0
    dim_stride = int(offsets[0, 1]) - base if offsets.shape[1] > 1 else 0
    t = torch.arange(offsets.shape[0]).unsqueeze(1)
    d = torch.arange(offsets.shape[1]).unsqueeze(0)
    return (base, token_stride, dim_stride) if torch.equal(offsets, base + t * token_stride + d * dim_stride) else None


def _probe(isa: str, block_size: int, head_size: int, dtype: torch.dtype, probe_keys: bool) -> torch.Tensor:
    from vllm import _custom_ops as ops

    count = block_size * head_size
    index = torch.arange(count)
    decoded = torch.zeros(2 * count, dtype=torch.long)
    written = None
    scale = 1
    while scale < count:
        cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        digit = ((index // scale) % _BASE + 1).to(dtype).view(block_size, 1, head_size)
        zeros = torch.zeros_like(digit)
        key, value = (digit, zeros) if probe_keys else (zeros, digit)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
        flat = cache.view(-1)
        written = flat != 0 if written is None else written
        decoded += (flat.to(torch.long) - 1).clamp(min=0) * scale
        scale *= _BASE
    positions = written.nonzero().squeeze(1)
    values = decoded[positions]
    if positions.numel() != count or not torch.equal(values.sort().values, index):
        raise NotImplementedError(
            f"vllm_ddtree cannot read the CPU KV cache layout of ISA {isa!r} (dtype {dtype}); "
            "method 'ddtree' needs an unquantized CPU_ATTN cache"
        )
    offsets = torch.empty(count, dtype=torch.long)
    offsets[values] = positions
    return offsets.view(block_size, head_size)


@functools.cache
def probe_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> RegionLayout:
    return RegionLayout(
        key_offsets=_probe(isa, block_size, head_size, dtype, probe_keys=True),
        value_offsets=_probe(isa, block_size, head_size, dtype, probe_keys=False),
    )


def block_run(kv_cache: torch.Tensor, first_block: int, num_blocks: int, layout: RegionLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys_t, values) of the consecutive cache blocks first_block .. first_block + num_blocks - 1:
    keys_t [num_blocks, num_kv_heads, head_size, block_size] (keys transposed, ready for q @ k^T),
    values [num_blocks, num_kv_heads, block_size, head_size]. Views into the cache for an affine layout
    (no copy: "vec" ISAs keep keys dim-major, so keys_t's last dim is contiguous); a layout that is not
    affine is gathered (one selection by its offsets, a copy of these blocks only)."""
    block_size, head_size = layout.key_offsets.shape
    region = 2 * block_size * head_size
    regions = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], region)[first_block : first_block + num_blocks]
    num_kv_heads = regions.shape[1]

    def tokens(offsets: torch.Tensor, strides: tuple[int, int, int] | None, transposed: bool) -> torch.Tensor:
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        if strides is None:
            order = offsets.t() if transposed else offsets
            picked = regions.index_select(2, order.flatten())
            return picked.view(num_blocks, num_kv_heads, *order.shape)
        base, token_stride, dim_stride = strides
        picked = regions.as_strided(shape, (num_kv_heads * region, region, token_stride, dim_stride), regions.storage_offset() + base)
        return picked.transpose(2, 3) if transposed else picked

    return tokens(layout.key_offsets, layout.key_strides, True), tokens(layout.value_offsets, layout.value_strides, False)


def read_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, layout: RegionLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [R, num_kv_heads, W * block_size, head_size]: the tokens of blocks
    `block_ids` [R, W] in order, i.e. positions 0 .. W * block_size - 1 of each request's block table.
    Whole regions are copied, then read through a strided view of the layout (or, for a layout that
    is not affine, one selection by its offsets)."""
    num_req, width = block_ids.shape
    block_size, head_size = layout.key_offsets.shape
    region = 2 * block_size * head_size
    regions = kv_cache.index_select(0, block_ids.flatten()).view(num_req * width, -1, region)
    num_kv_heads = regions.shape[1]

    def tokens(offsets: torch.Tensor, strides: tuple[int, int, int] | None) -> torch.Tensor:
        shape = (num_req * width, num_kv_heads, block_size, head_size)
        if strides is None:
            picked = regions.index_select(2, offsets.flatten()).view(shape)
        else:
            base, token_stride, dim_stride = strides
            picked = regions.as_strided(shape, (num_kv_heads * region, region, token_stride, dim_stride), base)
        picked = picked.unflatten(0, (num_req, width)).transpose(1, 2)
        return picked.reshape(num_req, num_kv_heads, width * block_size, head_size)

    return tokens(layout.key_offsets, layout.key_strides), tokens(layout.value_offsets, layout.value_strides)


_SAME_WIDTH_INTEGERS = {2: torch.int16, 4: torch.int32}


def cache_bits(kv_cache: torch.Tensor) -> np.ndarray:
    """The cache's elements as a flat numpy view of integers of their width (`move_rows` moves bits, not
    values; bfloat16 has no numpy dtype)."""
    return kv_cache.view(-1).view(_SAME_WIDTH_INTEGERS[kv_cache.element_size()]).numpy()


@_compiled
def _move_rows(bits: np.ndarray, offsets: np.ndarray, num_kv_heads: int, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    _, block_size, head_size = offsets.shape
    region = 2 * block_size * head_size
    moved = np.empty((src_slots.size, 2, num_kv_heads, head_size), dtype=bits.dtype)
    for writing in (False, True):  # every source is read before any destination is written
        for m in range(src_slots.size):
            slot = dst_slots[m] if writing else src_slots[m]
            block, row = slot // block_size, slot % block_size
            for part in range(2):  # keys, values
                for head in range(num_kv_heads):
                    base = (block * num_kv_heads + head) * region
                    for d in range(head_size):
                        at = base + offsets[part, row, d]
                        if writing:
                            bits[at] = moved[m, part, head, d]
                        else:
                            moved[m, part, head, d] = bits[at]


def move_rows(bits: np.ndarray, layout: RegionLayout, num_kv_heads: int, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """Copy the token rows (keys and values of every KV head) at `src_slots` to `dst_slots` [M] int64 in a
    cache [num_blocks, num_kv_heads, block_size, 2 * head_size] of this layout, seen as `cache_bits`;
    sources are read first. Compiled: one call per layer, cheaper than the two torch index operations
    it replaces."""
    _move_rows(bits, layout.offsets, num_kv_heads, src_slots, dst_slots)


def warm_up() -> None:
    """Compile `move_rows` for both widths of cache element (or load it from the cache)."""
    offsets, slots = np.zeros((2, 1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64)
    for dtype in (torch.bfloat16, torch.float32):
        _move_rows(cache_bits(torch.zeros(2, dtype=dtype)), offsets, 1, slots, slots)


class LayerRows:
    """Moves token rows in CPU_ATTN attention layers' paged caches: each layer's `cache_bits`, probed
    layout and KV heads, read once (build it after the caches are bound; a rebound cache needs a new one)."""

    def __init__(self, layers: Iterable[Any]) -> None:
        self._caches = [
            (cache_bits(layer.kv_cache), probe_layout(layer.isa, layer.kv_cache.shape[2], layer.head_size, layer.kv_cache.dtype), layer.num_kv_heads)
            for layer in layers
        ]

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the K/V at host `src_slots` to `dst_slots` [M] in every layer."""
        src, dst = src_slots.numpy().astype(np.int64, copy=False), dst_slots.numpy().astype(np.int64, copy=False)
        for bits, layout, num_kv_heads in self._caches:
            move_rows(bits, layout, num_kv_heads, src, dst)
