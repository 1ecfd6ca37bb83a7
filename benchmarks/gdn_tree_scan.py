"""Per-layer cost of the GDN tree scan (conv over ancestors + gated delta rule from the parent's state)
at tree budgets 16/32/64, against the same scan on a chain of as many tokens.

Shapes of one Qwen3-Next-80B-A3B GDN layer (16 key heads, 32 value heads, head dim 128, conv width 4,
conv channels 2*16*128 + 32*128), one request; trees are best-first trees of a peaked 16-deep draft.
Prints medians over repeats (torch on CPU, float32: the reference path, not a kernel).

    python benchmarks/gdn_tree_scan.py [--budgets 16 32 64] [--repeats 10] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_ddtree.core import build_draft_trees, gdn_gating, tree_causal_conv1d, tree_gated_delta_rule

K_HEADS, V_HEADS, HEAD_DIM, WIDTH, DEPTH, TOPK = 16, 32, 128, 4, 15, 8
CHANNELS = 2 * K_HEADS * HEAD_DIM + V_HEADS * HEAD_DIM


def draft_tree(budget: int, chain: bool, gen: torch.Generator):
    logprobs = torch.randn(1, DEPTH, 4096, generator=gen).mul(3).log_softmax(-1).topk(TOPK, dim=-1)
    if chain:
        return build_draft_trees(torch.zeros(1, dtype=torch.long), logprobs.values[:, :, :1], logprobs.indices[:, :, :1], min(budget, DEPTH))
    return build_draft_trees(torch.zeros(1, dtype=torch.long), logprobs.values, logprobs.indices, budget)


def layer_step(tree, gen: torch.Generator):
    n = tree.nodes_per_request
    x = torch.randn(1, n, CHANNELS, generator=gen).bfloat16()
    history = torch.randn(1, CHANNELS, WIDTH - 1, generator=gen).bfloat16()
    weight, a, b = torch.randn(CHANNELS, WIDTH, generator=gen), torch.randn(1, n, V_HEADS, generator=gen), torch.randn(1, n, V_HEADS, generator=gen)
    state = torch.randn(1, V_HEADS, HEAD_DIM, HEAD_DIM, generator=gen).bfloat16()
    a_log, dt_bias = torch.randn(V_HEADS, generator=gen), torch.randn(V_HEADS, generator=gen)

    def run():
        mixed = tree_causal_conv1d(x, history, tree.parents, tree.depths, weight, None, silu=True).bfloat16()
        q, k, v = mixed.split([K_HEADS * HEAD_DIM, K_HEADS * HEAD_DIM, V_HEADS * HEAD_DIM], dim=-1)
        g, beta = gdn_gating(a_log, a, b, dt_bias)
        shape = (1, n, -1, HEAD_DIM)
        return tree_gated_delta_rule(q.reshape(shape), k.reshape(shape), v.reshape(shape), g, beta, tree.parents, tree.depths, state)

    return run


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"GDN layer {K_HEADS}k/{V_HEADS}v heads x {HEAD_DIM}, conv {CHANNELS}x{WIDTH}, {args.threads} thread(s), float32 torch")
    print(f"{'budget':>6} {'nodes':>5} {'depth':>5} {'tree ms':>8} {'chain ms (min(budget,15)+1 tokens)':>34} {'bf16 state MiB/node':>20}")
    for budget in args.budgets:
        tree = draft_tree(budget, chain=False, gen=gen)
        chain = draft_tree(budget, chain=True, gen=gen)
        depth = int(tree.depths.max())
        tree_ms, chain_ms = median_ms(layer_step(tree, gen), args.repeats), median_ms(layer_step(chain, gen), args.repeats)
        state_mib = V_HEADS * HEAD_DIM * HEAD_DIM * 2 / 2**20
        print(f"{budget:>6} {tree.nodes_per_request:>5} {depth:>5} {tree_ms:>8.2f} {chain_ms:>34.2f} {state_mib:>20.2f}")


if __name__ == "__main__":
    main()
