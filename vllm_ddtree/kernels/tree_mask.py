"""Bit-packed ancestor masks: the compact tree-mask format the tree-attention kernel reads.

Format: `mask_bits[r, i, w]` (int32, [R, N, ceil(N / 32)]) holds bit `j % 32` of word `w = j // 32`
set iff node j is node i or one of its ancestors (bit 31 is the int32 sign bit).

Why bits and not parents + depth: the kernel tests a whole [query rows x tree keys] tile at once, and
one gathered word per (row, key) plus a shift does that for any tree shape without walking parent
pointers in the kernel (a walk would cost max_depth dependent loads per row). The size is tiny:
N = 129 nodes (budget 128) is 129 x 5 words = 2.6 KB per request. Any [N, N] mask packs this way, so
the kernel itself makes no tree assumption; the verify pass needs the diagonal set (every node sees
itself), which `vllm_ddtree.core.tree_attention_mask` guarantees.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def mask_words(num_nodes: int) -> int:
    """Words per mask row: ceil(num_nodes / 32)."""
    return (num_nodes + BITS_PER_WORD - 1) // BITS_PER_WORD


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a dense [R, N, N] bool mask into [R, N, ceil(N / 32)] int32 words (see module docstring).

    Pure tensor ops on the mask's device: no host sync, so it can run inside a CUDA graph.
    """
    num_req, num_rows, num_cols = mask.shape
    words = mask_words(num_cols)
    padded = torch.zeros((num_req, num_rows, words * BITS_PER_WORD), dtype=torch.int64, device=mask.device)
    padded[:, :, :num_cols] = mask.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones((), dtype=torch.int64, device=mask.device), torch.arange(BITS_PER_WORD, device=mask.device))
    unsigned = (padded.view(num_req, num_rows, words, BITS_PER_WORD) * weights).sum(-1)  # in [0, 2^32)
    return torch.where(unsigned >= 1 << 31, unsigned - (1 << 32), unsigned).to(torch.int32)
