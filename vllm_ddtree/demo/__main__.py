"""`make demo`: DDTree's default configuration next to no speculation, vLLM's DFlash chain and fixed trees.

On the embedded trained pair (vllm_ddtree/demo/pair/: a 4-layer Qwen3 target and its 2-layer DFlash
draft) with held-out standard-library code prompts, greedy, two scenarios:
* latency: batch 1, `--latency-prompts` prompts served one at a time;
* throughput: batch 16, one `LLM.generate` call of `--prompts` prompts, `--throughput-calls` times per
  round (interleaved call by call with the other variants).
Variants: no speculation; vLLM's DFlash chain; DDTree of width 1 (the chain's shape, stage-timed: the
chain of the step-time comparison); DDTree's default configuration (`num_speculative_tokens` =
`--default-budget`, adaptive: the headline); DDTree at fixed budgets (`--budgets`); with `--ngram`,
vLLM's n-gram (prompt lookup). N-gram is left out by default: in its own engine process on two shared
cores its generate calls, 0.1 s normally, stalled now and then for 2 to 26 s (measured), which would
dominate the run. (Its numba now loads in that engine's process, so it no longer keeps later engines
from starting, as it did in-process.)

How (`vllm_ddtree.demo.engines`): every variant's engine runs in its own process, all alive at once; a
warm-up round, then `--rounds` timed rounds, each serving both scenarios with every variant in an order
rotated by one place per round; speedups are taken inside each round and shown as median [min-max].
Tokens per step come from the engines' spec-decode stats, stage times from the fixed-shape DDTree
runners (VLLM_DDTREE_STAGE_TIMES=1; the default config runs untimed, as users run it). vLLM's output goes
to a log file next to the results.

Then a third scenario at a realistic cost (unless `--no-realistic`): the same pair widened to a
Qwen3-0.6B-class target computing the same function (`vllm_ddtree.demo.widen_pair`: 361M parameters, 28
layers; built into ~/.cache/vllm_ddtree/pairs/0.6b on first use, ~8 s and 1.6 GB, from the embedded pair:
no network), in bfloat16, batch 1: no speculation, vLLM's DFlash chain, the default configuration and a
fixed tree (`--realistic-budgets`), in engines of their own started after the first ones stop. There a
verify of 9-17 rows costs about one plain step, the memory-bound regime where trees pay, as on GPUs.

Prints one table per scenario and a paragraph computed from this run's stage times; writes a PNG and a
JSON. Exits 1 if any variant's output differs from plain decoding in any round of the float32 scenarios
(DDTree is lossless). In bfloat16 the tree rows' attention rounds differently from a plain step's, so a
near-tie of the logits may flip: the realistic scenario states its agreement with plain decoding (per
prompt, the tokens equal up to the first divergence) and does not fail on it.

    python -m vllm_ddtree.demo [--prompts 16] [--latency-prompts 8] [--max-tokens 64] [--rounds 3] [--throughput-calls 3]
                               [--budgets 8 32] [--default-budget 32] [--ngram] [--out benchmarks/results]
                               [--no-realistic] [--realistic-size 0.6b] [--realistic-prompts 4] [--realistic-max-tokens 48]
                               [--realistic-rounds 2] [--realistic-budgets 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from vllm_ddtree.demo.engines import ENGINE_KWARGS, Engine, TimedRun, Work, configure_environment, context_prompts, run_round
from vllm_ddtree.demo.engines import shutdown_all, start_engines
from vllm_ddtree.demo.quiet import quiet_run
from vllm_ddtree.demo.stats import StepSplit, spread
from vllm_ddtree.demo.summary import Agreement, VariantSummary, build_variants, format_agreement, format_shapes
from vllm_ddtree.demo.summary import format_speed_table, greedy_agreement, greedy_mismatches, summarize

PROMPT_TOKENS = 64
REALISTIC_DTYPE = "bfloat16"
REALISTIC_KV_BYTES = 128 * 2**20  # ~2000 tokens of the 0.6b pair's target and draft in bf16: 4 prompts, their outputs and trees


@dataclass(frozen=True)
class Scenario:
    """A named `Work`: latency (batch 1) or throughput (all prompts in one call)."""

    name: str
    work: Work
    setting: str = ""  # the pair and dtype where they are not the embedded pair's float32

    @property
    def description(self) -> str:
        w = self.work
        how = "served one at a time" if w.batch == 1 else "in one generate call" if w.batch == len(w.prompts) else f"{w.batch} per call"
        again = f" ({w.repeats} times per round)" if w.repeats > 1 else ""
        name = f"{self.name} ({self.setting})" if self.setting else self.name
        return f"{name}: {len(w.prompts)} prompts of {len(w.prompts[0])} tokens {how}{again}, {w.max_tokens} new tokens each"


@dataclass(frozen=True)
class ScenarioResult:
    """A scenario's summaries (`summary.summarize`) and greedy mismatches (`summary.greedy_mismatches`,
    float32: exact); in bfloat16 its greedy agreement instead (`summary.greedy_agreement`, stated)."""

    scenario: Scenario
    summaries: list[VariantSummary]
    mismatches: list[dict]
    agreement: tuple[Agreement, ...] = ()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the throughput scenario (its batch)")
    parser.add_argument("--latency-prompts", type=int, default=8, help="prompts of the latency scenario (batch 1)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--throughput-calls", type=int, default=3,
                        help="the throughput scenario's generate calls per variant and round (one call is ~1 s: a short sample of a drifting machine)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 32], help="fixed DDTree budgets")
    parser.add_argument("--default-budget", type=int, default=32, help="num_speculative_tokens of the default (adaptive) config")
    parser.add_argument("--ngram", action="store_true", help="also run vLLM's n-gram (prompt lookup)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--no-realistic", dest="realistic", action="store_false",
                        help="skip the realistic-cost scenario (the widened pair in bfloat16, batch 1)")
    parser.add_argument("--realistic-size", choices=("0.6b", "1.7b"), default="0.6b", help="the widened pair of that scenario")
    parser.add_argument("--realistic-prompts", type=int, default=4, help="its prompts, served one at a time")
    parser.add_argument("--realistic-max-tokens", type=int, default=48)
    parser.add_argument("--realistic-rounds", type=int, default=2, help="its timed rounds (after a warm-up round)")
    parser.add_argument("--realistic-budgets", type=int, nargs="*", default=[8], help="its fixed DDTree budgets")
    args = parser.parse_args(argv)
    if args.throughput_calls < 1:
        parser.error("--throughput-calls must be at least 1")
    return args


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    """Latency: the first `--latency-prompts` held-out prompts one at a time; throughput: the first
    `--prompts` in one call; greedy, `--max-tokens` each."""
    prompts = tuple(map(tuple, context_prompts(max(args.prompts, args.latency_prompts), PROMPT_TOKENS)))
    return [
        Scenario("latency", Work(prompts[: args.latency_prompts], 1, 0.0, args.max_tokens)),
        Scenario("throughput", Work(prompts[: args.prompts], args.prompts, 0.0, args.max_tokens, repeats=args.throughput_calls)),
    ]


def measure(
    engines: list[Engine], scenarios: list[Scenario], rounds: int, say: Callable[[str], None]
) -> tuple[dict[str, dict[str, list[TimedRun]]], dict[str, list[dict[str, TimedRun]]]]:
    """One warm-up round, then `rounds` timed rounds; each round runs every scenario with every engine
    (order rotated by the round). Returns the timed runs per scenario and variant, and every round per
    scenario (warm-up included, for the identity check)."""
    every: dict[str, list[dict[str, TimedRun]]] = {s.name: [] for s in scenarios}
    for k in range(1 + rounds):
        start = time.perf_counter()
        for scenario in scenarios:
            every[scenario.name].append(run_round(engines, scenario.work, k))
        say(f"  {'warm-up round' if k == 0 else f'round {k}/{rounds}'} ({time.perf_counter() - start:.0f} s)")
    timed = {name: {e.name: [r[e.name] for r in runs[1:]] for e in engines} for name, runs in every.items()}
    return timed, every


def realistic_scenario(args: argparse.Namespace) -> Scenario:
    """Batch 1 on the widened pair in bfloat16: the first `--realistic-prompts` held-out prompts one at a time."""
    prompts = tuple(map(tuple, context_prompts(args.realistic_prompts, PROMPT_TOKENS)))
    setting = f"{args.realistic_size} widened pair, {REALISTIC_DTYPE}"
    return Scenario("latency", Work(prompts, 1, 0.0, args.realistic_max_tokens), setting)


def vs_best_other(summaries: list[VariantSummary], kinds: tuple[str, ...] = ("chain", "width1", "fixed")) -> str:
    """The default configuration's tokens/s over the best of the `kinds` in the same round, as median
    [min-max] over rounds, naming the best's median ("" without a default or any of them)."""
    default = next((s for s in summaries if s.kind == "default"), None)
    others = [s for s in summaries if s.kind in kinds]
    if default is None or not others:
        return ""
    rounds = range(len(default.tokens_per_second.values))
    best = [max(s.tokens_per_second.values[k] for s in others) for k in rounds]
    ratio = spread([default.tokens_per_second.values[k] / best[k] for k in rounds])
    best_name = max(others, key=lambda s: s.tokens_per_second.median).variant
    return f"{ratio.format(2, 'x')} the best of {', '.join(s.variant for s in others)} per round (best median: {best_name})"


