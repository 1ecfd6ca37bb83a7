"""A fresh engine's first job: the default config (adaptive) against no speculation and vLLM's DFlash chain,
with and without the step costs timed at start-up (`vllm_ddtree/vllm/startup_costs.py`).

The job: `--prompts` held-out code prompts x `--max-tokens` tokens, greedy or sampled (seeded), served in
one `LLM.generate` call at batch 12 (`--batch` = the number of prompts), or one call per prompt at batch 1.
What a fresh engine brings to it is a budget policy that has measured nothing; so instead of starting
new engines for every round (~8 s each), each round gives every DDTree engine a new policy before the
job, through `LLM.collective_rpc`: "startup" the policy an engine starts with (seeded with the costs it
timed at start-up), "online" one without a start-up table (what engines started with before). The
engines' caches are warm either way (one untimed warm-up job first, as a user's first call follows the
engine's own warm-up). Every variant's engine is alive at once and the rounds interleave them in a
rotated order (`vllm_ddtree.demo.engines`); reported: each variant's tokens/s over the best of no
speculation and the chain, per round, as median [min-max].

    python benchmarks/fresh_start.py [--batch 1 12] [--temperature 0] [--rounds 5] [--budget 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from vllm_ddtree.demo.engines import ENGINE_KWARGS, Engine, configure_environment, rotated, shutdown_all, start_engines


def new_policy(worker: Any, seeded: bool) -> int:
    """Give a DDTree runner a fresh adaptive policy, seeded with its start-up costs or not (runs in the
    engine-core process). Returns the number of start-up costs it was seeded with."""
    from vllm_ddtree.core import SamplingRegimes

    runner = worker.model_runner
    policy = getattr(getattr(runner, "drafter", None), "budget_policy", None)
    if policy is None:
        return 0
    fresh = SamplingRegimes(policy.shapes)
    costs = (runner.startup_costs or {}) if seeded else {}
    fresh.seed_costs(costs)
    runner.use_budget_policy(fresh)
    return len(costs)


def startup_timing(worker: Any) -> tuple[float, list[int]]:
    """(seconds the start-up timing took, batch sizes it timed) of a DDTree runner."""
    runner = worker.model_runner
    return float(getattr(runner, "startup_seconds", 0.0)), sorted({batch for batch, _ in getattr(runner, "startup_costs", None) or {}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 12])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=32, help="num_speculative_tokens of the default config")
    args = parser.parse_args()
    configure_environment()
    from vllm import SamplingParams

    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts

    target, draft = demo_pair_paths()
    prompts = [{"prompt_token_ids": ids} for ids in heldout_prompts(args.prompts, 64)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                             seed=1000 + i if args.temperature > 0 else None) for i in range(len(prompts))]
    variants = [("plain", None), ("default", {"method": "ddtree", "model": draft, "num_speculative_tokens": args.budget})]
    if args.temperature == 0:  # vLLM's CPU rejection sampler is biased at T > 0 (benchmarks/bench.py)
        variants.insert(1, ("dflash", {"method": "dflash", "model": draft, "num_speculative_tokens": 7}))
    kwargs = dict(ENGINE_KWARGS, max_num_seqs=max(args.batch), max_num_batched_tokens=2048)
    engines, errors = start_engines(target, variants, kwargs, print)
    if errors:
        print(errors)
        return 1
    default = next(e for e in engines if e.name == "default")
    seconds, batches = default.llm.collective_rpc(startup_timing)[0]
    print(f"start-up timing of the default engine: {seconds:.2f} s, batch sizes {batches}")
    runs = [("plain", "plain", None), *((("dflash", "dflash", None),) if args.temperature == 0 else ()),
            ("default", "startup", True), ("default", "online", False)]
    by_name = {e.name: e for e in engines}

    def job(engine: Engine, batch: int) -> tuple[float, list[list[int]]]:
        calls = [(prompts, params)] if batch > 1 else [([p], [s]) for p, s in zip(prompts, params)]
        start, outputs = time.perf_counter(), []
        for call_prompts, call_params in calls:
            outputs += engine.llm.generate(call_prompts, call_params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    tokens = len(prompts) * args.max_tokens
    for batch in args.batch:
        for engine_name, _, seeded in runs:  # untimed warm-up job
            if seeded is not None:
                by_name[engine_name].llm.collective_rpc(new_policy, args=(seeded,))
            job(by_name[engine_name], batch)
        ratios: dict[str, list[float]] = {label: [] for _, label, _ in runs}
        speeds: dict[str, list[float]] = {label: [] for _, label, _ in runs}
        for round_index in range(args.rounds):
            rate, outputs = {}, {}
            for engine_name, label, seeded in rotated(runs, round_index):
                engine = by_name[engine_name]
                if seeded is not None:
                    engine.llm.collective_rpc(new_policy, args=(seeded,))
                seconds, outputs[label] = job(engine, batch)
                rate[label] = tokens / seconds
            if args.temperature == 0:
                for label in outputs:
                    if outputs[label] != outputs["plain"]:
                        print(f"  MISMATCH: {label} differs from plain decoding in round {round_index}")
            best = max(rate[label] for label in ("plain", "dflash") if label in rate)
            for label in rate:
                ratios[label].append(rate[label] / best)
                speeds[label].append(rate[label])
            print(f"  batch {batch} round {round_index}: " + ", ".join(f"{label} {rate[label]:.0f} tok/s" for label in rate))
        print(f"batch {batch}, T={args.temperature}: tokens/s over the best of no speculation and the chain, median [min-max] of {args.rounds} rounds")
        for label in ratios:
            values = ratios[label]
            print(f"  {label:8s} {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]  ({statistics.median(speeds[label]):.0f} tok/s)")
        if "online" in ratios:
            paired = [s / o for s, o in zip(speeds["startup"], speeds["online"])]
            print(f"  startup / online: {statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]")
    shutdown_all(engines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
