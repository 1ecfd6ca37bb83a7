"""Where an engine's step time goes, function by function, against another engine on the same work.

Engines of the named variants run interleaved (`vllm_ddtree.demo.engines`: each in its own engine-core
process, every round times each once, in rotated order); wall-clock timers around the named functions
are installed in each engine-core process (`vllm_ddtree.demo.function_timers`) and read after the
warm-up round and at the end. The table gives, per function, the seconds each engine spent in it over
the timed rounds and its calls, and the difference to the first variant; the first line gives the
median [min-max] per-round ratio of the variants' whole passes (prefill + decode), the engines' speed
on the same work.

    python benchmarks/step_functions.py [--variants none default] [--batch 16] [--temperature 1]
        [--prompts 16] [--max-tokens 64] [--context short] [--rounds 10] [--functions ...]

Variants, configured as the bench configures them: none (no speculation), chain (vLLM's DFlash chain),
default (method ddtree, cap 32, adaptive), width1 (ddtree_topk 1), tree<B> (a fixed tree of B nodes). Functions: "owner.attribute"
(`function_timers` lists the owners); the default set covers the step's main parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_FUNCTIONS = (
    "runner.execute_model", "runner.sample_tokens", "runner._prepare_inputs", "runner._model_forward",
    "runner._build_attention_metadata", "runner._sample", "runner._bookkeeping_sync", "runner._update_states",
    "runner.propose_draft_token_ids", "runner.take_draft_token_ids",
    "vllm_runner._prepare_inputs", "vllm_runner.sample_tokens", "vllm_runner._sample",
    "runner._build_step", "runner._choose_next_shape", "runner._defer_context", "runner._clock_sampled",
    "runner._accept_greedy", "runner._path_first", "runner._compact_target_kv", "runner._attach_tree_attention",
    "drafter.propose", "drafter.store_deferred_context", "draft_model.forward", "clock.step_started",
    "policy._pick", "policy.observe", "tree_step.build", "host_tree.build_draft_trees_on_host",
)


DEFAULT_BUDGET = 32


def speculative_config(variant: str, draft: str) -> dict[str, Any] | None:
    """The variant's config, as the bench builds it (`summary.build_variants`)."""
    from vllm_ddtree.demo.summary import build_variants

    budgets = [int(variant[4:])] if variant.startswith("tree") and variant[4:].isdigit() else []
    kind = "fixed" if budgets else variant
    for spec in build_variants(draft, budgets, DEFAULT_BUDGET):
        if spec.kind == kind and kind != "control":
            return spec.speculative_config
    raise SystemExit(f"unknown variant {variant!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "default"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", choices=["short", "2k"], default="short", help="the bench's contexts (prompt length, engine settings)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--functions", nargs="+", default=list(DEFAULT_FUNCTIONS))
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()

    from vllm_ddtree.demo.engines import configure_environment

    configure_environment()
    from vllm_ddtree.demo import demo_pair_paths, function_timers
    from vllm_ddtree.demo.engines import Work, context_prompts, run_round, shutdown_all, start_engines

    from benchmarks.bench import engine_kwargs, prompt_tokens

    target, draft = demo_pair_paths()
    variants = [(v, speculative_config(v, draft)) for v in args.variants]
    largest_budget = max(DEFAULT_BUDGET, *(config["num_speculative_tokens"] for _, config in variants if config))  # as the bench
    kwargs = engine_kwargs([args.context], args.max_tokens, largest_budget, len(variants), 1)
    engines, errors = start_engines(target, variants, kwargs, print)
    if errors:
        raise SystemExit(f"engines failed to start: {errors}")
    for engine in engines:
        engine.llm.collective_rpc(function_timers.install, args=(args.functions,))
    num_tokens = prompt_tokens(args.context, args.max_tokens, largest_budget)
    work = Work(tuple(map(tuple, context_prompts(args.prompts, num_tokens))), args.batch, args.temperature, args.max_tokens, seeded=False)
    run_round(engines, work, 0)  # warm-up
    before = {e.name: e.llm.collective_rpc(function_timers.read)[0] for e in engines}
    ratios: dict[str, list[float]] = {e.name: [] for e in engines[1:]}
    timed_ratios: dict[str, list[float]] = {e.name: [] for e in engines[1:]}  # the timed pass alone, as the bench
    for index in range(args.rounds):
        runs = run_round(engines, work, index + 1)
        seconds = {name: run.seconds + run.prefill.seconds for name, run in runs.items()}
        for name in ratios:
            ratios[name].append(seconds[engines[0].name] / seconds[name])
            timed_ratios[name].append(runs[engines[0].name].seconds / runs[name].seconds)
    after = {e.name: e.llm.collective_rpc(function_timers.read)[0] for e in engines}
    shutdown_all(engines)

    base = engines[0].name
    for name, values in ratios.items():
        timed = timed_ratios[name]
        print(f"{name} speed over {base}: {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}] (prefill pass + "
              f"timed pass; the timed pass alone, as the bench: {statistics.median(timed):.3f} [{min(timed):.3f}-{max(timed):.3f}])")
    table = {}
    for function in args.functions:
        row = {}
        for engine in engines:
            seconds, calls = after[engine.name].get(function, (0.0, 0))
            earlier = before[engine.name].get(function, (0.0, 0))
            row[engine.name] = (seconds - earlier[0], calls - earlier[1])
        if any(calls for _, calls in row.values()):
            table[function] = row
    print(f"{'function':40}" + "".join(f"{name:>24}" for name in (e.name for e in engines)) + "   diff to " + base)
    for function, row in sorted(table.items(), key=lambda item: -max(s for s, _ in item[1].values())):
        cells = "".join(f"{seconds:>12.3f} s ({calls:>6})" for seconds, calls in row.values())
        diffs = " ".join(f"{row[name][0] - row[base][0]:+.3f}" for name in row if name != base)
        print(f"{function:40}{cells}   {diffs}")
    if args.out is not None:
        args.out.write_text(json.dumps({"ratios": ratios, "timed_pass_ratios": timed_ratios, "functions": table, "args": vars(args) | {"out": str(args.out)}}, indent=1))


if __name__ == "__main__":
    main()
