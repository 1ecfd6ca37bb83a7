"""The step clock: the engine's own steps, timed and reported to a `BudgetPolicy`.

Rules:
- A step's time runs from its start to the next step's start: the runner's work plus the engine's
  per-step overhead, which the shape pays too.
- Only contiguous decode steps are timed: not a step the engine sat idle after, nor one that committed
  no tokens or never finished sampling, nor one that also prefilled prompt tokens (its time says nothing
  about the shape). Such a mixed step is reported untimed, with the requests that verified drafts alone
  and their tokens (the others' prefills commit one token whatever the shape), or not at all if none
  did: its drafts' acceptance is as good a sample as a decode step's, and the steps of a fresh engine
  whose requests arrive one by one, or of a server, are mixed often.
- A step ends by drafting for the next one, so a step followed by a step of the other kind (speculation
  after none, or none after speculation) did the other kind's drafting work (a draft pass and the
  deferred context, or none): it is reported without its time, its tokens still counted. A short probe
  would otherwise be charged the switch. So a shape held for one step between steps of the other kind
  is never timed: policies fed by this clock hold a shape at least two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from vllm_ddtree.core.budget.read_off import tokens_by_shape
from vllm_ddtree.core.budget.shapes import TreeShape

IDLE_FACTOR = 2.0
"""A gap from a step's start to the next one's longer than this many times the step's busy time (plus
`StepClock.idle_slack`) is idle time, not the step's: the engine waited for work."""


class BudgetPolicy(Protocol):
    """What the engine asks of a tree-shape policy: `AdaptiveBudget`, or a scripted one in tests."""

    shapes: list[TreeShape]

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape: ...

    def observe(
        self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0
    ) -> None: ...

    def requests_arrived(self, num_requests: int) -> None:
        """New requests joined the batch, which now holds `num_requests`."""


@dataclass
class TimedStep:
    """One decode-only engine step as the policy sees it: batch size, the shape it verified, when it
    started, the batch's context tokens per request, seconds until its sampling ended (None until
    then), tokens committed and draft tokens accepted per shape (`accepted_by_shape`)."""

    requests: int
    shape: TreeShape
    start: float
    context_tokens: float = 0.0
    busy: float | None = None
    committed: int = 0
    accepted: dict[TreeShape, int] = field(default_factory=dict)
    timed: bool = True
    """A decode-only step; False: a mixed step, reported untimed (the module's rules)."""


@dataclass
class StepClock:
    """Feeds `policy` with the engine's own steps (the module's rules): a step is reported when the next
    one starts, unless the gap exceeds IDLE_FACTOR x its busy time + `idle_slack` seconds."""

    policy: BudgetPolicy
    idle_slack: float = 0.02
    current: TimedStep | None = None

    def step_started(self, now: float, requests: int, shape: TreeShape, decode_only: bool, context_tokens: float = 0.0) -> None:
        """A step of `requests` requests holding `context_tokens` tokens each on average started at `now`."""
        last = self.current
        if last is not None and last.committed > 0 and last.busy is not None:
            elapsed = now - last.start
            if elapsed < IDLE_FACTOR * last.busy + self.idle_slack:
                tokens = tokens_by_shape(last.committed, last.shape, last.accepted)
                drafted_other_kind = last.shape.is_off != shape.is_off
                seconds = elapsed if last.timed and not drafted_other_kind else None
                self.policy.observe(last.requests, last.shape, seconds, tokens, last.context_tokens)
        self.current = TimedStep(requests, shape, now, context_tokens, timed=decode_only) if requests > 0 else None

    def step_sampled(self, committed: int, accepted: dict[TreeShape, int], verified: tuple[int, int] | None = None) -> None:
        """The step committed `committed` tokens, its drafts' acceptance per shape `accepted`
        (`accepted_by_shape`); verified = (requests that verified drafts, the tokens they committed), which
        a mixed step reports instead (none: the step is not reported)."""
        step = self.current
        if step is None:
            return
        if not step.timed:
            if verified is None or verified[0] == 0:
                self.current = None
                return
            step.requests, committed = verified
        step.committed, step.accepted = committed, accepted

    def step_ended(self, now: float) -> None:
        if self.current is not None:
            self.current.busy = now - self.current.start
