"""Side-by-side benchmark of DDTree against no speculation and a chain draft, over a configuration matrix.

What is measured: for every (batch size, temperature) and every variant — no speculation, the chain
baseline, DDTree at each budget — the same `--prompts` prompts (16), served `batch` at a time by
consecutive timed `LLM.generate` calls (batch 1: 16 calls of one prompt), `max_tokens` new tokens each
(ignore_eos), repeated `--repeats` times; every batch size thus sees the same text, and the table
reports medians over repeats of

* tokens per step: 1 + accepted draft tokens / decode steps, from vLLM's own spec-decode counters
  read before and after the timed generation (`tokens_per_decode_step`; 1 without speculation);
* output tokens/s: generated tokens / wall-clock seconds of the timed generation;
* speedup: tokens/s over no speculation and over the chain, at the same (batch, temperature);
* for DDTree engines, milliseconds per engine step by stage (`vllm_ddtree.vllm.stage_times`: draft
  forward, top-k, tree build + verify inputs, target forward, acceptance, KV compaction, rest) and
  DDTree's own overhead = (top-k + tree build + verify inputs + acceptance + KV compaction) / step time.

How: one in-process CPU engine per variant (engines are the expensive part), warmed up once, then
timed on every (temperature, batch, repeat) it serves. The chain baseline is vLLM's DFlash chain
(`num_speculative_tokens = block_size - 1`) at T=0; at T>0 it is DDTree of width 1 (`ddtree_topk=1`, the
chain's shape), because stock dflash's CPU sampler is biased at T>0. Width 1 also runs at T=0, where
it must match the chain's tokens per step at (almost) its step time. At T>0 each prompt gets its own seeded
SamplingParams. At T=0 every variant's outputs are compared with no speculation (DDTree is lossless);
mismatches are recorded in the JSON and printed, not raised. n-gram is not run: once an n-gram engine
has run, vLLM 0.32 cannot start another engine in the process.

The pair is the demo's: the embedded trained pair with held-out code prompts (text).

    python benchmarks/bench.py [--quick] [--batches 1 4 16] [--budgets 8 16 32 64 128] [--temperatures 0 1]
                               [--prompts 16] [--max-tokens 64] [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_ddtree.demo.side_by_side import (
    ENGINE_DEFAULTS,
    configure_cpu_environment,
    read_spec_counters,
    shutdown,
    tokens_per_decode_step,
)
from vllm_ddtree.vllm.stage_times import ACCEPTANCE, DRAFT_TOPK, KV_COMPACTION, TREE_BUILD
from vllm_ddtree.vllm.stage_times import ENV_FLAG as STAGE_TIMES_FLAG

MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class BenchVariant:
    """One engine: `kind` is "none", "chain", "width1", "ddtree" or "adaptive"; `temperatures` are the
    ones it is timed at."""

    name: str
    kind: str
    budget: int | None
    speculative_config: dict[str, Any] | None
    temperatures: tuple[float, ...]


@dataclass
class Measurement:
    """Medians over repeats of one variant at one (batch, temperature)."""

    variant: str
    kind: str
    budget: int | None
    batch: int
    temperature: float
    repeats: int
    tokens_per_step: float
    tokens_per_second: float
    seconds: list[float]
    acceptance_per_position: list[float]
    speedup_vs_none: float | None = None
    speedup_vs_chain: float | None = None
    stage_ms_per_step: dict[str, float] | None = None
    token_ids: list[list[int]] = field(default_factory=list, repr=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts served at every batch size")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--quick", action="store_true", help="batches 1 4, budgets 8 32, T 0, repeats 1, 4 prompts, max_tokens 32")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.budgets, args.temperatures, args.repeats, args.max_tokens = [1, 4], [8, 32], [0.0], 1, 32
        args.prompts = 4
    return args


def machine_info() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def select_pair(num_prompts: int) -> tuple[str, str, list[str]]:
    """(target, draft, held-out text prompts) of the embedded pair, as `make demo` uses it."""
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts

    target, draft = demo_pair_paths()
    return target, draft, heldout_prompts(num_prompts, 64, as_text=True)


def build_variants(draft: str, budgets: list[int], temperatures: list[float]) -> list[BenchVariant]:
    """No speculation; vLLM's DFlash chain (T=0 only); DDTree of width 1 (top-1 at every depth, budget
    block_size - 1: the chain's shape under our exact sampler, the chain baseline at T>0); DDTree budgets;
    DDTree with the adaptive budget capped at the largest budget."""
    with open(os.path.join(draft, "config.json")) as f:
        chain_length = json.load(f)["block_size"] - 1
    all_t = tuple(temperatures)
    greedy = tuple(t for t in temperatures if t == 0)
    variants = [BenchVariant("no speculation", "none", None, None, all_t)]
    if greedy:
        config = {"method": "dflash", "model": draft, "num_speculative_tokens": chain_length}
        variants.append(BenchVariant("dflash chain (vLLM)", "chain", None, config, greedy))
    config = {"method": "ddtree", "model": draft, "num_speculative_tokens": chain_length, "ddtree_topk": 1}
    variants.append(BenchVariant("ddtree width 1", "width1", chain_length, config, all_t))
    for b in budgets:
        config = {"method": "ddtree", "model": draft, "num_speculative_tokens": b}
        variants.append(BenchVariant(f"ddtree budget {b}", "ddtree", b, config, all_t))
    cap = max(budgets)
    config = {"method": "ddtree", "model": draft, "num_speculative_tokens": cap, "ddtree_adaptive": True}
    variants.append(BenchVariant(f"ddtree adaptive <={cap}", "adaptive", cap, config, all_t))
    return variants


def sampling_for(prompt_indices: range, temperature: float, max_tokens: int) -> Any:
    """One greedy SamplingParams at T=0; at T>0 one SamplingParams per prompt, seeded by its index."""
    from vllm import SamplingParams

    if temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True) for i in prompt_indices]


@dataclass
class TimedRun:
    seconds: float
    tokens_per_step: float
    tokens_per_second: float
    acceptance_per_position: list[float]
    token_ids: list[list[int]]
    stage_ms_per_step: dict[str, float] | None


def stage_timer(llm: Any) -> Any:
    """The DDTree runner's StageTimes (None for other methods)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return getattr(runner, "stage_times", None)