def headline(results: list[ScenarioResult]) -> str:
    """The default configuration's speedup over no speculation in each scenario, the scenario's setting
    in brackets where it is not the embedded pair's float32 ("" if the default did not run)."""
    defaults = [(r.scenario, s) for r in results for s in r.summaries if s.kind == "default" and s.vs_none]
    if not defaults:
        return ""
    return f"{defaults[0][1].variant}, tokens/s over no speculation: " + ", ".join(
        f"{scenario.name}{f' ({scenario.setting})' if scenario.setting else ''} {default.vs_none.format(2, 'x')}"
        for scenario, default in defaults
    )


def stage_paragraph(result: ScenarioResult) -> str:
    """Where the decode step of the largest fixed tree goes against the chain's (DDTree width 1), from
    this run's stage times."""
    trees = sorted((s for s in result.summaries if s.kind == "fixed" and s.step_ms and s.bound), key=lambda s: s.budget)
    chain = next((s for s in result.summaries if s.kind == "width1" and s.step_ms), None)
    if not trees or chain is None:
        return ""
    tree, c, t = trees[-1], chain.step_ms, trees[-1].step_ms

    def share(ms: float) -> str:
        return f"{ms:.2f} ms ({100 * ms / t.wall:.0f}%)"

    return (
        f"Where the time goes ({result.scenario.name}, batch {result.scenario.work.batch}, medians over rounds): a decode"
        f" step of DDTree budget {tree.budget} takes {t.wall:.2f} ms: draft forward {share(t.draft)}, DDTree's own stages"
        f" (top-k, tree build, acceptance, KV compaction) {share(t.own)}, target forward {share(t.forward)}, the rest of"
        f" the engine step {share(t.rest + t.outside)}. Its target forward runs {t.rows:.0f} rows per step on average"
        f" at {t.forward_per_row:.4f} ms per row; the chain's (DDTree width 1, {c.wall:.2f} ms per step) runs"
        f" {c.rows:.0f} rows at {c.forward_per_row:.4f} ms per row, so the tree's forward costs {t.forward / c.forward:.1f}x the"
        f" chain's for {tree.tokens_per_step.median / chain.tokens_per_step.median:.2f}x its tokens per step"
        f" ({tree.tokens_per_step.median:.2f} vs {chain.tokens_per_step.median:.2f}). With its own stages free and its"
        f" forward at the chain's cost per row, the tree would serve {tree.bound.format(2, 'x')} the chain's tokens/s"
        f" (measured: {tree.vs_chain.format(2, 'x')}). Trees pay where the verify forward is memory-bound, as on GPUs,"
        f" where verifying {tree.budget + 1} rows costs about as much as verifying 1, so the extra tokens per step"
        f" come almost free. A tiny model on two CPU cores is the hardest case: its forward is compute-bound and the"
        f" target's cost grows {growth(t, c)}, so every extra node must pay for itself in accepted tokens."
    )


