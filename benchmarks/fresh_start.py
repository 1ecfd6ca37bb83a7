"""A fresh engine's first job: the default config (adaptive) against no speculation, vLLM's DFlash chain,
DDTree's chain and fixed trees, with and without the step costs timed at start-up
(`vllm_ddtree/vllm/v1/startup_costs.py`); and the start-up time that timing adds.

The job: `--prompts` held-out code prompts x `--max-tokens` tokens, greedy or sampled (seeded), served in
one `LLM.generate` call at batch 12 (`--batch` = the number of prompts), or one call per prompt at batch 1.
What a fresh engine brings to it is a budget policy that has measured nothing; so instead of starting
new engines for every round (~8 s each), each round gives the default engine a new policy before the
job, through `LLM.collective_rpc`: "startup" the policy an engine starts with (seeded with the costs it
timed at start-up), "online" one without a start-up table (what engines started with before). The
engines' caches are warm either way (one untimed warm-up job per batch size and temperature first, as a
user's first call follows the engine's own warm-up). Every variant's engine is alive at once and the
rounds interleave them in a rotated order (`vllm_ddtree.demo.engines`); reported: each variant's tokens/s
over the best of the alternatives (no speculation, the chains, the fixed trees) per round, as median
[min-max], and the default's startup / online ratio paired by round.

Start-up time (`--startup-rounds N`, before the jobs): N rounds, each starting and shutting down the
default config's engine and the same config with `ddtree_adaptive: false` (no start-up timing, otherwise
the same start), in alternating order; reported: each one's `LLM(...)` seconds and the timing's own
seconds (`startup_seconds` of the runner), median [min-max].

    python benchmarks/fresh_start.py [--batch 1 12] [--temperature 0 1] [--rounds 5] [--budget 32]
        [--startup-rounds 4] [--pinned-off] [--pair embedded|0.6b|1.7b] [--dtype float32|bfloat16]
        [--out benchmarks/results]

`--pinned-off` adds the default's engine with a policy pinned to off ("pinned-off"): where off is the
best alternative, the most the default can reach, so its ratio is the off path's own cost.

`--pair 0.6b` (or 1.7b) runs the shipped pair widened to that model's cost, computing the same function
(`vllm_ddtree.demo.widen_pair`, built on first use), with a KV cache sized from its layers
(`bench.kv_cache_bytes`); `--dtype bfloat16` is where such a pair's trees pay on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench import PAIRS, kv_cache_bytes, shipped_pair_paths

from vllm_ddtree.demo.engines import (
    ENGINE_KWARGS,
    Engine,
    configure_environment,
    rotated,
    shutdown_all,
    start_engines,
)


def new_policy(worker: Any, seeded: bool | str) -> int:
    """Give a DDTree runner a fresh adaptive policy, seeded with its start-up costs or not, or (seeded =
    "off") a policy pinned to off: the most the default can reach where off is right (runs in the
    engine-core process). Returns the number of start-up costs it was seeded with."""
    from vllm_ddtree.core import OFF, SamplingRegimes

    runner = worker.model_runner
    policy = getattr(getattr(runner, "drafter", None), "budget_policy", None)
    if policy is None:
        return 0
    if seeded == "off":

        class PinnedOff:
            shapes = policy.shapes

            def choose(self, num_requests: int, context_tokens: float = 0.0) -> Any:
                return OFF

            def observe(self, *args: Any, **kwargs: Any) -> None:
                pass

            def requests_arrived(self, num_requests: int) -> None:
                pass

        runner.use_budget_policy(PinnedOff())
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


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def show(values: list[float], unit: str = "x") -> str:
    s = spread(values)
    return f"{s['median']:.2f}{unit} [{s['min']:.2f}-{s['max']:.2f}]"


def time_startups(target: str, default: dict[str, Any], kwargs: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Start and shut down the default config's engine and the same one without adaptation, alternating
    which starts first, `rounds` times each: their LLM() seconds and the default's timing seconds."""
    variants = [("default", default), ("no start-up timing", {**default, "ddtree_adaptive": False})]
    seconds: dict[str, list[float]] = {name: [] for name, _ in variants}
    timing: list[float] = []
    batches: list[int] = []
    for round_index in range(rounds):
        for name, config in rotated(variants, round_index):
            start = time.perf_counter()
            engine = Engine.start(name, target, config, kwargs)
            seconds[name].append(time.perf_counter() - start)
            if name == "default":
                took, batches = engine.llm.collective_rpc(startup_timing)[0]
                timing.append(took)
            engine.shutdown()
    paired = [a - b for a, b in zip(seconds["default"], seconds["no start-up timing"])]
    print(f"engine start, {rounds} rounds: default {show(seconds['default'], ' s')}, "
          f"without the timing {show(seconds['no start-up timing'], ' s')}, paired difference {show(paired, ' s')}; "
          f"the timing itself {show(timing, ' s')} (batch sizes {batches})")
    return {"start_seconds": {name: spread(v) for name, v in seconds.items()}, "paired_difference_seconds": spread(paired),
            "timing_seconds": spread(timing), "timed_batch_sizes": batches, "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 12])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=32, help="num_speculative_tokens of the default config")
    parser.add_argument("--trees", type=int, nargs="*", default=[8, 16], help="fixed tree budgets run beside it")
    parser.add_argument("--startup-rounds", type=int, default=0, help="rounds of the start-up time comparison (0: none)")
    parser.add_argument("--pinned-off", action="store_true", help="also time the default's engine with its policy pinned to off")
    parser.add_argument("--pair", choices=PAIRS, default="embedded",
                        help="the shipped pair, or it widened to Qwen3-0.6B/1.7B cost (same function; built on first use)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args()
    configure_environment()
    from vllm import SamplingParams

    from vllm_ddtree.demo import heldout_prompts
    from vllm_ddtree.demo.summary import chain_length

    target, draft = shipped_pair_paths(args.pair)
    depth = chain_length(draft)
    kwargs = dict(ENGINE_KWARGS, max_num_seqs=max(args.batch), max_num_batched_tokens=2048, dtype=args.dtype)
    sequence = 64 + args.max_tokens + 2 * args.budget  # a prompt, its output and two trees past it
    if kv_bytes := kv_cache_bytes(args.pair, [target, draft], args.dtype, max(args.batch), sequence, kwargs["max_model_len"]):
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    ddtree = {"method": "ddtree", "model": draft}
    default = {**ddtree, "num_speculative_tokens": args.budget}
    report: dict[str, Any] = {"args": vars(args), "load_average_start": os.getloadavg(), "cells": []}
    if args.startup_rounds:
        report["startup"] = time_startups(target, default, kwargs, args.startup_rounds)

    prompts = [{"prompt_token_ids": ids} for ids in heldout_prompts(args.prompts, 64)]
    variants = [("plain", None), ("width1", {**ddtree, "num_speculative_tokens": depth, "ddtree_topk": 1, "ddtree_adaptive": False}),
                *((f"tree{b}", {**ddtree, "num_speculative_tokens": b, "ddtree_adaptive": False}) for b in args.trees),
                ("default", default)]
    if 0.0 in args.temperature:  # vLLM's CPU rejection sampler is biased at T > 0 (benchmarks/bench.py)
        variants.insert(1, ("dflash", {"method": "dflash", "model": draft, "num_speculative_tokens": depth}))
    engines, errors = start_engines(target, variants, kwargs, print)
    if errors:
        print(errors)
        return 1
    by_name = {e.name: e for e in engines}
    seconds, batches = by_name["default"].llm.collective_rpc(startup_timing)[0]
    print(f"start-up timing of the default engine: {seconds:.2f} s, batch sizes {batches}")
    tokens = len(prompts) * args.max_tokens

    def job(engine: Engine, batch: int, params: list[Any]) -> tuple[float, list[list[int]]]:
        calls = [(prompts, params)] if batch > 1 else [([p], [s]) for p, s in zip(prompts, params)]
        start, outputs = time.perf_counter(), []
        for call_prompts, call_params in calls:
            outputs += engine.llm.generate(call_prompts, call_params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    for temperature in args.temperature:
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                 seed=1000 + i if temperature > 0 else None) for i in range(len(prompts))]
        runs = [(name, name, None) for name, _ in variants if name != "default" and (temperature == 0 or name != "dflash")]
        runs += [("default", "startup", True), ("default", "online", False)]
        if args.pinned_off:
            runs.append(("default", "pinned-off", "off"))
        alternatives = [label for _, label, seeded in runs if seeded is None]
        for batch in args.batch:
            for engine_name, _, seeded in runs:  # untimed warm-up job
                if seeded is not None:
                    by_name[engine_name].llm.collective_rpc(new_policy, args=(seeded,))
                job(by_name[engine_name], batch, params)
            ratios: dict[str, list[float]] = {label: [] for _, label, _ in runs}
            speeds: dict[str, list[float]] = {label: [] for _, label, _ in runs}
            mismatches = 0
            for round_index in range(args.rounds):
                rate, outputs = {}, {}
                for engine_name, label, seeded in rotated(runs, round_index):
                    engine = by_name[engine_name]
                    if seeded is not None:
                        engine.llm.collective_rpc(new_policy, args=(seeded,))
                    took, outputs[label] = job(engine, batch, params)
                    rate[label] = tokens / took
                if temperature == 0:
                    mismatches += sum(outputs[label] != outputs["plain"] for label in outputs)
                best = max(rate[label] for label in alternatives)
                for label, value in rate.items():
                    ratios[label].append(value / best)
                    speeds[label].append(value)
                print(f"  batch {batch} T={temperature} round {round_index}: " + ", ".join(f"{label} {rate[label]:.0f}" for label in rate) + " tok/s")
            paired = [s / o for s, o in zip(speeds["startup"], speeds["online"])]
            print(f"batch {batch}, T={temperature}: tokens/s over the best of {', '.join(alternatives)} per round, "
                  f"median [min-max] of {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}"
                  + (f"; {mismatches} greedy outputs differ from plain decoding" if mismatches else ""))
            for label, values in ratios.items():
                print(f"  {label:8s} {show(values)}  ({statistics.median(speeds[label]):.0f} tok/s)")
            print(f"  startup / online: {show(paired)}")
            report["cells"].append({"batch": batch, "temperature": temperature, "load_average_end": os.getloadavg(),
                                    "over_best_alternative": {label: spread(v) for label, v in ratios.items()},
                                    "tokens_per_second": {label: spread(v) for label, v in speeds.items()},
                                    "startup_over_online": spread(paired), "greedy_mismatches": mismatches,
                                    "per_round_tokens_per_second": speeds})
    shutdown_all(engines)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fresh-start-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
