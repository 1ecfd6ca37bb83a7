"""Adaptive tree budget: each step, the tree shape with the best measured throughput at this batch size.

Rule. Candidates are: off (no tree nodes: a plain decoding step; the draft still runs, which keeps its
context current), the chain (width 1, `depth` nodes) and best-first trees of 4, 8, 16, ... nodes up to
the configured cap (the cap itself included), ordered by node count. For every batch-size bucket (1, 2-3,
4-7, ...) we keep decayed sums of committed tokens and step seconds per candidate. A choice is held for
`hold` steps. Choices climb the ordered list (speed peaks at an intermediate size, and far sizes can
be very slow, so they are never tried blindly): start at the first tree of at least 8 nodes (or the
cap); then take the measured best, after each of its two neighbours has been measured `warmup`
times, and with probability `explore` (seeded) re-measure one of its neighbours.
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
    """off, the chain of min(cap, depth) nodes and trees of 4, 8, 16, ... nodes up to `cap`, ordered
    by node count (the chain before a tree of as many nodes): the order the policy climbs."""
    shapes = [TreeShape(0, 1)]
    if depth >= 1:
        shapes.append(TreeShape(min(cap, depth), 1))
    size = 4
    while size < cap:
        shapes.append(TreeShape(size))
        size *= 2
    shapes.append(TreeShape(cap))
    return sorted(dict.fromkeys(shapes), key=lambda shape: (shape.budget, shape.topk is None))


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
    hold: int = 4
    warmup: int = 1
    explore: float = 0.05
    decay: float = 0.95
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
        measured = {
            i: stat for i, shape in enumerate(self.shapes)
            if (stat := self.stats.get((bucket, shape))) is not None and stat.steps >= self.warmup
        }
        if not measured:
            return self.shapes[self._start_index()]
        best = max(measured, key=lambda i: measured[i].tokens_per_second)
        neighbours = [i for i in (best - 1, best + 1) if 0 <= i < len(self.shapes)]
        for i in neighbours:
            if i not in measured:
                return self.shapes[i]
        if float(torch.rand(1, generator=self._rng)) < self.explore:
            return self.shapes[neighbours[int(torch.randint(len(neighbours), (1,), generator=self._rng))]]
        return self.shapes[best]

    def _start_index(self) -> int:
        trees = [i for i, shape in enumerate(self.shapes) if shape.topk is None and shape.budget >= 8]
        return trees[0] if trees else len(self.shapes) - 1