def growth(tree: StepSplit, chain: StepSplit) -> str:
    """How the target forward's time grew from the chain's rows to the tree's, in words and numbers:
    "about linearly" when the cost per row stays within 15%, else by how much the tree's rows cost more."""
    times, rows = tree.forward / chain.forward, tree.rows / chain.rows
    numbers = f"{times:.1f}x the time for {rows:.1f}x the rows here"
    per_row = times / rows
    if abs(per_row - 1) <= 0.15:
        return f"about linearly with rows ({numbers})"
    if per_row > 1:
        return f"with rows, here faster than linearly ({numbers}: a tree row costs {per_row:.2f}x a chain row, the tree mask's price)"
    return f"with rows, here slower than linearly ({numbers}: a tree row costs {per_row:.2f}x a chain row)"


def plot(results: list[ScenarioResult], path: str) -> None:
    """One panel per scenario: tokens/s per variant (median, min-max bars), labelled with the speedup
    over no speculation and the tokens per step; the default configuration highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        shown = result.summaries
        medians = [s.tokens_per_second.median for s in shown]
        errors = [
            [m - s.tokens_per_second.low for m, s in zip(medians, shown)],
            [s.tokens_per_second.high - m for m, s in zip(medians, shown)],
        ]
        colors = ["C3" if s.kind == "default" else "C7" if s.kind == "none" else "C0" for s in shown]
        ax.bar(range(len(shown)), medians, yerr=errors, color=colors, capsize=3)
        for i, s in enumerate(shown):
            speedup = f"{s.vs_none.median:.2f}x\n" if s.vs_none else ""
            label = f"{speedup}{s.tokens_per_step.median:.2f} tok/step"
            top = (i, s.tokens_per_second.high)
            ax.annotate(label, top, ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(shown)), [s.variant for s in shown], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, 1.2 * max(s.tokens_per_second.high for s in shown))
        ax.set_title(result.scenario.description, fontsize=8)
    fig.suptitle("DDTree, greedy; the embedded pair in float32 unless a title says otherwise (bars: median over rounds, whiskers: min-max)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[list[ScenarioResult], dict[str, str]]:
    """Start the engines, measure both scenarios, stop the engines; returns the results and start errors."""
    from vllm_ddtree.demo import demo_pair_paths

    target, draft = demo_pair_paths()
    variants = build_variants(draft, args.budgets, args.default_budget, with_ngram=args.ngram)
    scenarios = scenarios_of(args)
    say(f"target {target}\ndraft  {draft}\nstarting {len(variants)} engines, one process each")
    engines, errors = start_engines(target, [(v.name, v.speculative_config) for v in variants], dict(ENGINE_KWARGS), say)
    try:
        say(f"{scenarios[0].description}; {scenarios[1].description}; greedy; a warm-up round, then {args.rounds} timed rounds")
        timed, every = measure(engines, scenarios, args.rounds, say)
    finally:
        shutdown_all(engines)
    results = [
        ScenarioResult(s, summarize(0.0, variants, timed[s.name]), greedy_mismatches(s.name, every[s.name])) for s in scenarios
    ]
    if args.realistic:
        result, realistic_errors = run_realistic(args, say)
        errors.update(realistic_errors)
        if result is not None:
            results.append(result)
    return results, errors


def run_realistic(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[ScenarioResult | None, dict[str, str]]:
    """The realistic-cost scenario (`realistic_scenario`) in engines of its own: no speculation, vLLM's DFlash
    chain, the default configuration and the fixed trees; greedy agreement stated, not required. Returns
    None for the result when no engine started."""
    from vllm_ddtree.demo.widen_pair import widened_pair_paths

    start = time.perf_counter()
    target, draft = widened_pair_paths(args.realistic_size)  # built on first use from the embedded pair
    scenario = realistic_scenario(args)
    variants = [v for v in build_variants(draft, args.realistic_budgets, args.default_budget) if v.kind != "width1"]
    say(f"\n{scenario.setting}: target {target} (ready in {time.perf_counter() - start:.0f} s)\n"
        f"starting {len(variants)} engines, one process each")
    kwargs = {**ENGINE_KWARGS, "dtype": REALISTIC_DTYPE, "kv_cache_memory_bytes": REALISTIC_KV_BYTES}
    engines, errors = start_engines(target, [(v.name, v.speculative_config) for v in variants], kwargs, say)
    if not engines:
        return None, errors
    try:
        say(f"{scenario.description}; greedy; a warm-up round, then {args.realistic_rounds} timed rounds")
        timed, every = measure(engines, [scenario], args.realistic_rounds, say)
    finally:
        shutdown_all(engines)
    agreement = tuple(greedy_agreement(scenario.description, every[scenario.name]))
    return ScenarioResult(scenario, summarize(0.0, variants, timed[scenario.name]), [], agreement), errors


def report(results: list[ScenarioResult], errors: dict[str, str], stem: str, args: argparse.Namespace, say: Callable[[str], None]) -> bool:
    """Print the tables and the paragraph, write PNG and JSON; True when every output equals plain decoding."""
    for result in results:
        say(f"\n{result.scenario.description}\n" + format_speed_table(result.summaries))
        if shapes := format_shapes(result.summaries):
            say(shapes)
        if result.scenario.setting and (best := vs_best_other(result.summaries)):
            say(f"default: {best}")
        if result.agreement:
            say("greedy agreement with no speculation (bfloat16: stated, not required; every round, warm-up included):\n"
                + format_agreement(list(result.agreement)))
    if line := headline(results):
        say("\n" + line)
    embedded = [r for r in results if not r.scenario.setting]
    paragraph = stage_paragraph(embedded[-1]) if embedded else ""
    if paragraph:
        say("\n" + paragraph)
    mismatches = [m for r in results for m in r.mismatches]
    plot(results, stem + ".png")
    with open(stem + ".json", "w") as f:
        json.dump(
            {
                "args": vars(args),
                "scenarios": [
                    {"description": r.scenario.description, "variants": [s.to_json() for s in r.summaries],
                     "greedy_agreement": [{**asdict(a), "identical_prompts": a.identical_prompts} for a in r.agreement]}
                    for r in results
                ],
                "greedy_mismatches": mismatches,
                "start_errors": errors,
                "headline": headline(results),
                "stage_paragraph": paragraph,
            },
            f,
            indent=2,
        )
    say(f"\nwrote {stem}.png, {stem}.json (vLLM's output: {stem}.log)")
    if mismatches or errors:
        return False
    exact = [r.scenario.name for r in results if not r.agreement]
    say(f"greedy outputs identical to plain decoding for every variant and round of the float32 scenarios ({', '.join(exact)})")
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_environment()
    with quiet_run(args.out, "demo") as (stem, say):
        results, errors = run_demo(args, say)
        identical = report(results, errors, stem, args, say)
    if not identical:
        mismatches = [m for r in results for m in r.mismatches]
        print(f"FAIL: outputs differ from plain decoding: {mismatches}; engines that did not start: {errors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
