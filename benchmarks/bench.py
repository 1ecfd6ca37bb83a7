"""Interleaved benchmark of DDTree against no speculation and the DFlash chain, over a matrix of cells.

Cells: batch size x temperature x context. Contexts: "short", the held-out code prompts of 64 tokens;
"2k", held-out snippets concatenated (`engines.context_prompts`) to 2048 - max_tokens - twice the
largest budget tokens (1856 by default), so that prompt, output and the trees fit in the pair's 2048
positions (`prompt_tokens`). The pair was trained on 512-token sequences: in 2k cells it is far outside
its range and accepts few drafts (measured: 1.07 tokens per step for the chain at batch 1, T = 0). Every
cell serves the same `--prompts` prompts, `batch` per `LLM.generate` call (batch 1: one call per
prompt), `--max-tokens` new tokens each (ignore_eos); at T > 0 prompt i is seeded with 1000 + i, or
unseeded with `--unseeded` (as most users send requests: DDTree's steps without drafts are then drawn
by vLLM's own sampler, seeded requests' by DDTree's exact rule, keyed by position).

Variants (`summary.build_variants`): no speculation; vLLM's DFlash chain (num_speculative_tokens =
block_size - 1; T = 0 only, since vLLM's CPU rejection sampler is biased at T > 0); DDTree of width 1
(`ddtree_topk: 1`: the chain's shape under DDTree's exact sampler, the chain baseline at T > 0 and the
stage-timed chain of the zero-overhead bound); DDTree at fixed budgets (`ddtree_adaptive: false`);
DDTree's default configuration (only `num_speculative_tokens` = `--default-budget`: adaptive). vLLM's
n-gram is not run (see `python -m vllm_ddtree.demo --help`). `--control` adds a second engine without
speculation: two identical engines should measure 1.00x; what they measure instead is the resolution
of every other ratio of the run.

How (`vllm_ddtree.demo.engines`): one engine per variant, each in its own vLLM engine-core process, all
alive at once. Per cell, `--warmup-rounds` untimed rounds (they also fill the prefix cache: in 2k cells
the timed rounds prefill only each prompt's last partial KV block, so they time decoding after a 2k
context), then `--rounds` timed rounds; each round times every variant once on the cell's work, in an
order rotated by one place per round (the rotation continues across cells), call by call: at least
`--min-calls` `LLM.generate` calls per variant (a cell whose prompts fit in fewer, batch 16 with 8
prompts: one call of ~1 s, serves them again), so that no round's ratio rests on one short call.
Before each timed pass the engine serves the same prompts with max_tokens 1; the difference is the
decode steps alone.

Reported per cell and variant (`vllm_ddtree.demo.stats`, `vllm_ddtree.demo.summary`), as median
[min-max] over timed rounds:
* output tokens/s: tokens over the summed wall time of the generate calls;
* tree nodes verified and tokens committed per request and decode step, from the engine's own
  spec-decode stats (tokens: 1 + accepted / decode steps);
* tokens/s over no speculation's and over the chain baseline's (vLLM's chain at T = 0, width 1 at
  T > 0), each ratio taken inside a round, never as a ratio of medians;
* for DDTree engines of a fixed shape, milliseconds per decode step by runner stage
  (VLLM_DDTREE_STAGE_TIMES=1) and outside the runner, target-forward rows per step and milliseconds per
  row (the default config's engine runs without the stage timer, as users run it: the timer costs about
  1% of a batch-1 step, `demo.engines.stage_timed`);
* for fixed budgets, the zero-overhead bound (`stats.zero_overhead_bound`): tokens/s with DDTree's own
  stages free and the target forward at the width-1 chain's cost per row of the same round, over the
  chain baseline's tokens/s; printed with its parts for the best budget;
* for the default configuration, the decode steps its adaptive policy timed per tree shape.
At T = 0 every variant's output in every round, warm-up included, is compared with no speculation's
(DDTree is lossless): in float32 exactly, mismatches printed, recorded in the JSON and making the exit
status 1. In bfloat16 the tree rows' attention rounds differently from a plain step's, so a near-tie of
the logits may flip and greedy outputs part there: the check states agreement instead (per prompt, the
tokens equal up to the first divergence; `summary.greedy_agreement`), printed and recorded, not failed.

Pairs (`--pair`): "embedded", the shipped 27 MB pair (the default, float32); "0.6b" and "1.7b", the same
pair widened to Qwen3-0.6B/1.7B cost computing the same function (`vllm_ddtree.demo.widen_pair`, built
into ~/.cache/vllm_ddtree/pairs/<size> on first use, ~8 s and 1.6 GB for 0.6b). `--dtype` sets every
engine's dtype (default: float32 on CPU, the checkpoint's on a GPU). `--realistic` presets the
realistic-cost matrix (`REALISTIC`: the 0.6b pair in bfloat16, batches 1 4 16 x T 0 1, short context,
budgets 8 16, the control engine, unseeded, 8 prompts); arguments given beside it override the preset.
A widened pair's KV cache is sized from its layers, heads and dtype (`kv_cache_bytes`).

    python benchmarks/bench.py [--quick | --realistic] [--pair embedded|0.6b|1.7b] [--dtype float32|bfloat16]
        [--batches 1 4 16] [--temperatures 0 1] [--contexts short 2k]
        [--budgets 8 16 32 64] [--default-budget 32] [--prompts 16] [--max-tokens 64] [--rounds 3]
        [--warmup-rounds 1] [--out benchmarks/results] [--target T --draft D] [--tensor-parallel-size N]

On a GPU machine with vLLM 0.32 and real checkpoints, the same table, JSON and plots:
    python benchmarks/bench.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --tensor-parallel-size 1
(prompts: the same held-out code as text, tokenized by the target's tokenizer; every variant's engine
alive at once on the same GPUs, each with an equal share of their memory, CUDA graphs on).

Output: tables on stdout; under --out, bench-<time>.json, three PNG plots (tokens/s over the chain per
cell, tokens per step vs budget, decode-step breakdown) and bench-<time>.log (vLLM's own output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from vllm_ddtree.demo.engines import ENGINE_KWARGS, Engine, TimedRun, Work, configure_environment, context_prompts, run_round
from vllm_ddtree.demo.engines import shutdown_all, start_engines
from vllm_ddtree.demo.quiet import quiet_run
from vllm_ddtree.demo.summary import VariantSummary, build_variants, format_bound, format_shapes
from vllm_ddtree.demo.summary import Agreement, format_agreement, format_speed_table, format_stage_table, greedy_agreement
from vllm_ddtree.demo.summary import greedy_mismatches, summarize

SHORT_PROMPT_TOKENS = 64
MAX_POSITIONS = 2048  # the pair's max_position_embeddings
KV_CACHE_BYTES = {"short": 64 * 2**20, "2k": 320 * 2**20}  # 2k: 16 prompts of 2k cached, their outputs and trees
PAIRS = ("embedded", "0.6b", "1.7b")
REALISTIC: dict[str, Any] = {
    "pair": "0.6b", "dtype": "bfloat16", "batches": [1, 4, 16], "temperatures": [0.0, 1.0], "contexts": ["short"],
    "budgets": [8, 16], "control": True, "unseeded": True, "prompts": 8, "max_tokens": 64,
}
"""`--realistic`: the realistic-cost matrix (issue 46): the 0.6b widened pair in bf16, where a verify of 9-17
rows costs about one plain step (the memory-bound regime trees are for), every batch and temperature."""


@dataclass(frozen=True)
class Cell:
    batch: int
    temperature: float
    context: str

    @property
    def label(self) -> str:
        return f"batch {self.batch}, T={self.temperature:g}, {self.context} context"


Measured = list[tuple[Cell, list[VariantSummary]]]
"""Each measured cell with its variants' summaries."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--contexts", nargs="+", choices=("short", "2k"), default=["short", "2k"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64], help="fixed DDTree budgets")
    parser.add_argument("--default-budget", type=int, default=32, help="num_speculative_tokens of the default (adaptive) config")
    parser.add_argument("--prompts", type=int, default=16, help="prompts served in every cell")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per cell")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds per cell before the timed ones")
    parser.add_argument("--min-calls", type=int, default=3,
                        help="LLM.generate calls per variant per round at least: a cell whose prompts fit in fewer calls serves them repeatedly")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--target", help="target checkpoint (default: the shipped pair's); give --draft with it")
    parser.add_argument("--draft", help="its DFlash draft checkpoint")
    parser.add_argument("--pair", choices=PAIRS, default="embedded",
                        help="the shipped pair, or it widened to Qwen3-0.6B/1.7B cost (same function; built on first use)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="every engine's dtype (default: float32 on CPU, the checkpoint's on a GPU)")
    parser.add_argument("--realistic", action="store_true",
                        help="preset: the 0.6b pair in bfloat16, batches 1 4 16, T 0 1, short, budgets 8 16, control, unseeded, 8 prompts")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor parallelism of every engine (GPU)")
    parser.add_argument(
        "--control", action="store_true",
        help="a second engine without speculation: its ratio to the first shows how far two identical engines differ within a run",
    )
    parser.add_argument(
        "--unseeded", action="store_true",
        help="requests at T > 0 without seeds (default: prompt i seeded with 1000 + i, the same draws every round)",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="batches 1 4, T 0, short context, budget 8 (the default covers larger trees), 4 prompts, 32 tokens, 2 rounds, 1 call per round at least",
    )
    args = parser.parse_args(argv)
    if args.realistic:  # the preset as defaults: what the command line gives beside it wins
        parser.set_defaults(**REALISTIC)
        args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    if args.target is not None and args.pair != "embedded":
        parser.error("--pair selects a shipped pair: leave it out with --target/--draft")
    if args.quick and args.realistic:
        parser.error("--quick and --realistic are two presets: pick one")
    if args.min_calls < 1:
        parser.error("--min-calls must be at least 1")
    if args.quick:
        # Five engines: their start-ups (10-17 s each on 2 cores) are most of the run's two minutes.
        args.batches, args.temperatures, args.contexts, args.budgets = [1, 4], [0.0], ["short"], [8]
        args.prompts, args.max_tokens, args.rounds, args.min_calls = 4, 32, 2, 1
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
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg(),
    }


