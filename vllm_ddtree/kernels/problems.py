"""Random tree-verify attention problems in vLLM's GPU cache layout, shared by the kernel tests and
benchmarks/gpu_check.py (which runs on machines without vLLM, hence here and torch-only).

Trees come from the real builder (`build_draft_trees` on random draft top-k), so they include
padded nodes when the draft's top-k runs out (-inf log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.core import build_draft_trees, tree_attention_mask
from vllm_ddtree.kernels.tree_mask import pack_tree_mask


@dataclass(frozen=True)
class TreeVerifyProblem:
    """Inputs of `tree_attention` / `tree_attention_reference` (shapes as documented there) plus
    the dense mask and the backing cache tensor.

    kv_cache is vLLM 0.32's logical per-layer cache [num_blocks, Hkv, block_size, 2 * D] (physical
    NHD or HND strides); key_cache / value_cache are the backends' `transpose(1, 2).split(D, -1)` views.
    """

    query: torch.Tensor
    kv_cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tree_mask: torch.Tensor
    mask_bits: torch.Tensor
    scale: float


def random_tree_masks(num_req: int, budget: int, max_depth: int, topk: int, generator: torch.Generator, dead_fraction: float = 0.0) -> torch.Tensor:
    """[R, budget + 1, budget + 1] ancestor masks of best-first trees built from random draft top-k.

    dead_fraction: share of top-k entries set to -inf (ranks past the first), which leaves padded nodes.
    """
    logits = torch.randn((num_req, max_depth, topk), generator=generator) * 2.0
    logprobs = logits.log_softmax(-1).sort(-1, descending=True).values
    dead = torch.rand((num_req, max_depth, topk), generator=generator) < dead_fraction
    dead[:, :, 0] = False
    logprobs = torch.where(dead, float("-inf"), logprobs).sort(-1, descending=True).values
    token_ids = torch.argsort(torch.rand((num_req * max_depth, 4 * topk), generator=generator), dim=1)[:, :topk]
    roots = torch.zeros(num_req, dtype=torch.long)
    tree = build_draft_trees(roots, logprobs, token_ids.view(num_req, max_depth, topk), budget)
    return tree_attention_mask(tree)


def make_problem(
    prefix_lens: list[int],
    budget: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    kv_block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    layout: str = "NHD",
    seed: int = 0,
    max_depth: int = 15,
    topk: int = 8,
    dead_fraction: float = 0.0,
    spare_blocks: int = 3,
) -> TreeVerifyProblem:
    """A batch of R = len(prefix_lens) requests, each with N = budget + 1 tree nodes after its prefix.

    Every request owns distinct, shuffled physical blocks (plus `spare_blocks` unused ones filled
    with noise), so a wrong block-table lookup shows up as a wrong result. The block table is as wide
    as the longest request needs; its unused entries point at block 0.
    """
    gen = torch.Generator().manual_seed(seed)
    num_req, num_nodes = len(prefix_lens), budget + 1
    seq_lens = torch.tensor(prefix_lens, dtype=torch.int32) + num_nodes
    blocks_needed = [(int(n) + kv_block_size - 1) // kv_block_size for n in seq_lens]
    max_blocks = max(blocks_needed)
    num_blocks = sum(blocks_needed) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros((num_req, max_blocks), dtype=torch.int32)
    for r, count in enumerate(blocks_needed):
        block_table[r, :count] = torch.tensor(physical[:count], dtype=torch.int32)
        physical = physical[count:]

    logical = (num_blocks, num_kv_heads, kv_block_size, 2 * head_size)
    if layout == "NHD":  # physical [num_blocks, block_size, Hkv, 2D], viewed in logical order
        kv_cache = torch.empty((num_blocks, kv_block_size, num_kv_heads, 2 * head_size), dtype=dtype, device=device).transpose(1, 2)
    elif layout == "HND":
        kv_cache = torch.empty(logical, dtype=dtype, device=device)
    else:
        raise ValueError(f"layout must be NHD or HND, got {layout!r}")
    data_gen = torch.Generator(device=device).manual_seed(seed)
    kv_cache.copy_(torch.randn(logical, generator=data_gen, device=device))
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)

    tree_mask = random_tree_masks(num_req, budget, max_depth, topk, gen, dead_fraction).to(device)
    query = torch.randn((num_req, num_nodes, num_kv_heads * group, head_size), generator=data_gen, device=device).to(dtype)
    return TreeVerifyProblem(
        query=query,
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        seq_lens=seq_lens.to(device),
        tree_mask=tree_mask,
        mask_bits=pack_tree_mask(tree_mask),
        scale=head_size**-0.5,
    )