def timed_generate(llm: Any, prompts: list[Any], batch: int, temperature: float, max_tokens: int) -> TimedRun:
    """All `prompts`, `batch` per `LLM.generate` call; seconds are the calls' summed wall time."""
    timer = stage_timer(llm)
    if timer is not None:
        timer.reset()
    before = read_spec_counters(llm)
    seconds, token_ids = 0.0, []
    for first in range(0, len(prompts), batch):
        group = range(first, min(first + batch, len(prompts)))
        sampling = sampling_for(group, temperature, max_tokens)
        start = time.perf_counter()
        outputs = llm.generate(prompts[group.start : group.stop], sampling, use_tqdm=False)
        seconds += time.perf_counter() - start
        token_ids += [list(o.outputs[0].token_ids) for o in outputs]
    c = read_spec_counters(llm) - before
    stages = None
    if timer is not None and timer.enabled:
        snapshot = timer.snapshot()
        steps = max(1.0, snapshot.pop("steps"))
        stages = {name: 1000 * value / steps for name, value in snapshot.items()}
    return TimedRun(
        seconds=seconds,
        tokens_per_step=tokens_per_decode_step(c, sum(map(len, token_ids)), len(token_ids)),
        tokens_per_second=sum(map(len, token_ids)) / seconds,
        acceptance_per_position=[a / c.drafts for a in c.accepted_per_position] if c.drafts else [],
        token_ids=token_ids,
        stage_ms_per_step=stages,
    )


def median_stages(runs: list[TimedRun]) -> dict[str, float] | None:
    if runs[0].stage_ms_per_step is None:
        return None
    return {name: statistics.median(r.stage_ms_per_step[name] for r in runs) for name in runs[0].stage_ms_per_step}


