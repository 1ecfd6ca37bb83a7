"""Variants, per-variant summaries and their text tables, shared by `make demo` and benchmarks/bench.py.

A summary turns one variant's timed rounds (`vllm_ddtree.demo.engines.TimedRun`, one per round) into
medians and ranges over rounds; every ratio is taken inside a round (`vllm_ddtree.demo.stats`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from vllm_ddtree.demo.engines import TimedRun
from vllm_ddtree.demo.stats import Bound, Spread, StepSplit, median_split, per_round_ratios, spread, zero_overhead_bound
from vllm_ddtree.vllm.stage_times import STAGES

NO_SPECULATION = "no speculation"


@dataclass(frozen=True)
class VariantSpec:
    """One engine. kind: "none", "chain" (vLLM's DFlash), "width1" (DDTree top-1), "fixed" (DDTree,
    fixed budget), "default" (DDTree's default configuration: adaptive, `budget` = its cap) or "ngram";
    greedy_only: timed at T = 0 only."""

    name: str
    kind: str
    budget: int | None
    speculative_config: dict[str, Any] | None
    greedy_only: bool = False


def chain_length(draft: str) -> int:
    """The DFlash chain's length: the draft's block_size - 1."""
    with open(os.path.join(draft, "config.json")) as f:
        return json.load(f)["block_size"] - 1


def build_variants(
    draft: str, budgets: list[int], default_budget: int, with_chain: bool = True, with_ngram: bool = False,
    with_control: bool = False,
) -> list[VariantSpec]:
    """No speculation (with_control, a second one of kind "control": its ratio to the first is what two
    identical engines differ by within a run); vLLM's DFlash chain (num_speculative_tokens =
    block_size - 1; greedy only: vLLM's CPU rejection sampler is biased at T > 0); DDTree of width 1
    (`ddtree_topk: 1`, the chain's shape under DDTree's exact sampler: the chain baseline at T > 0 and
    the stage-timed chain); DDTree at each fixed budget (`ddtree_adaptive: false`); DDTree's default
    configuration (only `num_speculative_tokens`: adaptive); vLLM's n-gram (prompt lookup, 4-grams)
    last, if asked for."""
    depth = chain_length(draft)
    ddtree = {"method": "ddtree", "model": draft}
    variants = [VariantSpec(NO_SPECULATION, "none", None, None)]
    if with_control:
        variants.append(VariantSpec(f"{NO_SPECULATION} (control)", "control", None, None))
    if with_chain:
        config = {"method": "dflash", "model": draft, "num_speculative_tokens": depth}
        variants.append(VariantSpec("dflash chain (vLLM)", "chain", depth, config, greedy_only=True))
    config = {**ddtree, "num_speculative_tokens": depth, "ddtree_topk": 1, "ddtree_adaptive": False}
    variants.append(VariantSpec("ddtree width 1", "width1", depth, config))
    config = {**ddtree, "num_speculative_tokens": default_budget}
    variants.append(VariantSpec(f"ddtree default (<={default_budget})", "default", default_budget, config))
    for b in budgets:
        config = {**ddtree, "num_speculative_tokens": b, "ddtree_adaptive": False}
        variants.append(VariantSpec(f"ddtree budget {b}", "fixed", b, config))
    if with_ngram:
        config = {"method": "ngram", "num_speculative_tokens": depth, "prompt_lookup_max": 4}
        variants.append(VariantSpec("ngram (vLLM)", "ngram", depth, config, greedy_only=True))
    return variants


@dataclass(frozen=True)
class VariantSummary:
    """One variant over the timed rounds of one cell (spreads over rounds; ratios taken inside rounds).

    nodes_per_step: draft tokens verified per request and decode step;
    vs_none, vs_chain: tokens/s over no speculation's and over the chain baseline's (vLLM's chain at
    T = 0, width 1 at T > 0); step_ms: medians of the per-round `StepSplit`; stage_ms: medians of
    milliseconds per step by runner stage; bound: the zero-overhead bound over the chain baseline
    (fixed budgets; `stats.zero_overhead_bound`), bound_step_ms its median step; shape_steps: the
    adaptive policy's timed decode steps per shape, all rounds.
    """

    variant: str
    kind: str
    budget: int | None
    tokens_per_second: Spread
    tokens_per_step: Spread
    nodes_per_step: Spread
    vs_none: Spread | None
    vs_chain: Spread | None
    step_ms: StepSplit | None
    stage_ms: dict[str, float] | None
    bound: Spread | None
    bound_step_ms: float | None
    shape_steps: dict[str, int] | None
    acceptance_per_position: list[float]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.step_ms is not None:
            data["step_ms"]["forward_per_row"] = self.step_ms.forward_per_row
        return data


def chain_baseline(temperature: float, runs_by_kind: dict[str, list[TimedRun]]) -> list[TimedRun] | None:
    """The chain baseline's runs: vLLM's DFlash chain at T = 0, DDTree of width 1 at T > 0 (or when the
    chain is missing)."""
    kinds = ("chain", "width1") if temperature == 0 else ("width1",)
    return next((runs_by_kind[k] for k in kinds if k in runs_by_kind), None)


def median_stage_ms(runs: list[TimedRun]) -> dict[str, float] | None:
    """Milliseconds per decode step by runner stage, medians over rounds (None without stage times)."""
    per_round = [r.decode_stage_ms() for r in runs]
    if None in per_round:
        return None
    return {name: spread([ms[name] for ms in per_round]).median for name in STAGES}


def summed_shapes(runs: list[TimedRun]) -> dict[str, int] | None:
    """Steps per shape over all rounds, most used first (None for engines without a budget policy)."""
    if runs[0].shape_steps is None:
        return None
    total: dict[str, int] = {}
    for run in runs:
        for shape, steps in (run.shape_steps or {}).items():
            total[shape] = total.get(shape, 0) + steps
    return {shape: steps for shape, steps in sorted(total.items(), key=lambda kv: -kv[1]) if steps}


def bounds(runs: list[TimedRun], width1: list[TimedRun] | None, chain: list[TimedRun] | None) -> list[Bound] | None:
    """The zero-overhead bound of each round's run, against the same round's width-1 cost per row and
    chain baseline (None when a stage-timed split or a reference is missing)."""
    if width1 is None or chain is None:
        return None
    splits, chain_splits = [r.split() for r in runs], [w.split() for w in width1]
    if None in splits or None in chain_splits:
        return None
    return [
        zero_overhead_bound(s, r.seconds, r.output_tokens, w.forward_per_row, c.tokens_per_second)
        for s, r, w, c in zip(splits, runs, chain_splits, chain)
    ]


def summarize(temperature: float, variants: list[VariantSpec], runs: dict[str, list[TimedRun]]) -> list[VariantSummary]:
    """Summaries of the variants that ran (`runs`: timed runs per variant name, round by round)."""
    present = [v for v in variants if v.name in runs]
    by_kind = {v.kind: runs[v.name] for v in present}
    none, chain, width1 = by_kind.get("none"), chain_baseline(temperature, by_kind), by_kind.get("width1")
    summaries = []
    for v in present:
        mine = runs[v.name]
        tps = [r.tokens_per_second for r in mine]
        splits = [r.split() for r in mine]
        bound = bounds(mine, width1, chain) if v.kind == "fixed" else None
        summaries.append(
            VariantSummary(
                variant=v.name,
                kind=v.kind,
                budget=v.budget,
                tokens_per_second=spread(tps),
                tokens_per_step=spread([r.tokens_per_step for r in mine]),
                nodes_per_step=spread([r.nodes_per_step for r in mine]),
                vs_none=per_round_ratios(tps, [r.tokens_per_second for r in none]) if none else None,
                vs_chain=per_round_ratios(tps, [r.tokens_per_second for r in chain]) if chain else None,
                step_ms=median_split(splits) if None not in splits else None,
                stage_ms=median_stage_ms(mine),
                bound=spread([b.ratio for b in bound]) if bound else None,
                bound_step_ms=spread([b.step for b in bound]).median if bound else None,
                shape_steps=summed_shapes(mine),
                acceptance_per_position=mine[0].acceptance_per_position,
            )
        )
    return summaries


def greedy_mismatches(label: str, rounds: list[dict[str, TimedRun]]) -> list[dict[str, Any]]:
    """Every (variant, round) of greedy rounds whose outputs differ from no speculation's first round."""
    if NO_SPECULATION not in rounds[0]:
        return []
    reference = rounds[0][NO_SPECULATION].token_ids
    mismatches = []
    for k, runs in enumerate(rounds):
        for name, run in runs.items():
            if run.token_ids != reference:
                first = next((i for i, (a, b) in enumerate(zip(reference, run.token_ids)) if a != b), len(reference))
                mismatches.append({"cell": label, "variant": name, "round": k, "first_differing_prompt": first})
    return mismatches


@dataclass(frozen=True)
class Agreement:
    """One variant's greedy output in one round against no speculation's first round, prompt by prompt:
    the tokens equal up to the first divergence (a bf16 run's check, where the tree rows' attention
    rounds differently from a plain step's and a near-tie of the logits may flip; float32 runs are
    checked exactly, `greedy_mismatches`).

    agreed: tokens before each prompt's first divergence, summed over prompts; total: the reference's
    tokens; first_divergence: per prompt, the index of its first differing token (None: identical).
    """

    cell: str
    variant: str
    round: int
    agreed: int
    total: int
    first_divergence: tuple[int | None, ...]

    @property
    def identical_prompts(self) -> int:
        return sum(d is None for d in self.first_divergence)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def greedy_agreement(label: str, rounds: list[dict[str, TimedRun]]) -> list[Agreement]:
    """Every (variant, round) of greedy rounds against no speculation's first round (`Agreement`); no
    speculation's own later rounds included (plain decoding should repeat itself)."""
    if NO_SPECULATION not in rounds[0]:
        return []
    reference = rounds[0][NO_SPECULATION].token_ids
    found = []
    for k, runs in enumerate(rounds):
        for name, run in runs.items():
            if k == 0 and name == NO_SPECULATION:
                continue
            prefixes = [common_prefix(ref, out) for ref, out in zip(reference, run.token_ids)]
            divergence = tuple(None if p == len(ref) == len(out) else p for p, ref, out in zip(prefixes, reference, run.token_ids))
            found.append(Agreement(label, name, k, sum(prefixes), sum(len(r) for r in reference), divergence))
    return found


def format_agreement(agreements: list[Agreement]) -> str:
    """One line per variant: its worst round's agreement with no speculation (tokens before the first
    divergence per prompt, prompts identical), and its rounds' range."""
    lines = []
    for name in dict.fromkeys(a.variant for a in agreements):
        mine = [a for a in agreements if a.variant == name]
        worst = min(mine, key=lambda a: a.agreed / a.total)
        fractions = [a.agreed / a.total for a in mine]
        diverged = [d for d in worst.first_divergence if d is not None]
        where = f"; first divergences at tokens {sorted(diverged)}" if diverged else ""
        lines.append(
            f"{name:<24} {worst.agreed}/{worst.total} tokens ({100 * worst.agreed / worst.total:.1f}%) agree before the"
            f" first divergence, {worst.identical_prompts}/{len(worst.first_divergence)} prompts identical (worst of"
            f" {len(mine)} rounds; range {100 * min(fractions):.1f}-{100 * max(fractions):.1f}%){where}"
        )
    return "\n".join(lines)


def fmt(value: Spread | None, suffix: str = "x") -> str:
    return value.format(2, suffix) if value is not None else "-"


def format_speed_table(summaries: list[VariantSummary]) -> str:
    """Nodes verified and tokens committed per request and decode step, tokens/s and the per-round
    ratios: median [min-max] over rounds (nodes and tokens per step: medians)."""
    header = f"{'variant':<24} {'nodes/step':>10} {'tokens/step':>11} {'tokens/s':>22} {'vs no spec':>19} {'vs chain':>19}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s.variant:<24} {s.nodes_per_step.median:>10.1f} {s.tokens_per_step.median:>11.2f} {s.tokens_per_second.format(1):>22}"
            f" {fmt(s.vs_none):>19} {fmt(s.vs_chain):>19}"
        )
    return "\n".join(lines)


