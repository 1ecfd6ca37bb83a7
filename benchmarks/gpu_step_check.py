"""The device check's step part: the core's per-step ops at serving shapes, their times and host syncs,
and K/V compaction captured in a CUDA graph (used by gpu_check.py; torch + triton only, no vLLM).

Step ops at 16 requests, budget 64 (depth 15), vocabulary 151,936 (Qwen3): draft top-k, tree build,
ancestor masks, node sampling (greedy, and T = 1 with seeded requests), the acceptance walk and the
K/V plan. Each op runs once under `torch.cuda.set_sync_debug_mode("warn")` and the synchronising calls
it makes are counted (the GPU target is zero beyond vLLM's own draft hand-off); times are medians.
K/V compaction: `kv_rows.move_slots` on a logical [blocks, kv heads, block size, 2 * head size] cache
(NHD physical order) captured once, replayed with new slot lists written in place, equal to eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from vllm_ddtree.core import TreeSamplingParams, accept_tree, build_draft_trees, kv_compaction_plan, sample_tree_tokens, tree_attention_mask
from vllm_ddtree.vllm.kv_rows import move_slots

GPU_STEP = {"requests": 16, "budget": 64, "depth": 15, "vocab": 151_936}
SMOKE_STEP = {"requests": 2, "budget": 12, "depth": 5, "vocab": 512}


def count_syncs(fn: Callable[[], Any], device: torch.device) -> int:
    """Synchronising CUDA calls `fn` makes (0 on CPU, where nothing synchronises)."""
    if device.type != "cuda":
        fn()
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def step_ops(device: torch.device, median_ms: Callable[[Callable[[], Any]], float], smoke: bool) -> dict[str, dict[str, float]]:
    """{op: {"ms": median, "syncs": count}} for one step's core ops at GPU_STEP (SMOKE_STEP) shapes."""
    s = SMOKE_STEP if smoke else GPU_STEP
    requests, budget, depth, vocab = s["requests"], s["budget"], s["depth"], s["vocab"]
    gen = torch.Generator(device=device).manual_seed(0)
    draft_logits = torch.randn(requests * depth, vocab, device=device, generator=gen) * 4
    roots = torch.randint(0, vocab, (requests,), device=device, generator=gen)
    top = draft_logits.log_softmax(-1).topk(budget, dim=-1)
    values, indices = top.values.view(requests, depth, -1), top.indices.view(requests, depth, -1)
    tree = build_draft_trees(roots, values, indices, budget)
    mask = tree_attention_mask(tree)
    nodes = budget + 1
    target_logits = torch.randn(requests, nodes, vocab, device=device, generator=gen) * 4
    positions = torch.arange(nodes, device=device).expand(requests, nodes) + 100
    greedy = TreeSamplingParams(torch.zeros(requests, device=device), all_greedy=True)
    sampled = TreeSamplingParams(torch.ones(requests, device=device), seeds={r: 1000 + r for r in range(0, requests, 2)}, all_greedy=False)
    target = sample_tree_tokens(target_logits, greedy)
    acceptance = accept_tree(tree, target, mask)
    ops: dict[str, Callable[[], Any]] = {
        "draft top-k": lambda: draft_logits.log_softmax(-1).topk(budget, dim=-1),
        "tree build": lambda: build_draft_trees(roots, values, indices, budget),
        "ancestor masks": lambda: tree_attention_mask(tree),
        "node sampling, greedy": lambda: sample_tree_tokens(target_logits, greedy),
        "node sampling, T=1 (half seeded)": lambda: sample_tree_tokens(target_logits, sampled, positions),
        "acceptance walk": lambda: accept_tree(tree, target, mask),
        "K/V plan": lambda: kv_compaction_plan(acceptance),
    }
    return {name: {"ms": median_ms(fn), "syncs": count_syncs(fn, device)} for name, fn in ops.items()}


def kv_compaction_graph(device: torch.device) -> dict[str, Any]:
    """Capture move_slots once; replay with other slot lists (written in place) must equal eager."""
    blocks, heads, block_size, head = 64, 8, 16, 128
    physical = torch.randn(blocks, block_size, heads, 2 * head, device=device, dtype=torch.bfloat16)
    cache = physical.transpose(1, 2)  # logical [blocks, heads, block_size, 2 * head], NHD strides
    moves = 16 * 65
    gen = torch.Generator(device=device).manual_seed(1)
    slots = torch.randperm(blocks * block_size, device=device, generator=gen)
    src, dst = slots[:moves].clone(), slots[moves : 2 * moves].clone()
    move_slots(cache, src, dst)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_slots(cache, src, dst)
    new = torch.randperm(blocks * block_size, device=device, generator=gen)
    src.copy_(new[:moves])
    dst.copy_(new[moves : 2 * moves])
    expected = cache.clone()
    expected[dst // block_size, :, dst % block_size] = cache[src // block_size, :, src % block_size]
    graph.replay()
    torch.cuda.synchronize()
    return {"moves": moves, "replay_equals_eager": bool(torch.equal(cache, expected)), "correct": bool(torch.equal(cache, expected))}
