"""Readable torch reference for `tree_attention`: gather each request's K/V, build the dense mask, SDPA.

Same arguments and shapes as the kernel (see `vllm_ddtree.kernels.tree_attention`), except that the
tree mask is the dense [R, N, N] bool form. Computes in float32 and returns the query's dtype. It
loops over requests and reads lengths on the host: a test oracle and benchmark baseline, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_request_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Rows 0..length-1 of one request from a paged cache [num_blocks, block_size, H, D] -> [length, H, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    return cache[block_table_row[positions // block_size].long(), positions % block_size]


def dense_verify_mask(tree_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[N, prefix_len + N] bool: node i sees the whole prefix, then tree node j iff tree_mask[i, j]."""
    num_nodes = tree_mask.shape[0]
    prefix = torch.ones((num_nodes, prefix_len), dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask], dim=1)


def tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Tree-verify attention, the slow and obvious way.

    Args:
        query: [R, N, Hq, D] the N tree nodes of each request (root first, padded nodes included).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D]; Hq is a multiple of Hkv.
        block_table: [R, max_blocks] physical block of each logical block.
        seq_lens: [R] tokens in the cache per request, tree included: the prefix is
            0 .. seq_lens - N - 1 and node j sits at position seq_lens - N + j. Needs seq_lens >= N.
        tree_mask: [R, N, N] bool, True where node i attends to node j (ancestor-or-self).
        scale: softmax scale.

    Returns:
        [R, N, Hq, D] in query.dtype.
    """
    num_req, num_nodes, num_q_heads, _ = query.shape
    group = num_q_heads // key_cache.shape[2]
    out = torch.empty_like(query)
    for r in range(num_req):
        length = int(seq_lens[r])
        k = gather_request_kv(key_cache, block_table[r], length).float().transpose(0, 1)  # [Hkv, L, D]
        v = gather_request_kv(value_cache, block_table[r], length).float().transpose(0, 1)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [Hq, L, D]
        mask = dense_verify_mask(tree_mask[r], length - num_nodes)
        q = query[r].float().transpose(0, 1)  # [Hq, N, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[r] = o.transpose(0, 1).to(query.dtype)
    return out
