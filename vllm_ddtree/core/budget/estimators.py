"""Estimators of per-step quantities: how the policy knows a shape's seconds and tokens.

Rules:
- Seconds follow only the shape, the batch and the context length, but a step is now and then slowed
  by the machine (another process, a page fault, the garbage collector): a shape's cost is the median
  of a short window of its recent steps (`RecentMedian`), which one slow step does not move.
- Tokens follow the text, which changes (a repetition loop accepts every draft, fresh code few): they
  are exponentially weighted means decayed by engine steps, not by the shape's own observations
  (`DecayedMean`), so a shape not run for a while (its tokens measured on other text) is re-learnt from
  its next few steps instead of holding a stale estimate that many steps would be needed to wash out.
- How well a shape's tokens are known is the standard error of their estimate, from samples that decay
  the same way (`SampleSpread`): it grows while the shape is not measured, which lets the policy doubt
  an estimate gone stale.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RecentMedian:
    """Median of the last `window` values of a per-step quantity: a step slowed by the machine moves it
    not at all, unlike a mean."""

    window: int
    values: deque[float] = field(default_factory=deque)
    steps: int = 0
    """Steps measured, with a value kept or not (`count`)."""
    last_step: int = 0
    """The step of the last value, in the caller's count (a bucket's steps for costs): how old it is."""
    _median: float | None = field(default=None, repr=False)
    """`median` until the next value (the policy reads it many times per choice)."""

    def add(self, value: float, step: int = 0) -> None:
        self.values.append(value)
        if len(self.values) > self.window:
            self.values.popleft()
        self.steps += 1
        self.last_step = step
        self._median = None

    def count(self, step: int = 0) -> None:
        """A step measured without a value kept (`AdaptiveBudget._time`: the held shape's steps measure
        the machine's speed instead): counted, and its step is the last."""
        self.steps += 1
        self.last_step = step

    @property
    def median(self) -> float:
        """The median of the values (0 while there are none)."""
        if self._median is None:
            ordered = sorted(self.values)
            half = len(ordered) // 2
            self._median = 0.0 if not ordered else ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
        return self._median


@dataclass
class DecayedMean:
    """Exponentially weighted mean of a per-step quantity, decayed by the engine steps since the last
    value: a value observed `step - last_step` steps ago weighs decay**(that) as much as a new one, so
    a shape measured long ago (the text has changed since) is re-learnt from its next few steps. A
    value may weigh more than one (`weight`: the requests behind it, `SampleSpread`)."""

    total: float = 0.0
    weight: float = 0.0
    last_step: int = 0

    def add(self, value: float, decay: float, step: int, weight: float = 1.0) -> None:
        factor = decay ** max(1, step - self.last_step)
        self.total = factor * self.total + weight * value
        self.weight = factor * self.weight + weight
        self.last_step = step

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0

    def weight_at(self, decay: float, step: int) -> float:
        """The values' total weight as of engine step `step` (decayed since the last value)."""
        return decay ** max(0, step - self.last_step) * self.weight


@dataclass
class SampleSpread:
    """How well a shape's tokens per request are known: the standard error of their estimate.

    A step of R requests whose mean is x is R samples of one request's tokens (E[R (x - mu)^2] is one
    request's variance), so the variance comes from all of the shape's steps, request-weighted
    (Welford), shrunk towards a prior variance with the weight of `prior_steps` steps (two equal steps
    at batch 1 say little). The samples behind the estimate decay by `decay` per engine step since
    they were observed, as the text changes: the standard error of a shape not measured for a while
    grows until it is measured again. `recent_mean` is the mean of those decayed samples: a longer
    memory than the policy's token estimate (`DecayedMean`), which follows the text's dips.
    """

    requests: float = 0.0
    mean: float = 0.0
    squares: float = 0.0
    steps: int = 0
    recent: DecayedMean = field(default_factory=DecayedMean)

    def add(self, value: float, requests: int, decay: float, step: int) -> None:
        self.requests += requests
        delta = value - self.mean
        self.mean += requests / self.requests * delta
        self.squares += requests * delta * (value - self.mean)
        self.steps += 1
        self.recent.add(value, decay, step, weight=requests)

    @property
    def recent_mean(self) -> float:
        return self.recent.mean

    def standard_error(self, prior_variance: float, prior_steps: float, decay: float, step: int) -> float:
        recent = self.recent.weight_at(decay, step)
        if recent <= 0:
            return math.inf
        variance = (self.squares + prior_steps * prior_variance) / (self.steps - 1 + prior_steps)
        return math.sqrt(max(0.0, variance) / recent)