def measure_variant(
    target: str, variant: BenchVariant, prompts: list[Any], args: argparse.Namespace
) -> list[Measurement]:
    """One engine for the variant: warm-up, then every (temperature, batch, repeat) it serves."""
    from vllm import LLM

    kwargs = {**ENGINE_DEFAULTS, "max_model_len": MAX_MODEL_LEN}
    llm = LLM(model=target, speculative_config=variant.speculative_config, **kwargs)
    results = []
    try:
        llm.generate(prompts[:1], sampling_for(range(1), 0.0, args.max_tokens), use_tqdm=False)
        for temperature in variant.temperatures:
            for batch in args.batches:
                runs = [timed_generate(llm, prompts, batch, temperature, args.max_tokens) for _ in range(args.repeats)]
                results.append(
                    Measurement(
                        variant=variant.name,
                        kind=variant.kind,
                        budget=variant.budget,
                        batch=batch,
                        temperature=temperature,
                        repeats=args.repeats,
                        tokens_per_step=statistics.median(r.tokens_per_step for r in runs),
                        tokens_per_second=statistics.median(r.tokens_per_second for r in runs),
                        seconds=[r.seconds for r in runs],
                        acceptance_per_position=runs[0].acceptance_per_position,
                        stage_ms_per_step=median_stages(runs),
                        token_ids=runs[0].token_ids,
                    )
                )
    finally:
        shutdown(llm)
    return results


def add_speedups(results: list[Measurement]) -> None:
    for m in results:
        cell = [r for r in results if (r.batch, r.temperature) == (m.batch, m.temperature)]
        none = next((r for r in cell if r.kind == "none"), None)
        chain = next((r for r in cell if r.kind == "chain"), None) or next((r for r in cell if r.kind == "width1"), None)
        m.speedup_vs_none = m.tokens_per_second / none.tokens_per_second if none else None
        m.speedup_vs_chain = m.tokens_per_second / chain.tokens_per_second if chain else None


def greedy_mismatches(results: list[Measurement]) -> list[dict[str, Any]]:
    """Every T=0 (variant, batch) whose outputs differ from no speculation's, with the first differing prompt."""
    mismatches = []
    for m in results:
        if m.temperature != 0 or m.kind == "none":
            continue
        ref = next((r for r in results if r.kind == "none" and r.temperature == 0 and r.batch == m.batch), None)
        if ref is None or ref.token_ids == m.token_ids:
            continue
        first = next(i for i, (a, b) in enumerate(zip(ref.token_ids, m.token_ids)) if a != b)
        mismatches.append({"variant": m.variant, "batch": m.batch, "first_differing_prompt": first})
    return mismatches