def cells_of(args: argparse.Namespace) -> list[Cell]:
    """Every selected (context, temperature, batch), in that nesting order."""
    return [Cell(b, t, c) for c in args.contexts for t in args.temperatures for b in args.batches]


def prompt_tokens(context: str, max_tokens: int, largest_budget: int) -> int:
    """64 tokens in the short context; in the 2k context the longest prompt that leaves room, within the
    pair's 2048 positions, for the output and two of the largest trees past its last token. (A request
    near max_model_len gets fewer drafts: with 1920-token prompts, 64 new tokens and max_model_len 2048,
    budget 64 verified 32.6 nodes per decode step on average, with 1856-token prompts all 64.)"""
    return SHORT_PROMPT_TOKENS if context == "short" else MAX_POSITIONS - max_tokens - 2 * largest_budget


def kv_bytes_per_token(model_dirs: list[str], dtype: str) -> int:
    """K and V bytes of one token over every layer of the models (target and draft) in `dtype`."""
    total = 0
    for model_dir in model_dirs:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        total += 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
    return total * {"float32": 4, "bfloat16": 2}[dtype]


CPU_BLOCK_TOKENS = 128
"""vLLM's KV block on a CPU (its default block_size there): a sequence holds whole blocks."""


def kv_cache_bytes(pair: str, model_dirs: list[str], dtype: str, sequences: int, tokens: int, max_model_len: int) -> int:
    """The embedded pair: 0, i.e. `KV_CACHE_BYTES` of the largest context (unchanged, float32). A widened
    pair (its KV per token 10-20x the embedded pair's): `sequences` sequences of `tokens` each, each in
    whole blocks, and at least one of `max_model_len` (vLLM refuses to start otherwise), a quarter more
    for the prefix cache, in whole MiB. Whole blocks, because a cache sized by tokens alone runs short of
    blocks in the speculative engines (their draft layers share the cache), which then preempt and
    recompute requests where no speculation does not: the comparison would measure the cache."""
    if pair == "embedded":
        return 0
    per_sequence = -(-tokens // CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS
    need = 1.25 * max(sequences * per_sequence, max_model_len) * kv_bytes_per_token(model_dirs, dtype)
    return int(-(-need // 2**20)) * 2**20


def engine_kwargs(
    contexts: list[str], max_tokens: int, largest_budget: int, num_engines: int, tensor_parallel_size: int,
    dtype: str | None = None, kv_bytes: int = 0,
) -> dict[str, Any]:
    """Engine settings: max_model_len for the longest prompt, its output and two trees. On CPU: the pair's
    settings (`ENGINE_KWARGS`, float32 unless `dtype`) and a KV cache for the largest context (`kv_bytes`
    where given). On a CUDA GPU: the checkpoint's dtype unless `dtype`, CUDA graphs (vLLM's default),
    vLLM's multiprocess executor for tensor parallelism, and each of the `num_engines` engines alive at
    once on the same GPUs given an equal share of their memory."""
    from vllm.platforms import current_platform

    longest = max(prompt_tokens(c, max_tokens, largest_budget) for c in contexts)
    max_model_len = max(1024, longest + max_tokens + 2 * largest_budget)
    chosen = {"dtype": dtype} if dtype else {}
    if current_platform.is_cuda():
        return {"tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": 0.9 / num_engines,
                "max_model_len": max_model_len, "disable_log_stats": False, "seed": 0, **chosen}
    if tensor_parallel_size != 1:
        raise SystemExit("--tensor-parallel-size is for GPUs: the CPU benchmark runs each engine on one core")
    kv = kv_bytes or max(KV_CACHE_BYTES[c] for c in contexts)
    return {**ENGINE_KWARGS, **chosen, "max_model_len": max_model_len, "kv_cache_memory_bytes": kv}


def pair_paths(args: argparse.Namespace) -> tuple[str, str]:
    """(target, draft): --target/--draft, else `shipped_pair_paths(--pair)`."""
    if args.target:
        return args.target, args.draft
    return shipped_pair_paths(args.pair)


def shipped_pair_paths(pair: str) -> tuple[str, str]:
    """(target, draft) of the shipped pair ("embedded"), or of it widened to `pair` (built on first use)."""
    if pair == "embedded":
        from vllm_ddtree.demo import demo_pair_paths

        return demo_pair_paths()
    from vllm_ddtree.demo.widen_pair import widened_pair_paths

    return widened_pair_paths(pair)


def exact_greedy_check(dtype: str | None) -> bool:
    """Whether greedy outputs must equal no speculation's token for token: yes but in bfloat16, where the
    check states agreement (`summary.greedy_agreement`)."""
    return dtype != "bfloat16"


def measure_cell(
    engines: list[Engine], work: Work, rounds: int, warmup_rounds: int, shift: int
) -> tuple[dict[str, list[TimedRun]], list[dict[str, TimedRun]]]:
    """`warmup_rounds` untimed rounds, then `rounds` timed ones; round k runs the engines rotated by
    `shift` + k. Returns the timed runs per variant (round by round) and every round, warm-up
    included (for the identity check)."""
    every = [run_round(engines, work, shift + k) for k in range(warmup_rounds + rounds)]
    timed = every[warmup_rounds:]
    return {e.name: [r[e.name] for r in timed] for e in engines}, every


def format_matrix(cells: Measured) -> str:
    """Median tokens/s over the chain baseline's, per cell and variant (the README table)."""
    names = list(dict.fromkeys(s.variant for _, summaries in cells for s in summaries))
    short = [n.replace("ddtree ", "").replace(" (vLLM)", "") for n in names]
    lines = ["| batch | T | context | " + " | ".join(short) + " |", "|---|---|---|" + "---|" * len(names)]
    for cell, summaries in cells:
        by_name = {s.variant: s for s in summaries}
        values = [f"{by_name[n].vs_chain.median:.2f}" if n in by_name and by_name[n].vs_chain else "-" for n in names]
        lines.append(f"| {cell.batch} | {cell.temperature:g} | {cell.context} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot_speedups(cells: Measured, path: str) -> None:
    """One panel per cell: tokens/s over the chain baseline per variant, median with min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(cells))
    rows = -(-len(cells) // columns)
    color = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(s.variant for _, summaries in cells for s in summaries))}
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax, (cell, summaries) in zip(axes.flat, cells):
        shown = [s for s in summaries if s.vs_chain is not None]
        medians = [s.vs_chain.median for s in shown]
        errors = [[m - s.vs_chain.low for m, s in zip(medians, shown)], [s.vs_chain.high - m for m, s in zip(medians, shown)]]
        ax.bar(range(len(shown)), medians, yerr=errors, color=[color[s.variant] for s in shown], capsize=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shown)), [s.variant.replace("ddtree ", "") for s in shown], rotation=45, ha="right", fontsize=7)
        ax.set_title(cell.label, fontsize=9)
        ax.set_ylabel("tokens/s over the chain")
    for ax in axes.flat[len(cells) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tokens_per_step(cells: Measured, path: str) -> None:
    """Tokens per step vs fixed budget, one line per cell; the width-1 chain as a dashed reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (cell, summaries) in enumerate(cells):
        fixed = sorted((s for s in summaries if s.kind == "fixed"), key=lambda s: s.budget)
        ax.plot([s.budget for s in fixed], [s.tokens_per_step.median for s in fixed], "o-", color=f"C{i % 10}", label=cell.label)
        width1 = next((s for s in summaries if s.kind == "width1"), None)
        if width1 is not None:
            ax.axhline(width1.tokens_per_step.median, linestyle="--", color=f"C{i % 10}", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree budget (dashed: width 1)")
    ax.set_ylabel("tokens per step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stages(cells: Measured, path: str) -> None:
    """Stacked bars: milliseconds per decode step (draft, own, target forward, rest, outside) per stage-timed
    variant and cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(cell, s) for cell, summaries in cells for s in summaries if s.step_ms]
    if not bars:
        return
    parts = ("draft", "own", "forward", "rest", "outside")
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(bars)), 5))
    bottoms = [0.0] * len(bars)
    for i, part in enumerate(parts):
        heights = [getattr(s.step_ms, part) for _, s in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, color=f"C{i}", label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    labels = [f"{s.variant.replace('ddtree ', '')} | b{c.batch} T{c.temperature:g} {c.context}" for c, s in bars]
    ax.set_xticks(range(len(bars)), labels, rotation=70, ha="right", fontsize=6)
    ax.set_ylabel("ms per decode step (medians over rounds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_cells(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[dict[str, Any], Measured]:
    """Start the engines, measure every cell and print its tables; returns the JSON report and the summaries."""
    target, draft = pair_paths(args)
    tokenizer = args.target  # the shipped pair's prompts are its token ids; another target's, its tokens of the same text
    cells = cells_of(args)
    variants = build_variants(
        draft, args.budgets, args.default_budget, with_chain=any(c.temperature == 0 for c in cells), with_control=args.control
    )
    spec_of = {v.name: v for v in variants}
    largest_budget = max(args.budgets + [args.default_budget])
    prompts = {
        c: tuple(map(tuple, context_prompts(args.prompts, prompt_tokens(c, args.max_tokens, largest_budget), tokenizer)))
        for c in args.contexts
    }
    longest = max(prompt_tokens(c, args.max_tokens, largest_budget) for c in args.contexts)
    sequence = longest + args.max_tokens + 2 * largest_budget
    kv = kv_cache_bytes(args.pair, [target, draft], args.dtype or "float32", max(args.prompts, max(args.batches)), sequence,
                        max(1024, sequence))
    kwargs = engine_kwargs(args.contexts, args.max_tokens, largest_budget, len(variants), args.tensor_parallel_size, args.dtype, kv)
    exact = exact_greedy_check(kwargs.get("dtype"))
    say(f"target {target}\ndraft  {draft}\n{args.pair} pair, dtype {kwargs.get('dtype', 'of the checkpoint')},"
        f" KV cache {kwargs.get('kv_cache_memory_bytes', 0) / 2**20:.0f} MiB per engine; starting {len(variants)} engines")
    engines, errors = start_engines(target, [(v.name, v.speculative_config) for v in variants], kwargs, say)
    report: dict[str, Any] = {"pair": {"name": args.pair, "target": target, "draft": draft}, "engine_kwargs": kwargs, "cells": [],
                              "greedy_check": "exact" if exact else "agreement", "greedy_mismatches": [], "greedy_agreement": []}
    report["errors"] = [{"variant": name, "error": error} for name, error in errors.items()]
    measured: Measured = []
    shift = 0
    try:
        for cell in cells:
            active = [e for e in engines if cell.temperature == 0 or not spec_of[e.name].greedy_only]
            work = Work(prompts[cell.context], cell.batch, cell.temperature, args.max_tokens, seeded=not args.unseeded)
            work = replace(work, repeats=-(-args.min_calls // work.calls_per_pass))
            start = time.perf_counter()
            try:
                runs, rounds = measure_cell(active, work, args.rounds, args.warmup_rounds, shift)
            except Exception as exc:  # noqa: BLE001 - keep the cells measured so far
                report["errors"].append({"cell": cell.label, "error": f"{type(exc).__name__}: {exc}"})
                say(f"  FAILED: {cell.label}: {report['errors'][-1]['error']}")
                continue
            shift += args.warmup_rounds + args.rounds
            seconds = time.perf_counter() - start
            summaries = summarize(cell.temperature, variants, runs)
            measured.append((cell, summaries))
            agreement: list[Agreement] = []
            if cell.temperature == 0 and exact:
                report["greedy_mismatches"] += greedy_mismatches(cell.label, rounds)
            elif cell.temperature == 0:
                agreement = greedy_agreement(cell.label, rounds)
                report["greedy_agreement"] += [{**asdict(a), "identical_prompts": a.identical_prompts} for a in agreement]
            report["cells"].append(cell_json(cell, work, seconds, runs, summaries))
            say(f"\n== {cell.label}: {len(work.prompts)} prompts of {len(work.prompts[0])} tokens, {args.max_tokens} new tokens each,"
                f" {args.rounds} timed rounds ({seconds:.0f} s) ==")
            for block in (format_speed_table(summaries), format_stage_table(summaries), format_bound(summaries), format_shapes(summaries)):
                if block:
                    say(block)
            if agreement:
                say(f"greedy agreement with no speculation ({kwargs['dtype']}: stated, not required), every round warm-up included:\n"
                    + format_agreement(agreement))
    finally:
        shutdown_all(engines)
    return report, measured


def cell_json(cell: Cell, work: Work, seconds: float, runs: dict[str, list[TimedRun]], summaries: list[VariantSummary]) -> dict[str, Any]:
    return {
        "batch": cell.batch,
        "temperature": cell.temperature,
        "context": cell.context,
        "prompt_tokens": len(work.prompts[0]),
        "calls_per_round": work.calls_per_pass * work.repeats,
        "seconds": seconds,
        "variants": [s.to_json() for s in summaries],
        "per_round_seconds": {name: [r.seconds for r in rs] for name, rs in runs.items()},
    }


def write_outputs(stem: str, report: dict[str, Any], measured: Measured) -> list[str]:
    """JSON and, when cells were measured, the plots; returns the paths."""
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    paths = [stem + ".json"]
    if measured:
        for suffix, plot in (("-speedup.png", plot_speedups), ("-tokens_per_step.png", plot_tokens_per_step), ("-stages.png", plot_stages)):
            plot(measured, stem + suffix)
            paths.append(stem + suffix)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_environment()
    began = time.perf_counter()
    with quiet_run(args.out, "bench") as (stem, say):
        machine = machine_info()
        say("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
        report, measured = measure_cells(args, say)
    if measured:
        print("\nmedian tokens/s over the chain baseline's (vLLM's DFlash chain at T=0, DDTree width 1 at T>0):")
        print(format_matrix(measured))
    report = {"machine": machine, "args": vars(args), "wall_seconds": time.perf_counter() - began, **report}
    report["matrix"] = format_matrix(measured)
    if report["greedy_mismatches"]:
        print(f"\nMISMATCH: greedy output differs from no speculation: {report['greedy_mismatches']}", file=sys.stderr)
    elif report["greedy_check"] == "agreement" and report["greedy_agreement"]:
        rows = report["greedy_agreement"]
        agreed, total = sum(r["agreed"] for r in rows), sum(r["total"] for r in rows)
        print(f"\ngreedy outputs in {report['engine_kwargs']['dtype']}: {agreed}/{total} tokens ({100 * agreed / total:.1f}%) agree with"
              " no speculation before each prompt's first divergence (every T=0 cell, variant and round, warm-up included;"
              " stated, not required: near-ties round differently in the tree rows)")
    elif any(cell.temperature == 0 for cell, _ in measured):
        print("\ngreedy outputs identical to no speculation (every T=0 cell, variant and round, warm-up included)")
    for path in write_outputs(stem, report, measured) + [stem + ".log"]:
        print(f"wrote {path}")
    print(f"wall time {report['wall_seconds']:.0f} s")
    return 1 if report["greedy_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
