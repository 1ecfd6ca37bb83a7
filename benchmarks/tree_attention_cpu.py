"""Tree-verify attention on CPU against vLLM's own kernel for the same number of chain rows.

One target attention layer at batch 1: B + 1 query rows over a prefix of P tokens in vLLM's paged CPU
cache. Variants, interleaved round-robin in one process (rotated order each round):
  chain  vLLM's CPU kernel (`cpu_attention_with_kv_cache`), causal: what a chain verify costs;
  tree   DDTree's torch formulation for a branching tree of the same rows (`attention.tree_attention`,
         what layers the compiled kernel does not take run; at batch 1 vLLM's kernel is skipped, see
         `DDTreeCPUAttentionMetadata.attach_tree`);
  compiled  DDTree's compiled kernel for the same tree (`cpu_tree_kernel.attend_tree_rows`).
Reports, per (budget, prefix), the median [min-max] over rounds of each round's tree / chain and
compiled / chain time ratios and the median microseconds of each. Shapes default to the embedded pair's target (4 query heads, 2 KV
heads, head size 64, float32, vLLM's CPU block size 128); one thread, as the engine runs. The cache
layout is the one vLLM picks for the dtype on this CPU (`_get_attn_isa`: bfloat16 on a CPU with AMX
tiles gets "amx"). The widened 0.6b pair's target: `--heads 16 8 64 --dtype bfloat16`.

    python benchmarks/tree_attention_cpu.py [--budgets 7 32] [--prefixes 64 2048] [--rounds 30] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def make_case(budget: int, prefix: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
              dtype: torch.dtype = torch.float32, seed: int = 0):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_ddtree.core import build_draft_trees, tree_attention_mask
    from vllm_ddtree.vllm.attention import TreeAttention
    from vllm_ddtree.vllm.paged_kv import probe_layout
    from vllm_ddtree.vllm.tree_step import TreeRows

    gen = torch.Generator().manual_seed(seed)
    isa = _get_attn_isa(dtype, block_size, head_size)
    rows = budget + 1
    num_blocks = -(-(prefix + rows) // block_size) + 1
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(num_blocks * block_size)
    ops.cpu_attn_reshape_and_cache(
        torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype),
        torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype),
        key_cache, value_cache, slots, isa,
    )
    query = torch.randn(rows, num_heads, head_size, generator=gen).to(dtype)
    output = torch.empty(rows, num_heads, head_size, dtype=dtype)
    block_table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    seq_lens = torch.tensor([prefix + rows], dtype=torch.int32)
    query_start_loc = torch.tensor([0, rows], dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )
    scale = head_size**-0.5

    def chain() -> None:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table,
            softcap=0.0, scheduler_metadata=scheduler, s_aux=None,
        )

    depth = 7
    logprobs = torch.randn(1, depth, 8, generator=gen).log_softmax(-1).sort(-1, descending=True).values
    tree = build_draft_trees(torch.zeros(1, dtype=torch.long), logprobs, torch.arange(8).expand(1, depth, 8), budget)
    tree_rows = TreeRows(
        req_indices=torch.zeros(1, dtype=torch.long), starts=torch.tensor([prefix]), num_nodes=tree.num_nodes, valid=tree.valid,
        ancestor_mask=tree_attention_mask(tree), node_rows=torch.arange(rows).unsqueeze(0),
    )
    layout = probe_layout(isa, block_size, head_size, dtype)
    from vllm_ddtree.vllm.attention import tree_attention
    from vllm_ddtree.vllm.cpu_tree_kernel import attend_tree_rows, layer_cache, warm_up

    attention = TreeAttention.build(tree_rows, block_table, block_size)
    warm_up()  # as the engine does at model load (BLAS threads included)
    kernel_cache = layer_cache(cache, layout)  # once per layer, as the engine does

    def tree_verify() -> None:
        attended = tree_attention(query, cache, attention, layout, num_kv_heads, scale)
        output.index_copy_(0, attention.valid_rows, attended.reshape(-1, *output.shape[1:]).to(dtype))

    def compiled() -> None:
        attend_tree_rows(output, query, kernel_cache, *attention.host_arrays, scale)

    return {"chain": chain, "tree": tree_verify, "compiled": compiled}


def interleaved(variants: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each variant per round; every round runs all variants in a rotated order."""
    names = list(variants)
    for fn in variants.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[name].append((time.perf_counter() - start) / calls)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[7, 32])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="calls per variant per round")
    parser.add_argument("--heads", type=int, nargs=3, default=[4, 2, 64], metavar=("Q", "KV", "HEAD_SIZE"))
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'budget':>6} {'prefix':>6} {'chain us':>9} {'tree us':>9} {'compiled us':>11}  "
          f"tree / chain, compiled / chain: median [min-max] over {args.rounds} rounds")
    for budget in args.budgets:
        for prefix in args.prefixes:
            seconds = interleaved(make_case(budget, prefix, *args.heads, args.block_size, getattr(torch, args.dtype)), args.rounds, args.calls)
            spreads = []
            for name in ("tree", "compiled"):
                ratios = sorted(t / c for t, c in zip(seconds[name], seconds["chain"]))
                spreads.append(f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
            chain_us, tree_us, compiled_us = (statistics.median(seconds[name]) * 1e6 for name in ("chain", "tree", "compiled"))
            print(f"{budget:>6} {prefix:>6} {chain_us:>9.1f} {tree_us:>9.1f} {compiled_us:>11.1f}  {spreads[0]}, {spreads[1]}")


if __name__ == "__main__":
    main()