def format_stage_table(summaries: list[VariantSummary]) -> str:
    """Milliseconds per engine step by runner stage and outside the runner, for stage-timed variants."""
    staged = [s for s in summaries if s.stage_ms and s.step_ms]
    if not staged:
        return ""
    widths = [max(7, len(n)) for n in STAGES]
    header = (
        f"{'variant':<24} " + " ".join(f"{n:>{w}}" for n, w in zip(STAGES, widths))
        + f" {'outside':>7} {'step':>6} {'own':>6} {'rows/step':>9} {'ms/row':>7}"
    )
    lines = [
        "ms per decode step, medians over rounds (own: top-k + tree build + acceptance + kv compaction, % of step;"
        " outside: the engine step beyond the model runner)",
        header,
        "-" * len(header),
    ]
    for s in staged:
        st, sp = s.stage_ms, s.step_ms
        lines.append(
            f"{s.variant:<24} " + " ".join(f"{st[n]:>{w}.2f}" for n, w in zip(STAGES, widths))
            + f" {sp.outside:>7.2f} {sp.wall:>6.2f} {100 * sp.own / sp.wall:>5.1f}% {sp.rows:>9.1f} {sp.forward_per_row:>7.4f}"
        )
    return "\n".join(lines)


def describe_split(split: StepSplit) -> str:
    return (
        f"step {split.wall:.2f} ms = draft {split.draft:.2f} + own {split.own:.2f} + target forward {split.forward:.2f}"
        f" + rest {split.rest:.2f} + outside {split.outside:.2f}; {split.rows:.1f} rows/step,"
        f" {split.forward_per_row:.4f} ms/row"
    )


