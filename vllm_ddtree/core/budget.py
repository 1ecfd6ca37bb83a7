"""Adaptive tree budget: each step, the tree shape with the best measured throughput at this batch size.

Rule. Candidates are: off (no tree nodes: a plain decoding step; the draft still runs, which keeps its
context current), the chain (width 1, `depth` nodes) and best-first trees of 4, 8, 16, ... nodes up to
the configured cap (the cap itself included). For every batch-size bucket (1, 2-3, 4-7, ...) we keep
decayed sums of committed tokens and step seconds per candidate. A choice is held for `hold` steps;
then the next one is the first candidate not yet tried `warmup` times in this bucket, else with
probability `explore` a random candidate (seeded), else the one with the most tokens per second.
Throughput is measured, not modelled: draft calibration, kernel speeds and engine overheads are in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeShape:
    """budget: tree nodes besides the root (0: no speculation this step); topk: candidates per depth
    (1: the chain; None: no cap beyond the budget)."""

    budget: int
    topk: int | None = None


def candidate_shapes(cap: int, depth: int) -> list[TreeShape]:
    """off, the chain (if the cap allows `depth` nodes) and trees of 4, 8, 16, ... nodes up to `cap`."""
    shapes = [TreeShape(0, 1)]
    if depth >= 1:
        shapes.append(TreeShape(min(cap, depth), 1))
    size = 4
    while size < cap:
        shapes.append(TreeShape(size))
        size *= 2
    shapes.append(TreeShape(cap))
    return list(dict.fromkeys(shapes))


def batch_bucket(num_requests: int) -> int:
    """floor(log2(num_requests)): requests 1 | 2-3 | 4-7 | ..."""
    return max(1, num_requests).bit_length() - 1


@dataclass
class Throughput:
    """Decayed sums of committed tokens and seconds over the steps of one (bucket, shape)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class AdaptiveBudget:
    """The policy of the module rule over `shapes` (from `candidate_shapes`)."""

    shapes: list[TreeShape]
    hold: int = 3
    warmup: int = 1
    explore: float = 0.05
    decay: float = 0.9
    seed: int = 0
    stats: dict[tuple[int, TreeShape], Throughput] = field(default_factory=dict)
    _current: TreeShape | None = None
    _bucket: int = -1
    _held: int = 0
    _rng: torch.Generator | None = None

    def choose(self, num_requests: int) -> TreeShape:
        """The shape of this step's trees for a batch of `num_requests` requests."""
        bucket = batch_bucket(num_requests)
        if self._current is None or bucket != self._bucket or self._held >= self.hold:
            self._current, self._bucket, self._held = self._pick(bucket), bucket, 0
        self._held += 1
        return self._current

    def observe(self, num_requests: int, shape: TreeShape, tokens: int, seconds: float) -> None:
        """A step that verified trees of `shape` committed `tokens` tokens in `seconds`."""
        key = (batch_bucket(num_requests), shape)
        self.stats.setdefault(key, Throughput()).add(tokens, seconds, self.decay)

    def _pick(self, bucket: int) -> TreeShape:
        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        seen = {shape: self.stats.get((bucket, shape), Throughput()) for shape in self.shapes}
        untried = [shape for shape, stat in seen.items() if stat.steps < self.warmup]
        if untried:
            return untried[0]
        if float(torch.rand(1, generator=self._rng)) < self.explore:
            return self.shapes[int(torch.randint(len(self.shapes), (1,), generator=self._rng))]
        return max(self.shapes, key=lambda shape: seen[shape].tokens_per_second)
