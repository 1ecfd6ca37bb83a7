"""Target verify forward of a branching tree against a chain of the same rows, A/B inside one engine.

One in-process engine on the embedded pair, batch 1, greedy. A budget policy alternates the step shape:
the chain of `--budget` nodes (`TreeShape(budget, 1)`, vLLM's causal kernel only) and the best-first tree
of the same budget (branching: DDTree's tree attention). Every target forward of a decode step with
budget + 1 rows is timed and labelled by whether its step carried tree masks; consecutive (chain, tree)
pairs give one ratio each. Printed per context (short: 64-token held-out prompts; 2k: `--long` tokens):
median [min-max] of the per-pair ratios tree / chain, and median milliseconds of each.

    python benchmarks/verify_forward_ab.py [--budget 7] [--long 1856] [--tokens 64] [--prompts 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class Alternate:
    """Budget policy: the shapes in turn, one per step."""

    shapes: list[Any]
    turn: int = 0

    def choose(self, num_requests: int) -> Any:
        self.turn += 1
        return self.shapes[self.turn % len(self.shapes)]

    def observe(self, num_requests: int, used: Any, seconds: float | None, tokens: dict) -> None:
        pass

    def requests_arrived(self, num_requests: int) -> None:
        pass


@dataclass
class ForwardTimes:
    """Seconds of each decode verify forward with `rows` rows, in order, labelled tree (True) / chain."""

    rows: int
    steps: list[tuple[bool, float]] = field(default_factory=list)

    def pairs(self) -> list[tuple[float, float]]:
        """(chain, tree) seconds of neighbouring steps of the two kinds."""
        out = []
        for (kind_a, a), (kind_b, b) in zip(self.steps, self.steps[1:]):
            if kind_a != kind_b:
                out.append((a, b) if not kind_a else (b, a))
        return out[::2]  # disjoint pairs


def timed_runner(runner: Any, times: ForwardTimes) -> None:
    forward = runner._model_forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = forward(*args, **kwargs)
        seconds = time.perf_counter() - start
        step = runner.step
        if step is not None and int(step.tree.num_nodes.sum()) == times.rows and bool((step.num_drafts > 0).all()):
            times.steps.append((step.attention_rows() is not None, seconds))
        return result

    runner._model_forward = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=7)
    parser.add_argument("--long", type=int, default=1856, help="tokens of the long-context prompts")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_ddtree.core import TreeShape
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts
    from vllm_ddtree.demo.engines import context_prompts

    target, draft = demo_pair_paths()
    llm = LLM(
        model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
        max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=1, seed=0, enable_prefix_caching=False, kv_cache_memory_bytes=64 * 2**20,
        speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": args.budget, "ddtree_adaptive": False},
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    runner.use_budget_policy(Alternate([TreeShape(args.budget, 1), TreeShape(args.budget, None)]))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    contexts = {"short": heldout_prompts(args.prompts, 64), "2k": context_prompts(args.prompts, args.long)}
    print(f"budget {args.budget}: target forward of {args.budget + 1} rows, tree / chain, per neighbouring pair of steps")
    for name, prompts in contexts.items():
        times = ForwardTimes(rows=args.budget + 1)
        timed_runner(runner, times)
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
        runner._model_forward = type(runner)._model_forward.__get__(runner)
        pairs = times.pairs()
        ratios = sorted(tree / chain for chain, tree in pairs)
        chain_ms, tree_ms = (statistics.median(p[i] for p in pairs) * 1e3 for i in (0, 1))
        print(f"  {name:5s}: {statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}] over {len(pairs)} pairs; "
              f"chain {chain_ms:.2f} ms, tree {tree_ms:.2f} ms")


if __name__ == "__main__":
    main()