def format_bound(summaries: list[VariantSummary]) -> str:
    """The zero-overhead bound of the fixed budget with the best one, with its parts."""
    bounded = [s for s in summaries if s.bound is not None]
    width1 = next((s for s in summaries if s.kind == "width1" and s.step_ms), None)
    if not bounded or width1 is None:
        return ""
    best = max(bounded, key=lambda s: s.bound.median)
    tree, chain = best.step_ms, width1.step_ms
    return "\n".join(
        [
            f"zero-overhead bound (DDTree's own stages free, target forward at the chain's cost per row): {best.variant}"
            f" would be {best.bound.format(2, 'x')} the chain baseline's tokens/s (measured {fmt(best.vs_chain)})",
            f"  chain (width 1): {describe_split(chain)}",
            f"  tree ({best.variant}): {describe_split(tree)}, {tree.forward_per_row / chain.forward_per_row:.2f}x the chain's per row",
            f"  bound step = {tree.wall:.2f} - own {tree.own:.2f} - forward {tree.forward:.2f} + {chain.forward_per_row:.4f} ms/row"
            f" x {tree.rows:.1f} rows = {best.bound_step_ms:.2f} ms; tokens/step {best.tokens_per_step.median:.2f}"
            f" (width 1: {width1.tokens_per_step.median:.2f})",
            "  bound per budget: " + ", ".join(f"{s.budget}: {s.bound.format(2, 'x')}" for s in bounded),
        ]
    )


def format_shapes(summaries: list[VariantSummary]) -> str:
    """The adaptive policy's timed decode steps per shape."""
    return "\n".join(
        f"{s.variant}: decode steps timed per shape: " + ", ".join(f"{shape} {steps}" for shape, steps in s.shape_steps.items())
        for s in summaries
        if s.shape_steps
    )