def target_checks(results: list[Measurement]) -> list[str]:
    """The issue's targets, one line each, for every (batch, T) cell that has the variants involved."""
    lines = []
    for batch, temperature in sorted({(m.batch, m.temperature) for m in results}):
        cell = [m for m in results if (m.batch, m.temperature) == (batch, temperature)]
        tag = f"batch {batch:>2} T={temperature:g}:"
        fixed = [m for m in cell if m.kind == "ddtree"]
        chain = next((m for m in cell if m.kind == "chain"), None)
        width1 = next((m for m in cell if m.kind == "width1"), None)
        adaptive = next((m for m in cell if m.kind == "adaptive"), None)
        if chain is not None and width1 is not None and chain is not width1:
            lines.append(
                f"{tag} width-1 step time / chain step time = "
                f"{(chain.tokens_per_second / chain.tokens_per_step) / (width1.tokens_per_second / width1.tokens_per_step):.3f}"
                f" (tokens/step {width1.tokens_per_step:.3f} vs {chain.tokens_per_step:.3f})"
            )
        if fixed:
            best = max(fixed, key=lambda m: m.tokens_per_second)
            lines.append(f"{tag} best fixed budget {best.budget}: {fmt_speedup(best.speedup_vs_chain)} the chain's tokens/s")
            timed = [m for m in fixed if m.stage_ms_per_step and m.speedup_vs_chain is not None]
            if timed:  # what the tree shapes would give if DDTree's own stages cost nothing
                bound = max(timed, key=lambda m: m.speedup_vs_chain / (1 - overhead_fraction(m.stage_ms_per_step)))
                lines.append(
                    f"{tag} with DDTree's own stages at zero cost, best budget {bound.budget} would be "
                    f"{bound.speedup_vs_chain / (1 - overhead_fraction(bound.stage_ms_per_step)):.2f}x the chain's tokens/s"
                )
            if adaptive is not None:
                lines.append(f"{tag} adaptive / best fixed tokens/s = {adaptive.tokens_per_second / best.tokens_per_second:.3f}")
                if width1 is not None:  # the chain shape is one of the adaptive budget's candidates too
                    best_shape = max(fixed + [width1], key=lambda m: m.tokens_per_second)
                    lines.append(
                        f"{tag} adaptive / best fixed shape ({best_shape.variant}) tokens/s = "
                        f"{adaptive.tokens_per_second / best_shape.tokens_per_second:.3f}"
                    )
        for m in fixed:
            if m.stage_ms_per_step:
                lines.append(f"{tag} budget {m.budget}: DDTree overhead {100 * overhead_fraction(m.stage_ms_per_step):.1f}% of step time")
    return lines


def fmt_speedup(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_table(results: list[Measurement]) -> str:
    header = f"{'batch':>5} {'T':>4} {'variant':<22} {'tokens/step':>11} {'tokens/s':>9} {'vs none':>8} {'vs chain':>8}"
    lines = [header, "-" * len(header)]
    for m in sorted(results, key=lambda r: (r.temperature, r.batch)):
        lines.append(
            f"{m.batch:>5} {m.temperature:>4g} {m.variant:<22} {m.tokens_per_step:>11.2f} {m.tokens_per_second:>9.1f}"
            f" {fmt_speedup(m.speedup_vs_none):>8} {fmt_speedup(m.speedup_vs_chain):>8}"
        )
    return "\n".join(lines)


OVERHEAD_STAGES = (DRAFT_TOPK, TREE_BUILD, ACCEPTANCE, KV_COMPACTION)


def overhead_fraction(stages: dict[str, float]) -> float:
    """DDTree's own work per step over the step's wall time."""
    return sum(stages[name] for name in OVERHEAD_STAGES) / sum(stages.values())


def format_stage_table(results: list[Measurement]) -> str:
    staged = [m for m in results if m.stage_ms_per_step]
    if not staged:
        return ""
    names = list(staged[0].stage_ms_per_step)
    widths = [max(8, len(n)) for n in names]
    header = f"{'batch':>5} {'T':>4} {'variant':<22} " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths)) + f" {'step ms':>8} {'overhead':>8}"
    lines = ["milliseconds per engine step by stage (medians over repeats)", header, "-" * len(header)]
    for m in sorted(staged, key=lambda r: (r.temperature, r.batch, r.budget or 0)):
        st = m.stage_ms_per_step
        lines.append(
            f"{m.batch:>5} {m.temperature:>4g} {m.variant:<22} " + " ".join(f"{st[n]:>{w}.2f}" for n, w in zip(names, widths))
            + f" {sum(st.values()):>8.2f} {100 * overhead_fraction(st):>7.1f}%"
        )
    return "\n".join(lines)


