"""Host-side tree work of one batch-1 engine step, by piece: what the runner's "tree build + verify
inputs" stage spends besides vLLM's own input preparation.

Pieces: the drafter's best-first tree from the draft top-k (`build_draft_trees_on_host`, the engine's
compiled build) and its flat drafts (`tolist`); the step object (`TreeStep.build`: the proposed tree taken back, the ancestor mask, RoPE
positions, node rows, the branching trees' rows); the CPU tree-attention metadata (`TreeAttention.build`).
Draft log-probs are peaked like a block draft's; the tree fills the budget. Pieces run round-robin, and
the table gives each piece's median and the median [min-max] of the per-round sums over `--rounds`.
(Inside an engine the same code runs about 2x slower: cold caches after the forwards.)

    python benchmarks/step_host_work.py [--budget 32] [--depth 7] [--prefix 70] [--rounds 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def pieces(budget: int, depth: int, prefix: int, block_size: int = 128) -> dict:
    from vllm_ddtree.vllm.attention import TreeAttention
    from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host
    from vllm_ddtree.vllm.tree_step import Proposals, TreeStep

    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(1, depth, budget, generator=gen).mul(3).log_softmax(-1).sort(-1, descending=True).values
    token_ids = torch.randint(1, 4000, (1, depth, budget), generator=gen)
    root = torch.tensor([5])
    trees = build_draft_trees_on_host(root, logprobs, token_ids, budget)
    num_nodes = int(trees.num_nodes[0])
    tokens = np.zeros((1, prefix + num_nodes + 1), dtype=np.int64)
    tokens[0, prefix : prefix + num_nodes] = trees.token_ids[0, :num_nodes].numpy()
    block_table = torch.arange(-(-(prefix + num_nodes) // block_size), dtype=torch.int32).unsqueeze(0)

    def step() -> TreeStep:
        store = Proposals()
        store.add(trees, ["r"])
        built = TreeStep.build(["r"], np.array([0]), np.array([prefix]), np.array([num_nodes - 1]), tokens, store)
        built.tree_positions()
        built.node_rows()
        built.attention_rows()
        return built

    rows = step().attention_rows()
    return {
        "build_draft_trees_on_host": lambda: build_draft_trees_on_host(root, logprobs, token_ids, budget),
        "drafts tolist": lambda: [nodes[:n] for nodes, n in zip(trees.token_ids[:, 1:].tolist(), (trees.num_nodes - 1).tolist())],
        "TreeStep.build + rows": step,
        "TreeAttention.build": lambda: TreeAttention.build(rows, block_table, block_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=70)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = pieces(args.budget, args.depth, args.prefix)
    seconds: dict[str, list[float]] = {name: [] for name in work}
    for fn in work.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in work.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    for name, values in seconds.items():
        print(f"{name:24s} {statistics.median(values) * 1e6:8.1f} us")
    totals = sorted(sum(round_) for round_ in zip(*seconds.values()))
    print(f"{'per step':24s} {statistics.median(totals) * 1e6:8.1f} us [{totals[0] * 1e6:.1f}-{totals[-1] * 1e6:.1f}]")


if __name__ == "__main__":
    main()
