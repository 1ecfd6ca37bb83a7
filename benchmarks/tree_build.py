"""Host cost per request of a step's tree work as the engine runs it: top-k, build, mask, walk, K/V moves.

The engine's host path is the compiled `host_tree` kernels; the core's torch versions are references,
or for device tensors (`gpu_step_check.py` times those on a GPU).

Draft logits are realistic for a Qwen3 vocabulary (151,936 tokens): peaked, a few plausible tokens per
depth and a long tail. Prints a table (medians over repeats); `--json PATH` also writes the numbers.

    python benchmarks/tree_build.py [--block-size 16] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from vllm_ddtree.vllm.host_tree import (
    accept_tree_on_host,
    build_draft_trees_on_host,
    kv_moves_on_host,
    tree_attention_mask_on_host,
    warm_up,
)

VOCAB = 151_936


def peaked_draft_logits(batch: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """Peaked per-depth logits that flatten with depth, as a block draft's do."""
    logits = torch.randn(batch, depth, VOCAB, generator=gen)
    sharpness = torch.linspace(12.0, 4.0, depth).view(1, depth, 1)
    hot = torch.randint(0, VOCAB, (batch, depth, 8), generator=gen)
    logits.scatter_add_(2, hot, sharpness.expand(batch, depth, 8) * torch.rand(batch, depth, 8, generator=gen))
    return logits


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(batch: int, budget: int, block_size: int, repeats: int, gen: torch.Generator) -> dict:
    depth = block_size - 1
    logits = peaked_draft_logits(batch, depth, gen)
    roots = torch.randint(0, VOCAB, (batch,), generator=gen)
    topk = min(budget, VOCAB)

    def top():
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.topk(topk, dim=-1)

    values, indices = top()
    tree = build_draft_trees_on_host(roots, values, indices, budget)
    # The target agrees with the draft's rank-0 child where there is one: a deep walk.
    target = torch.where(tree.valid, tree.token_ids, 0)
    target = torch.roll(target, -1, dims=1)
    acceptance = accept_tree_on_host(tree, target)
    times = {
        "topk": median_seconds(top, repeats),
        "build": median_seconds(lambda: build_draft_trees_on_host(roots, values, indices, budget), repeats),
        "mask": median_seconds(lambda: tree_attention_mask_on_host(tree), repeats),
        "accept": median_seconds(lambda: accept_tree_on_host(tree, target), repeats),
        "kv_moves": median_seconds(lambda: kv_moves_on_host(acceptance), repeats),
    }
    per_request_us = {k: v / batch * 1e6 for k, v in times.items()}
    per_request_us["build+mask"] = per_request_us["build"] + per_request_us["mask"]
    return {"batch": batch, "budget": budget, "block_size": block_size, "us_per_request": per_request_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    warm_up()  # compiled (or loaded from numba's cache) before anything is timed
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"vocab {VOCAB}, block size {args.block_size}; microseconds per request (median of {args.repeats})")
    header = f"{'batch':>5} {'budget':>6} {'topk':>9} {'build':>8} {'mask':>8} {'build+mask':>14} {'accept':>8} {'kv_moves':>8}"
    print(header)
    rows = []
    for batch in args.batches:
        for budget in args.budgets:
            row = measure(batch, budget, args.block_size, args.repeats, gen)
            us = row["us_per_request"]
            print(
                f"{batch:>5} {budget:>6} {us['topk']:>9.1f} {us['build']:>8.1f} {us['mask']:>8.1f}"
                f" {us['build+mask']:>14.1f} {us['accept']:>8.1f} {us['kv_moves']:>8.1f}"
            )
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.machine(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