def plot_stages(results: list[Measurement], path: str) -> None:
    """Stacked bars: milliseconds per step by stage for every DDTree engine and (batch, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    staged = sorted((m for m in results if m.stage_ms_per_step), key=lambda r: (r.temperature, r.batch, r.budget or 0))
    if not staged:
        return
    names = list(staged[0].stage_ms_per_step)
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(staged)), 5))
    bottoms = [0.0] * len(staged)
    for i, name in enumerate(names):
        heights = [m.stage_ms_per_step[name] for m in staged]
        ax.bar(range(len(staged)), heights, bottom=bottoms, color=f"C{i}", label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    short = {"width1": "w1", "adaptive": "auto"}
    labels = [f"{short.get(m.kind, m.budget)} b{m.batch} T{m.temperature:g}" for m in staged]
    ax.set_xticks(range(len(staged)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ms per engine step")
    ax.set_title("DDTree step time by stage (budget, batch, temperature)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: list[Measurement], metric: str, ylabel: str, path: str) -> None:
    """`metric` vs DDTree budget, one line per (batch, T); chain (dashed) and no speculation (dotted) as references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cells = sorted({(m.batch, m.temperature) for m in results})
    for i, (batch, temperature) in enumerate(cells):
        color = f"C{i % 10}"
        cell = [m for m in results if (m.batch, m.temperature) == (batch, temperature)]
        tree = sorted((m for m in cell if m.kind == "ddtree"), key=lambda m: m.budget or 0)
        if tree:
            ax.plot([m.budget for m in tree], [getattr(m, metric) for m in tree], "o-", color=color, label=f"ddtree, batch {batch}, T={temperature:g}")
        for kind, style in (("chain", "--"), ("none", ":"), ("adaptive", "-.")):
            ref = next((m for m in cell if m.kind == kind), None)
            if ref is not None:
                ax.axhline(getattr(ref, metric), linestyle=style, color=color, alpha=0.7, label=f"{ref.variant}, batch {batch}, T={temperature:g}")
    ax.set_xscale("log", base=2)
    budgets = sorted({m.budget for m in results if m.budget is not None})
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    ax.set_xlabel("DDTree budget (draft tokens per tree)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: str, report: dict[str, Any], results: list[Measurement]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "bench-" + time.strftime("%Y%m%d-%H%M%S"))
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    plot(results, "tokens_per_step", "tokens per step", stem + "-tokens_per_step.png")
    plot(results, "tokens_per_second", "output tokens/s", stem + "-tokens_per_second.png")
    plot_stages(results, stem + "-stages.png")
    return [stem + ".json", stem + "-tokens_per_step.png", stem + "-tokens_per_second.png", stem + "-stages.png"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table is the output
    configure_cpu_environment()
    os.environ[STAGE_TIMES_FLAG] = "1"  # DDTree engines time their stages (a few perf_counter calls per step)
    machine = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)

    results: list[Measurement] = []
    errors: list[dict[str, str]] = []
    target, draft, prompts = select_pair(args.prompts)
    print(f"target {target}\ndraft  {draft}", flush=True)
    for variant in build_variants(draft, args.budgets, args.temperatures):
        start = time.perf_counter()
        try:
            results.extend(measure_variant(target, variant, prompts, args))
        except Exception as exc:  # noqa: BLE001 - one broken variant must not lose the others' numbers
            errors.append({"variant": variant.name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  FAILED: {variant.name}: {errors[-1]['error']}", file=sys.stderr, flush=True)
            continue
        print(f"  done: {variant.name} ({time.perf_counter() - start:.1f} s)", flush=True)

    add_speedups(results)
    mismatches = greedy_mismatches(results)
    print("\n" + format_table(results))
    print("\n" + format_stage_table(results))
    checks = target_checks(results)
    print("\n" + "\n".join(checks))
    if mismatches:
        print(f"\nMISMATCH: greedy output differs from no speculation: {mismatches}", file=sys.stderr)
    elif any(m.temperature == 0 for m in results):
        print("\ngreedy outputs identical to no speculation for every variant and batch")

    report = {
        "machine": machine,
        "args": vars(args),
        "pair": {"target": target, "draft": draft},
        "measurements": [{k: v for k, v in asdict(m).items() if k != "token_ids"} for m in results],
        "greedy_mismatches": mismatches,
        "target_checks": checks,
        "errors": errors,
    }
    for path in write_outputs(args.out, report, results):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
