"""Arithmetic of the interleaved benchmarks: per-round ratios, step-time splits, the zero-overhead bound.

Pure functions over numbers measured elsewhere (`vllm_ddtree.demo.engines`); no vLLM.

Per-round ratios. Every round times every variant once on the same work, so a ratio is taken inside a
round (variant tokens/s over baseline tokens/s of that round) and the rounds' ratios are summarized by
their median and range: a drift of the machine between rounds moves both terms of a ratio together.
(A ratio of per-variant medians would pair measurements from different rounds.)

Step split. The DDTree runner's stage times (`vllm_ddtree.vllm.stage_times`) split the runner's share of
a decode step into draft forward, DDTree's own stages (top-k, tree build + verify inputs, acceptance,
KV compaction), target forward and the rest of the runner; the step's wall time beyond the runner
(scheduler, engine loop, output processing) is "outside".

Zero-overhead bound. What a tree variant would serve if DDTree's own stages cost nothing and its verify
forward cost what a forward of the chain costs per row (no tree-attention penalty): in each decode step,
its measured time minus its own stages and its target forward, plus the chain's target-forward
milliseconds per row times the tree's rows; the run's tokens over its time less what its decode steps
save. The chain's per-row cost comes from DDTree of width 1 (the chain's shape, stage-timed)
in the same round. The estimate is linear in rows: on a compute-bound CPU the forward's cost grows
about linearly with rows; where a forward has a large fixed part (a memory-bound GPU) it overstates
the tree's forward and so understates the bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_ddtree.vllm.stage_times import ACCEPTANCE, DRAFT_FORWARD, DRAFT_TOPK, KV_COMPACTION, STEP, TARGET_FORWARD, TREE_BUILD

OWN_STAGES = (DRAFT_TOPK, TREE_BUILD, ACCEPTANCE, KV_COMPACTION)
"""DDTree's own work in a step: what the chain of vLLM's DFlash does not do."""


@dataclass(frozen=True)
class Spread:
    """Median and range of per-round values."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    def format(self, digits: int = 2, suffix: str = "") -> str:
        """"1.23x [1.10-1.31]" (the range only when there are several rounds)."""
        text = f"{self.median:.{digits}f}{suffix}"
        if len(self.values) > 1:
            text += f" [{self.low:.{digits}f}-{self.high:.{digits}f}]"
        return text


def spread(values: Sequence[float]) -> Spread:
    """Median, min and max of `values` (one per round; at least one)."""
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values), tuple(values))


def per_round_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """Spread of numerators[r] / denominators[r] over rounds r (both measured in round r)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators for {len(denominators)} denominators")
    return spread([n / d for n, d in zip(numerators, denominators)])


@dataclass(frozen=True)
class StepSplit:
    """Milliseconds per step over the decode steps of one run of a stage-timed engine.

    wall: the steps' wall time; draft, own, forward, rest: the runner's stages
    (own = DDTree's own stages); outside: wall minus all stages (a difference of differences when the
    decode steps are a run minus its prefill pass, so it can come out a hair below zero); rows:
    target-forward rows per step; steps: how many steps.
    """

    wall: float
    draft: float
    own: float
    forward: float
    rest: float
    outside: float
    rows: float
    steps: float

    @property
    def forward_per_row(self) -> float:
        """Target-forward milliseconds per row."""
        return self.forward / self.rows


def step_split(seconds: float, stage_seconds: Mapping[str, float], steps: float, rows: float) -> StepSplit:
    """Split `steps` engine steps of `seconds` wall time, whose runner stages took `stage_seconds`
    (seconds per stage name, all steps together) and whose target forwards ran `rows` rows in all."""
    per_step = 1000.0 / steps
    draft = stage_seconds[DRAFT_FORWARD] * per_step
    own = sum(stage_seconds[name] for name in OWN_STAGES) * per_step
    forward = stage_seconds[TARGET_FORWARD] * per_step
    rest = stage_seconds[STEP] * per_step
    wall = seconds * per_step
    return StepSplit(wall, draft, own, forward, rest, wall - draft - own - forward - rest, rows / steps, steps)


@dataclass(frozen=True)
class Bound:
    """The zero-overhead bound of one tree run against the chain baseline of the same round.

    step: the tree's decode step in milliseconds with its own stages removed and its target forward at
    the chain's per-row cost; tokens_per_second: the run's tokens over its seconds less what its decode
    steps save that way; ratio: that over the chain baseline's measured tokens/s.
    """

    step: float
    tokens_per_second: float
    ratio: float


def zero_overhead_bound(
    tree: StepSplit, run_seconds: float, run_tokens: int, chain_forward_per_row: float, chain_tokens_per_second: float
) -> Bound:
    """The bound of the module docstring for a run of `run_seconds` emitting `run_tokens` tokens whose
    decode steps split as `tree`; tokens per step stay as measured."""
    step = tree.wall - tree.own - tree.forward + chain_forward_per_row * tree.rows
    seconds = run_seconds - (tree.wall - step) * tree.steps / 1000.0
    tokens_per_second = run_tokens / seconds
    return Bound(step, tokens_per_second, tokens_per_second / chain_tokens_per_second)


def median_split(splits: Sequence[StepSplit]) -> StepSplit:
    """Field-by-field median of per-round splits."""
    return StepSplit(*(statistics.median(getattr(s, name) for s in splits) for name in StepSplit.__dataclass_fields__))
