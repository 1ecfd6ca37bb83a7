"""Adaptive tree budget: each step, the tree shape with the best measured throughput at this batch size and context length.

Rule. Candidates are: off (no tree nodes: a plain decoding step; the draft only stores its context,
without its block pass), the chain (width 1, `depth` nodes) and best-first trees of 4, 8, 16, ... nodes up to
the configured cap (the cap itself included), ordered by node count. We keep the seconds per step of
each candidate for every bucket of batch size (1, 2-3, 4-7, ...) and context length (tokens per
request below 512, 512-1023, 1024-2047, ...: `step_bucket`), and decayed means of the tokens
it commits per request and step, pooled over all buckets (acceptance depends on the text, not on
the batch, and small buckets see few steps). Seconds are measured for the shape a step used, except
its first step in the bucket (one-time costs: new tensor shapes, caches) and steps whose drafting
prepares the other kind of step (speculation after none or none after speculation, `StepClock`), and follow only shape, batch
and context length, so a short window of recent steps serves. (Context length: a verify forward's
attention reads every row's context, so a tree's step grows with the context faster than off's, and
the speed paired timing derives from the held shape would carry a short context's ratios over to a
long one: traced at batch 1, T=0, after three rounds of short prompts trees of 16 held for ~220 steps
of 2k-token prompts before off did; simulated, a tree that wins at short contexts held on ~550 of 600
steps of a long context where off was 1.3x faster.) Tokens follow the text (a repetition loop accepts every draft, fresh code
few; sampling at T > 0 fewer than greedy), so they are decayed means over about thirty steps, decayed by
engine steps rather than by the shape's own observations: a shape not run for a while (its tokens
measured on other text) is re-learnt from its next few steps instead of holding a stale estimate that
a hundred steps of a worse shape would be needed to wash out; at batch 1 the estimate of a shape not run
for a while also regresses to the longer-memory mean of its samples (`expected_tokens`: the text's dips
end, and off, while it holds, measures nothing else). Tokens are measured for the shape a step used AND for every
candidate nested in it: a best-first tree of b nodes is the first b nodes of a bigger one, and the walk
of the bigger tree passes the same nodes with the same target tokens, so the b-node tree would have
accepted exactly the accepted path's nodes of index <= b (off: none) — paired, noise-free comparisons.
The chain is no prefix of a tree, but a best-first tree at least as deep holds the chain's nodes as far
as it reaches (each depth's rank-0 path node is that depth's best node), so the chain's tokens come
with every tree step too (`chain_accepted`); without them the chain would be measured only on its own
steps, on other text than the trees it is compared with. (A tree ending right below the chain's
accepted run gives a lower bound: measured on the demo pair at batch 1, T=0, the read-off was censored
so in 24%, 11% and 6% of the requests' steps of trees of 8, 16 and 32 nodes, and about 5% low with
trees of 8, which favoured trees over the chain by about that much. With the draft's rank-0 tokens
kept with the trees, the target's token at the run's last node settles the chain's next node, so the
read-off is exact there and a lower bound one depth further down: `chain_accepted`.)
Choices climb the ordered list (speed peaks at an intermediate size, and far sizes can be very slow,
so they are never tried blindly): a bucket starts where an adjacent bucket with measurements stands,
at off when only far buckets have measurements (the first one: at the first tree of at least 8
nodes, or the cap), and times the references next:
off (cheap) and the chain, what a user would run instead of trees (at large batches on compute-bound
hardware speculation loses, and a climb down to them would take several probes or stop on a tie
before them); then take the best measured tokens
per second, after each of its two neighbours has been timed `warmup` times. Its rivals (the
neighbours, past the chain where it is one: the chain is no tree; and the references) are measured
again in two ways. Re-probes, paid from a credit of
`reprobe` (1.5%) of the bucket's timed seconds, each charged what it costs over the best shape: a
rival whose upper confidence rate (tokens plus some standard errors, which grow as its samples age:
`SampleSpread`; the error capped at half the range of a step's tokens) would win the switch, so an
estimate taken on other text, or from a request's first steps at batch 1 (where drafts accept fewer
tokens than later in its output), is not kept for hundreds of steps. At batch 1 the doubt is wider
(0.75 standard errors, the sample variance shrunk towards a range prior with the weight of 8 steps;
larger batches: 0.5 and 2): a step there brings one request's sample, and its rate is the end-to-end
rate; a larger batch's step brings one per request, and its rate overstates what speculation gains a
batch end to end (requests finish at different steps, the batch's last steps run few of them: measured
at batch 4 and 16, T=0, speculation at par with or ahead of off per decode step ran at 0.56-0.76x no
speculation end to end), so there the policy asks for more evidence before it re-probes its way onto
speculation (off measures nothing else while it holds);
else a rival whose timing is older than RETIME_AFTER_STEPS of its bucket's steps (the machine drifts),
times the square of how far its rate is behind the best's (paired timings age only in their ratio;
the re-timing starts a new window of its seconds, `_time`).
At batch 1 a new request is new text: its first doubted rival is re-measured even when the credit
cannot pay (borrowing from it), while that rival has been measured on fewer than FEW_SAMPLES steps
(`requests_arrived`). And with probability `explore` (seeded) a
random rival (a probe kept with probability 1 / its step's cost in steps of the best shape, so re-timing
a far costlier shape is rarer and exploration costs about the same whatever the shapes cost). These
two probes run whatever the credit holds, and are charged to it (it may go negative), so they take the
place of re-probes the credit would pay rather than adding to them (measured at batch 1 against no
speculation, in-process, 24 requests interleaved: T=1 3.7% faster on short prompts and 2.5% on 2k-token
ones, where off is right; T=0 unchanged). Every probe is charged per step of it that runs
(`ProbeCharge`): a probe picked for a request that ends before it verifies a draft costs nothing. Seconds
are paired (`_time`): a shape's cost is the median of its last 9 timed steps in the bucket (a step the
machine slowed does not move it), each divided by the machine's speed at that moment, which the held
shape's steps measure (its own cost stays its first full window's); a shape's seconds are its cost
times the speed now, so shapes timed minutes apart on a machine whose speed drifts compare as if timed
together. Tokens are decayed means.
Hysteresis: the best shape of a bucket changes only when a rival's rate beats it by more than `margin` (3%) times how many of its steps one of the rival's
costs, so timing noise between near-equal shapes does not make the choice flip back and forth, and a
costly shape (a tree at a large batch, whose per-step gain also ignores what its uneven progress costs
the batch's tail) needs stronger evidence; the climb still follows the measured leader's unmeasured
neighbours, so a slope of small gains is walked to its end. At 4 or more requests speculative shapes'
rates are discounted by `batched_discount` (35%) against off: an offline batch's requests progress
unevenly under speculation and leave a tail of steps running the slowest few, which no step's rate
shows (`_rates`). The best shape is held for `hold` steps; a shape tried for timing only for
`probe_hold` (a bucket's short-lived batch sizes, such as the tail of a batch whose requests finish,
must not spend their steps probing). A bucket that has run fewer than FOLLOW_STEPS
timed steps, beside one that has run as many, holds that bucket's best instead of exploring (the steps
of an offline batch whose requests reach the engine one by one).
Greedy batches and batches that sample (any request at T > 0) keep apart policies (`SamplingRegimes`):
their acceptance differs most, and each regime resumes with its own best shape when the traffic turns.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from vllm_ddtree.core.tree import DraftTree


SPEED_WINDOW = 3
"""Steps the machine's speed is the median of (`AdaptiveBudget._time`): shorter than a shape's cost
window, so a change of speed moves the speed within two steps, before it can move the held shape's
cost (whose window holds more values)."""

FEW_SAMPLES = 16
"""A rival measured on fewer steps than this is re-measured when a new request arrives at batch 1
(`AdaptiveBudget.requests_arrived`)."""

CONTEXT_BUCKET_TOKENS = 512
"""Context tokens per request from which the policy times shapes apart by context length, per doubling
(`context_bucket`): a verify forward's attention grows with the context, and with it the shapes' costs
relative to each other, which paired timing (`AdaptiveBudget._time`) assumes fixed within a bucket."""

BATCH_BUCKETS = 64
"""Batch buckets per context bucket in a bucket's number (`step_bucket`): more than any batch has."""

FOLLOW_STEPS = 32
"""Timed steps before a bucket chooses for itself, while an adjacent bucket has run this many
(`AdaptiveBudget._followed`)."""

STEP_SECONDS = (1e-6, 3600.0)
"""A step timed outside this range counts as untimed (`AdaptiveBudget.observe`): no engine step takes
under a microsecond or over an hour, so such a time is a stopped, stepped or jumping clock, and rates
from it would divide by zero or overflow."""

RETIME_AFTER_STEPS = 512
"""Timings older than this many steps of their batch-size bucket are re-taken (the machine's speed
drifts). Counted in the bucket's own steps, not the engine's: the speed its held shape measures when
it runs again carries the drift over the time it did not run, and a bucket visited now and then (an
offline batch of 16 between hundreds of batch-1 steps) would otherwise re-time its rivals on most
visits: at a large batch a probe of speculation costs several off steps and the switches (traced: a
16-request call 0.36 s without probes, 0.41-0.49 s with)."""


class TreeShape(NamedTuple):
    """budget: tree nodes besides the root (0: no speculation this step); topk: candidates per depth
    (1: the chain; None: no cap beyond the budget). A named tuple: shapes key every table of the
    policy, hashed some twenty times per step (simulated at batch 1), and a tuple's hash is computed in C (a frozen
    dataclass's in Python)."""

    budget: int
    topk: int | None = None

    @property
    def is_off(self) -> bool:
        return self.budget == 0

    @property
    def is_chain(self) -> bool:
        return self.budget > 0 and self.topk == 1


OFF = TreeShape(0, 1)
"""No speculation this step: no tree nodes (the chain of length 0)."""


class BudgetPolicy(Protocol):
    """What the engine asks of a tree-shape policy: `AdaptiveBudget`, or a scripted one in tests."""

    shapes: list[TreeShape]

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape: ...

    def observe(
        self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0
    ) -> None: ...

    def requests_arrived(self, num_requests: int) -> None:
        """New requests joined the batch, which now holds `num_requests`."""


def candidate_shapes(cap: int, depth: int) -> list[TreeShape]:
    """off, the chain of min(cap, depth) nodes and trees of 4, 8, 16, ... nodes up to `cap`, ordered
    by node count (the chain before a tree of as many nodes): the order the policy climbs."""
    shapes = [OFF]
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


def context_bucket(context_tokens: float) -> int:
    """0 below CONTEXT_BUCKET_TOKENS tokens per request, then one per doubling: 512-1023 | 1024-2047 | ..."""
    tokens = context_tokens if 0 <= context_tokens < 2**40 else 0  # NaN, negative or absurd: the first
    return int(tokens // CONTEXT_BUCKET_TOKENS).bit_length()


def step_bucket(num_requests: int, context_tokens: float) -> int:
    """The policy's bucket of a batch of `num_requests` requests holding `context_tokens` tokens each on
    average: its batch bucket + BATCH_BUCKETS x its context bucket (the batch bucket of a bucket is
    `bucket % BATCH_BUCKETS`; short contexts keep the batch bucket's number)."""
    return batch_bucket(num_requests) + BATCH_BUCKETS * context_bucket(context_tokens)


def _batch_of(bucket: int) -> int:
    """The batch bucket of a policy bucket (`step_bucket`): 0 is batch 1."""
    return bucket % BATCH_BUCKETS


@dataclass
class RecentMedian:
    """Median of the last `window` values of a per-step quantity: a step slowed by the machine (another
    process, a page fault, the garbage collector) moves it not at all, unlike a mean."""

    window: int = 9
    values: deque[float] = field(default_factory=deque)
    steps: int = 0
    last_step: int = 0
    """The step of the last value, in the caller's count (a bucket's steps for costs): how old it is."""
    _median: float | None = field(default=None, repr=False)
    """`mean` until the next value (the policy reads it many times per choice)."""

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
    def mean(self) -> float:
        """The median (the name is the one the policy reads from every estimate)."""
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
    steps: int = 0
    last_step: int = 0

    def add(self, value: float, decay: float, step: int, weight: float = 1.0) -> None:
        factor = decay ** max(1, step - self.last_step)
        self.total = factor * self.total + weight * value
        self.weight = factor * self.weight + weight
        self.steps += 1
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


def nested_shapes(shapes: list[TreeShape], used: TreeShape) -> list[TreeShape]:
    """Candidates whose tree is a prefix of a `used`-shaped tree: off, `used` itself, and for a tree
    (no top-k cap) every smaller tree."""
    return [s for s in shapes if s.is_off or s == used or (used.topk is None and s.topk is None and s.budget <= used.budget)]


def chain_accepted(
    tree: DraftTree, accepted_nodes: torch.Tensor, chain_depth: int, target_token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Draft tokens [R] the chain (each depth's rank-0 token, `chain_depth` deep) would have accepted
    in this step, read off a verified tree and its accepted path accepted_nodes [R, D] (root first,
    -1 padded): the accepted path's leading run of rank-0 nodes, capped at `chain_depth`.

    The chain walks the same nodes with the same target tokens while the path stays on rank 0, and
    stops where the path leaves it (the target's token is not the rank-0 one) or stops below a rank-0
    child (the target rejected it). Where the run is the whole path and its last node u has no rank-0
    child in the tree (the tree ends there: shallower than `chain_depth`, or cut), the chain's next
    node is the draft's rank-0 token one depth down (`tree.chain_token_ids`, when kept) and the
    target's token at u (target_token_ids [R, N], when given) tells whether the chain accepts it: one
    more token if so, and then a lower bound (the target's token at that node is unknown), as without
    the chain's tokens. Host tensors (computed in numpy).
    """
    ranks, nodes = tree.ranks.numpy(), accepted_nodes.numpy()
    path = nodes[:, 1:]
    on_rank0 = (path >= 0) & (np.take_along_axis(ranks, np.maximum(path, 0), 1) == 0)
    run = on_rank0.cumprod(1).sum(1)
    if tree.chain_token_ids is not None and target_token_ids is not None:
        chain_tokens, target = tree.chain_token_ids.numpy(), target_token_ids.numpy()
        rows = np.arange(run.size)
        drafted = (path >= 0).sum(1)
        last = nodes[rows, drafted]  # the path's last node (the root when nothing was accepted)
        rank0_child = (tree.valid.numpy() & (tree.parents.numpy() == last[:, None]) & (ranks == 0)).any(1)
        below = run < min(chain_depth, chain_tokens.shape[1])
        next_token = chain_tokens[rows, np.minimum(run, chain_tokens.shape[1] - 1)]
        run = run + ((run == drafted) & ~rank0_child & below & (target[rows, last] == next_token))
    return torch.from_numpy(np.minimum(run, chain_depth))


def accepted_by_shape(
    shapes: list[TreeShape],
    used: TreeShape,
    tree: DraftTree,
    accepted_nodes: torch.Tensor,
    verified: torch.Tensor,
    target_token_ids: torch.Tensor | None = None,
) -> dict[TreeShape, int]:
    """Draft tokens accepted in one step by the `used` shape and by every candidate whose tokens can be
    read off it, all requests together: the nested smaller trees (a b-node best-first tree accepts the
    path nodes of index <= b) and, when the step's trees are trees (no top-k cap), the chain
    (`chain_accepted`). Only the requests with verified drafts (`verified` [R] bool) count; shapes
    bigger than the smallest of their trees are left out (the scheduler may have cut trees), and so is
    everything but `used` when no request verified drafts. One host sync for all shapes.

    tree [R, N] and accepted_nodes [R, D] (root first, -1 padded) are the step's trees and walk, and
    target_token_ids [R, N] the target's token at every node (the chain's read-off goes one depth
    further with them), host tensors (computed in numpy: a handful of tiny arrays per step).
    """
    verified = verified.numpy()
    if not verified.any():
        return {used: 0}
    nested, chain = read_off_shapes(shapes, used, int(tree.num_nodes.numpy()[verified].min()) - 1)
    nodes = accepted_nodes.numpy()
    path = nodes[verified, 1:, None]
    budgets = np.array([shape.budget for shape in nested])
    counts = ((path > 0) & (path <= budgets)).sum((0, 1)).tolist()
    if chain is not None:
        counts.append(int(chain_accepted(tree, accepted_nodes, chain.budget, target_token_ids).numpy()[verified].sum()))
        nested.append(chain)
    return dict(zip(nested, counts))


def read_off_shapes(shapes: list[TreeShape], used: TreeShape, smallest: int) -> tuple[list[TreeShape], TreeShape | None]:
    """The candidates `accepted_by_shape` reads off a step of `used`-shaped trees whose smallest verified
    tree has `smallest` drafts: the nested shapes that fit (`used` always), and the chain when it is
    read off trees (None otherwise)."""
    nested = [shape for shape in nested_shapes(shapes, used) if shape == used or shape.budget <= smallest]
    chain = next((shape for shape in shapes if shape.is_chain), None)
    with_chain = chain is not None and chain not in nested and used.topk is None and chain.budget <= smallest
    return nested, chain if with_chain else None


def tokens_by_shape(committed: int, used: TreeShape, accepted: dict[TreeShape, int]) -> dict[TreeShape, int]:
    """Tokens a step committed (`committed`, under `used`) and would have committed under each shape of
    `accepted` (draft tokens accepted per shape, `accepted_by_shape`): the bonus tokens are the same
    whatever the shape, only the accepted draft tokens differ."""
    if not accepted:
        return {used: committed}
    bonus = committed - accepted.get(used, 0)
    return {shape: bonus + gain for shape, gain in accepted.items()}


class ProbeCharge(NamedTuple):
    """A probe's cost over the held best (`AdaptiveBudget._probe_cost`), charged to its bucket's
    re-probe credit one step at a time as its steps are observed: `per_step` for each of up to `steps`
    steps of `shape` among the next `window` observed steps (a step is observed one step after the choice
    that shaped it, so a probe held h steps shows within h + 1). A probe picked for a request that
    finishes first (a request of one output token: its step after the choice never comes) is not
    charged: traced at batch 1, T=0, eight such requests between rounds charged ~10 ms of forced probes
    that never ran, and with the credit negative no doubt could re-measure the trees, while off held for
    ~80 steps where a fixed tree of 8 runs ~1.2x faster than off."""

    bucket: int
    shape: TreeShape
    per_step: float
    steps: int
    window: int


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


def _ratio(a: float, b: float) -> float:
    """a / b, +inf where b is 0 (a rate or count of 0 comes only from odd inputs: no exception for them)."""
    return a / b if b else math.inf


@dataclass
class StepClock:
    """Feeds a `BudgetPolicy` with the engine's own steps.

    A step's time is from its start to the next step's start: the runner's work plus the engine's
    per-step overhead, which the shape pays too. It is reported when the next step starts, unless the
    engine sat idle in between (the gap exceeds `idle_factor` x the step's busy time + `idle_slack`
    seconds), the step committed no tokens, or it never finished sampling. Steps that also prefill
    prompt tokens are not timed (their time says nothing about the shape). A step ends by drafting for
    the next one, so a step followed by a step of the other kind (speculation after none, or none after
    speculation) is reported without its time (seconds None; its tokens count): it did the other kind's
    drafting work (measured at batch 1, T=0, in runs of 8: the last step without drafts before verify
    steps took 4.3 ms against 2.2 for the others, as it runs the draft pass and stores the deferred
    context; the last verify step before steps without drafts 3.8 against 5.0). Short probes would
    otherwise be charged the switch. (So a shape held for one step between steps of the other kind is
    never timed: policies fed by this clock hold a shape at least two steps.)
    """

    policy: BudgetPolicy
    idle_factor: float = 2.0
    idle_slack: float = 0.02
    current: TimedStep | None = None

    def step_started(self, now: float, requests: int, shape: TreeShape, decode_only: bool, context_tokens: float = 0.0) -> None:
        """A step of `requests` requests holding `context_tokens` tokens each on average started at `now`."""
        last = self.current
        if last is not None and last.committed > 0 and last.busy is not None:
            elapsed = now - last.start
            if elapsed < self.idle_factor * last.busy + self.idle_slack:
                tokens = tokens_by_shape(last.committed, last.shape, last.accepted)
                drafted_other_kind = last.shape.is_off != shape.is_off
                self.policy.observe(last.requests, last.shape, None if drafted_other_kind else elapsed, tokens, last.context_tokens)
        self.current = TimedStep(requests, shape, now, context_tokens) if requests > 0 and decode_only else None

    def step_sampled(self, committed: int, accepted: dict[TreeShape, int]) -> None:
        if self.current is not None:
            self.current.committed, self.current.accepted = committed, accepted

    def step_ended(self, now: float) -> None:
        if self.current is not None:
            self.current.busy = now - self.current.start


@dataclass
class AdaptiveBudget:
    """The policy of the module rule over `shapes` (from `candidate_shapes`)."""

    shapes: list[TreeShape]
    hold: int = 4
    probe_hold: int = 2
    warmup: int = 1
    explore: float = 0.02
    margin: float = 0.03
    seconds_window: int = 9
    tokens_decay: float = 0.97
    reprobe: float = 0.015
    confidence: float = 0.75
    batched_confidence: float = 0.5
    samples_decay: float = 0.99
    prior_steps: float = 8.0
    batched_prior_steps: float = 2.0
    batched_discount: float = 0.35
    seed: int = 0
    tokens: dict[TreeShape, DecayedMean] = field(default_factory=dict)
    spread: dict[TreeShape, SampleSpread] = field(default_factory=dict)
    costs: dict[tuple[int, TreeShape], RecentMedian] = field(default_factory=dict)
    speed: dict[int, RecentMedian] = field(default_factory=dict)
    credit: dict[int, float] = field(default_factory=dict)
    _untimed_first_steps: set[tuple[int, TreeShape]] = field(default_factory=set)
    _retimed: set[tuple[int, TreeShape]] = field(default_factory=set)
    _current: TreeShape | None = None
    _bucket: int = -1
    _held: int = 0
    _hold_now: int = 0
    _rng: random.Random | None = None
    _best: dict[int, int] = field(default_factory=dict)
    _observed_steps: int = 0
    _bucket_steps: dict[int, int] = field(default_factory=dict)
    _new_text: bool = False
    _probe: ProbeCharge | None = None

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        """The shape of this step's trees for a batch of `num_requests` requests holding `context_tokens`
        tokens each on average."""
        bucket = step_bucket(num_requests, context_tokens)
        if self._current is None or bucket != self._bucket or self._held >= self._hold_now:
            (self._current, self._hold_now), self._bucket, self._held = self._pick(bucket), bucket, 0
        self._held += 1
        return self._current

    def requests_arrived(self, num_requests: int) -> None:
        """At batch 1 a new request is new text: its first doubted rival is re-measured even when the
        re-probe credit cannot pay for it (once per request; charged to the credit, `_reprobed`), while
        the rival's estimate rests on fewer than FEW_SAMPLES steps. Estimates taken on one request's text
        say little about the next one's (traced at batch 1, T=0: the first request's chain accepted 1.5 tokens per step, the later ones
        2.6-3.5; off held for ~200 steps, the credit paying one chain probe per that many). Once a rival
        has been measured on more text, the credit alone pays its re-probes: with every new request
        granting one, batch 1 at T=1 (off is right) probed 14-31 steps per 8 requests instead of 4-12 and
        ran 3-4% slower."""
        if batch_bucket(num_requests) == 0:
            self._new_text = True

    def observe(
        self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0
    ) -> None:
        """A step of `num_requests` requests holding `context_tokens` tokens each on average verified
        trees of shape `used` in `seconds` (None: untimed); tokens[s] = tokens it committed (s = used) or
        would have committed (s nested in used, see `nested_shapes`), all requests together."""
        bucket = step_bucket(num_requests, context_tokens)
        if seconds is not None and not STEP_SECONDS[0] <= seconds <= STEP_SECONDS[1]:  # NaN too
            seconds = None
        if seconds is not None and (bucket, used) in self._untimed_first_steps:
            self._time(bucket, used, seconds)
            # a bucket starts with the credit of RETIME_AFTER_STEPS steps: its first estimates, from a
            # few steps each, are the least sure
            initial = self.reprobe * seconds * RETIME_AFTER_STEPS if bucket not in self.credit else 0.0
            self.credit[bucket] = self.credit.get(bucket, 0.0) + initial + self.reprobe * seconds
        self._untimed_first_steps.add((bucket, used))
        if self._probe is not None:
            self._charge_probe(bucket, used)
        self._observed_steps += 1
        self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        requests = max(1, num_requests)
        for shape, count in tokens.items():
            if not 0 <= count < math.inf:  # no step commits a negative, infinite or NaN count
                continue
            # (get, then create: a setdefault would build a new, discarded estimate per shape and step)
            tokens_mean, spread = self.tokens.get(shape), self.spread.get(shape)
            if tokens_mean is None:
                tokens_mean = self.tokens[shape] = DecayedMean()
            if spread is None:
                spread = self.spread[shape] = SampleSpread()
            tokens_mean.add(count / requests, self.tokens_decay, self._observed_steps)
            spread.add(count / requests, requests, self.samples_decay, self._observed_steps)

    def _charge_probe(self, bucket: int, used: TreeShape) -> None:
        """Charge the pending probe (`ProbeCharge`) for an observed step of `used` in `bucket`."""
        probe = self._probe
        assert probe is not None
        steps = probe.steps
        if used == probe.shape and bucket == probe.bucket:
            self.credit[bucket] = self.credit.get(bucket, 0.0) - probe.per_step
            steps -= 1
        self._probe = probe._replace(steps=steps, window=probe.window - 1) if steps > 0 and probe.window > 1 else None

    def _time(self, bucket: int, used: TreeShape, seconds: float) -> None:
        """Paired timing: seconds = the machine's speed now x the shape's cost. A step of the bucket's
        held best (before it holds one: of any shape), once its cost rests on a full window of steps,
        measures the speed (seconds / cost; the median of the bucket's last SPEED_WINDOW such steps) and
        leaves that cost as it is; every other step adds seconds / the speed to its shape's costs. So
        costs measured minutes apart compare as if measured together: a probe timed while the machine
        ran at half speed (this VM drifts 2x within a minute) is charged its cost, not the slowdown, as
        the held shape's steps around it carry the slowdown into the speed. A probe's own steps never
        move the speed: a cost measured wrongly (a slow moment) would otherwise explain its next steps
        away as a change of speed, and never be corrected. And the held shape's steps never move its
        own cost: fed both ways, the split of its seconds into cost and speed random-walks (simulated,
        off held at batch 4, 4 ms steps with 10% noise: the speed wandered over 0.72-1.16 in 20000
        steps, and a tree of 4 timed once at 16 ms read 11.4-18.6 ms), and with it every rival's
        seconds; the held shape's cost is its first full window's, the speed its ratio to now. A rival
        re-timed because its timing was overdue (`_reprobed`) starts a new window: its old values may
        rest on another frame of speed (taken before any shape measured the speed, or divided by a
        speed a slow spell left behind when the held best changed and nothing measured it until the new
        best's window filled), and diluted by the re-timing's one or two steps they would need several
        re-timings, 512 or more steps apart, to leave the median (simulated at batch 1: the chain held
        for ~1500 steps where off ran 1.5x faster; off at batch 16 held from step 1032, now 518)."""
        speed, costs = self.speed.get(bucket), self.costs.get((bucket, used))
        if speed is None:
            speed = self.speed[bucket] = RecentMedian(SPEED_WINDOW)
        if costs is None:
            costs = self.costs[bucket, used] = RecentMedian(self.seconds_window)
        if self._retimed and (bucket, used) in self._retimed:  # an overdue re-timing: a new window
            self._retimed.discard((bucket, used))
            costs.values.clear()
        best = self._best.get(bucket)
        step = self._bucket_steps.get(bucket, 0)
        if len(costs.values) == costs.window and costs.mean > 0 and (best is None or self.shapes[best] == used):
            speed.add(seconds / costs.mean, self._observed_steps)
            costs.count(step)
        else:
            costs.add(seconds / (speed.mean if speed.values else 1.0), step)

    def seconds(self, bucket: int, shape: TreeShape) -> float | None:
        """A step of `shape` in `bucket` at the machine's speed now (None until timed)."""
        costs = self.costs.get((bucket, shape))
        if costs is None or not costs.values:
            return None
        speed = self.speed.get(bucket)
        return costs.mean * (speed.mean if speed is not None and speed.values else 1.0)

    def best_shape(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape | None:
        """The shape this batch's bucket holds as its best (None until it has measurements)."""
        best = self._best.get(step_bucket(num_requests, context_tokens))
        return None if best is None else self.shapes[best]

    def tokens_per_second(self, bucket: int, shape: TreeShape) -> float | None:
        """Measured tokens per second and request of the batch (ranks the shapes of one bucket), or None
        until the shape has been timed `warmup` times in this bucket (after its untimed first step)."""
        costs = self.costs.get((bucket, shape))
        seconds = self.seconds(bucket, shape)
        if costs is None or shape not in self.tokens or costs.steps < self.warmup or seconds is None or seconds <= 0:
            return None
        return self.expected_tokens(bucket, shape) / seconds

    def expected_tokens(self, bucket: int, shape: TreeShape) -> float:
        """Tokens per request a step of `shape` is expected to commit now: the decayed mean of its last
        steps (the text's stretch it was measured on). At batch 1 a shape not measured for a while is
        expected to commit what it commits over longer stretches: the estimate regresses to the
        longer-memory mean of its samples (`SampleSpread.recent_mean`) with the weight that memory's own
        decay (`samples_decay` per engine step) has taken from its last steps since. A request's text has dips (traced at batch 1,
        T=0: the chain 1.9 tokens per step for tens of steps, 3.4 around them); off, measuring nothing
        else while it holds, would otherwise keep the chain at its dip's estimate until a re-probe
        (about 200 steps there: the credit pays one chain probe per that many off steps). Larger
        batches average their requests' dips, and there a step's rate overstates what speculation
        gains end to end (see `_doubted`), so they keep the decayed mean."""
        tokens = self.tokens[shape]
        if _batch_of(bucket) != 0:
            return tokens.mean
        kept = self.samples_decay ** max(0, self._observed_steps - tokens.last_step)
        return kept * tokens.mean + (1 - kept) * self.spread[shape].recent_mean

    def _pick(self, bucket: int) -> tuple[TreeShape, int]:
        """(shape, steps to hold it)."""
        if self._rng is None:
            self._rng = random.Random(self.seed)
        if (followed := self._followed(bucket)) is not None:
            return self.shapes[followed], self.hold
        rates = self._rates(bucket)
        if not rates:
            return self.shapes[self._start_index(bucket)], self.probe_hold
        references = [i for i, shape in enumerate(self.shapes) if shape.is_off or shape.is_chain]
        for i in references:  # what a user would run instead, timed early in every bucket
            if i not in rates:
                return self.shapes[i], self.hold if self.shapes[i].is_off else self.probe_hold
        leader = max(rates, key=rates.get)
        for i in (leader - 1, leader + 1):  # climb: time the leader's neighbours first
            if 0 <= i < len(self.shapes) and i not in rates:
                return self.shapes[i], self.probe_hold
        best = self._best.get(bucket)
        if best is None or best not in rates:  # nothing held yet: off holds, if timed (a reference, the cheapest)
            best = next((i for i in references if self.shapes[i].is_off and i in rates), leader)
        if rates[leader] > rates[best] * (1 + self.margin * self._cost(bucket, leader, best)):
            best = leader  # hysteresis: the held best yields only to a rival enough faster
        self._best[bucket] = best
        retimed = [i for i in dict.fromkeys((*self._beside(best), *references)) if i != best]
        if (doubt := self._reprobed(bucket, rates, best, retimed)) is not None:
            return self.shapes[doubt], self.probe_hold
        # Python's generator: with torch's, a pick took 365 us in the engine (batch 16, off held), 70 with this
        if self._rng.random() < self.explore:  # a neighbour or a reference: never stuck
            probe = self._rng.choice(retimed)
            if self._rng.random() * self._cost(bucket, probe, best) < 1:
                if probe in rates:  # an untimed probe has no cost to charge (`_probe_cost`)
                    self._charge(bucket, probe, self._probe_cost(bucket, rates, best, probe))
                return self.shapes[probe], self.probe_hold
        return self.shapes[best], self.hold

    def _beside(self, best: int) -> list[int]:
        """The shapes either side of `best` in the list, re-timed while it is held, and past the chain where
        the chain is one of them: the chain is no tree, so a tree held beside it, the chain's rate a tie
        with its own, would otherwise never re-time the next tree however much faster it is (simulated:
        trees of 4 held for thousands of steps, a tree of 8 11% faster, measured once on hard text)."""
        beside = []
        for direction in (-1, 1):
            i = best + direction
            while 0 <= i < len(self.shapes):
                beside.append(i)
                if not self.shapes[i].is_chain:
                    break
                i += direction
        return beside

    def _reprobed(self, bucket: int, rates: dict[int, float], best: int, rivals: list[int]) -> int | None:
        """The rival to re-measure now, if any, paid from this bucket's re-probe credit (`reprobe` of its
        timed seconds): the most doubted one (`_doubted`), else the one whose timing is most overdue, once
        older than `_retime_after` of the bucket's steps (the machine's speed drifts; off's tokens are exact,
        so only this and `explore` re-time it). The credit is not capped: a timing taken while the
        machine was slow makes its own re-timing look costly. A new request's re-measurement
        (`requests_arrived`) runs whatever the credit, and is charged to it all the same (the credit may
        go negative): the probes the new text forces replace the re-probes the credit would pay, instead
        of adding to them (traced at batch 1, T=1, 2k-token prompts, where off is right: a fresh engine's
        first 24 requests spent 6 forced probes besides 15 paid ones, ~2% of their time beyond the
        credit's 1.5%)."""
        timed = [i for i in rivals if i in rates]
        rival = self._doubted(bucket, rates, best, timed)
        if rival is not None and _batch_of(bucket) == 0 and self._new_text and self.spread[self.shapes[rival]].steps < FEW_SAMPLES:
            self._new_text = False  # a new request's text, and the rival measured on little text (`requests_arrived`)
            self._charge(bucket, rival, self._probe_cost(bucket, rates, best, rival))
            return rival
        overdue_retime = rival is None
        if rival is None:
            now = self._bucket_steps.get(bucket, 0)
            overdue = {i: (now - self.costs[(bucket, self.shapes[i])].last_step) / self._retime_after(rates, best, i) for i in timed}
            rival = max(overdue, key=overdue.get, default=None)
            if rival is None or overdue[rival] <= 1:
                return None
        extra = self._probe_cost(bucket, rates, best, rival)
        if self.credit.get(bucket, 0.0) < extra:
            return None
        self._charge(bucket, rival, extra)
        if overdue_retime:  # its next timed steps replace the window the drift has aged (`_time`)
            self._retimed.add((bucket, self.shapes[rival]))
        return rival

    def _charge(self, bucket: int, rival: int, seconds: float) -> None:
        """Charge `seconds`, the cost of a probe of `rival` picked now, to the bucket's re-probe credit as
        its steps run (`ProbeCharge`); the credit may go negative (a new request's re-measurement and
        exploration run whatever it holds)."""
        steps = max(1, self.probe_hold)
        self._probe = ProbeCharge(bucket, self.shapes[rival], seconds / steps, steps, steps + 1)

    def _retime_after(self, rates: dict[int, float], best: int, rival: int) -> float:
        """Bucket steps after which `rival`'s timing is re-taken: RETIME_AFTER_STEPS, times the square of
        how many times the held best's rate exceeds the rival's (at least 1). Timings are paired (`_time`),
        so the machine's drift moves all shapes' seconds alike and what ages is only their ratio, which
        drifts little: the further a rival is behind, the less likely drift alone lifts it over the best
        (a stale token estimate is `_doubted`'s to re-measure). Traced at batch 4, T=0, where off runs
        at 2-3x the speculative shapes' rates: re-timed every 512 steps, the chain and the tree of 4
        cost 2% of the run (each probe 30-45 ms over 0.55 s rounds of 128 steps). Off is re-timed at
        RETIME_AFTER_STEPS: its step is the cheapest there is and its tokens are exact, so only a slow
        timing can make it look behind."""
        if self.shapes[rival].is_off:
            return RETIME_AFTER_STEPS
        behind = max(1.0, _ratio(rates[best], rates[rival]))
        return RETIME_AFTER_STEPS * behind * behind  # (a product: inf where a power would raise on overflow)

    def _doubted(self, bucket: int, rates: dict[int, float], best: int, rivals: list[int]) -> int | None:
        """The rival whose upper confidence rate beats the held best by the margin a switch needs, by the
        most (None if none does): `confidence` standard errors (`SampleSpread`, its prior weighing
        `prior_steps` steps; `batched_confidence` and `batched_prior_steps` beyond batch 1) above the
        larger of its token estimate and the longer-memory mean of its samples (an estimate taken in a
        dip of the text is doubted sooner). Off is never doubted: its tokens are exact."""
        # prior: a step's tokens per request range over 1 + [0, most draft tokens a step accepts], and
        # no count in a range of width D varies more than (D / 2)^2
        prior_variance = (max((s.budget for s in self.shapes if s.is_chain), default=self.shapes[-1].budget) / 2) ** 2
        confidence, prior_steps = (self.confidence, self.prior_steps) if _batch_of(bucket) == 0 else (self.batched_confidence, self.batched_prior_steps)
        doubts = {}
        for i in rivals:
            shape = self.shapes[i]
            if not shape.is_off:
                spread, tokens = self.spread[shape], self.expected_tokens(bucket, shape)
                # however old its samples, an estimate of a count confined to a range of width D is not
                # uncertain by more than D / 2: a rival far behind is doubted never, not every few hundred
                # steps as its samples age (re-timing and exploration still re-measure it)
                error = spread.standard_error(prior_variance, prior_steps, self.samples_decay, self._observed_steps)
                error = min(error, math.sqrt(prior_variance))
                upper = max(tokens, spread.recent_mean) + confidence * error
                doubts[i] = _ratio(rates[i] * upper / max(tokens, 1e-9), rates[best] * (1 + self.margin * self._cost(bucket, i, best)))
        rival = max(doubts, key=doubts.get, default=None)
        return rival if rival is not None and doubts[rival] > 1 else None

    def _probe_cost(self, bucket: int, rates: dict[int, float], best: int, rival: int) -> float:
        """Seconds a probe of `rival` costs over the held best: per step the seconds its step takes beyond
        what its tokens would have taken the best (the rate's view), and beyond batch 1 at least its
        extra seconds (the batch's view: a step's tokens are spread over the batch's requests, its
        seconds delay all of them), plus an off step when it switches between speculation and none
        (into a draft pass and back: measured at batch 1). At batch 1 the step's tokens are the one
        request's, so the rate's view is the whole cost: a chain step of 1.9 tokens in 7.4 ms against
        off steps of 3.1 ms costs 1.5 ms over them, not the 4.3 ms it takes longer (traced: charged the
        latter, the credit paid one chain probe per ~250 off steps, and off held whole requests on
        which the chain, at 2.8 tokens per step, was 15% faster)."""
        seconds, best_seconds = self.seconds(bucket, self.shapes[rival]), self.seconds(bucket, self.shapes[best])
        assert seconds is not None and best_seconds is not None  # both have rates
        unproductive = seconds - _ratio(self.expected_tokens(bucket, self.shapes[rival]), rates[best])
        extra = seconds - best_seconds if _batch_of(bucket) != 0 else 0.0
        switches = min(seconds, best_seconds) if self.shapes[rival].is_off != self.shapes[best].is_off else 0.0
        return self.probe_hold * max(0.0, extra, unproductive) + switches

    def _cost(self, bucket: int, shape: int, best: int) -> float:
        """How many of `best`'s steps one step of `shape` costs in this bucket (at least 1; 1 when either
        is untimed). A rival must beat the held best by `margin` times this, and a probe of it is kept
        with probability 1 / this: where a wrong choice or a probe costs several steps (a tree at a large
        batch), the evidence must be stronger and re-timing rarer (exploration's overhead stays about
        `explore` x probe_hold / hold steps whatever the shapes cost). Off costs 1: no step is cheaper
        (one row per request, no draft pass), so a slow timing of it is the machine's, and must not
        make its re-timing rarer."""
        if self.shapes[shape].is_off:
            return 1.0
        mine, theirs = self.costs.get((bucket, self.shapes[shape])), self.costs.get((bucket, self.shapes[best]))
        if mine is None or theirs is None or not mine.values or not theirs.values or theirs.mean <= 0:
            return 1.0
        return max(1.0, mine.mean / theirs.mean)

    def _rates(self, bucket: int) -> dict[int, float]:
        """Rates of this bucket by index in `shapes`: the measured ones, speculative shapes' discounted by
        `batched_discount` at 4 or more requests. A batch's requests progress unevenly under speculation,
        and an offline batch then ends with a tail of steps that run the slowest few requests (measured:
        the chain at batch 4, T=0, 64 tokens each, ran 20 steps of 4 requests and 22 of 1-3, 43% of its
        time; end to end 0.63x no speculation); continuous batching refills the batch instead. The
        per-step rate cannot see which, so at large batches speculation must win by more than ties and
        timing noise before it runs. (Bench, batch 4, T=0, two CPU cores: the fixed chain's tokens per
        request and step over its step time, 2.79 / 11.05 ms, is 1.19x off's 1 / 4.71 ms, yet it runs at
        0.72x no speculation end to end, a discount of 40%: the prompts accept very unevenly, and the
        batch waits for its hardest one. Discounted 20%, the policy's speculation there, its per-step rate
        read at 1.05-1.3x off's, ran 6% slower end to end than off pinned.) From 2-3 requests on down the
        steps run the tail itself, which speculation shortens."""
        rates = {i: rate for i, shape in enumerate(self.shapes) if (rate := self.tokens_per_second(bucket, shape)) is not None}
        if _batch_of(bucket) >= 2:
            rates = {i: rate if self.shapes[i].is_off else rate * (1 - self.batched_discount) for i, rate in rates.items()}
        return rates

    def _followed(self, bucket: int) -> int | None:
        """The held best of an adjacent bucket (the larger batch first, the same context lengths) that has run FOLLOW_STEPS timed
        steps, while this bucket has run fewer; else None (the bucket chooses for itself). A bucket
        visited now and then, such as the few steps of 1-3 requests while an offline batch's requests
        reach the engine one by one, would otherwise spend its rare steps timing the references and
        climbing, each a probe (traced at batch 4, T=1, where off is right: 14 speculative steps in 16
        `generate` calls, in buckets 1 and 2-3)."""
        if self._bucket_steps.get(bucket, 0) >= FOLLOW_STEPS:
            return None
        for other in (bucket + 1, bucket - 1):
            if self._bucket_steps.get(other, 0) >= FOLLOW_STEPS and other in self._best:
                return self._best[other]
        return None

    def _start_index(self, bucket: int) -> int:
        """Where an adjacent measured bucket's best shape is (an adjacent batch bucket, the same context
        lengths); else, when only far batch sizes or other context lengths were measured (whose best says
        little here: trees that pay at batch 1 can cost several times an off step at batch 16, or at 2k
        tokens of context), off, the cheap reference; else (nothing measured) the first tree of >= 8
        nodes (or the cap)."""
        measured = sorted({b for b, _ in self.costs}, key=lambda b: (abs(b - bucket), b))
        for other in (b for b in measured if abs(b - bucket) <= 1):
            if rates := self._rates(other):
                return max(rates, key=rates.get)
        if measured:
            return self.shapes.index(OFF)
        trees = [i for i, shape in enumerate(self.shapes) if shape.topk is None and shape.budget >= 8]
        return trees[0] if trees else len(self.shapes) - 1


@dataclass
class SamplingRegimes:
    """The module's policy kept apart for greedy batches and batches that sample (any request at T > 0):
    one `AdaptiveBudget` each, made with `params` on first use. The runner names the regime of each
    step's batch (`use`) before the step chooses the next step's shape; the choice and the step's own
    observation (reported when the next step starts, before its `use`) go to that regime's policy.

    Acceptance depends on the sampling as much as on the text (greedy trees accept several tokens per
    step where sampling accepts about one), and a policy holding off measures no speculative shape's
    tokens: pooled over regimes, a server that turns from sampled requests back to greedy ones held off
    on estimates from sampled text until re-probes found the trees again (traced at batch 1, the demo
    pair, 8 greedy requests after 32 sampled ones: 354 steps off before trees of 8 held, the 8 requests
    26% slower than the same 8 later). Apart, each regime resumes with its own held shape and estimates,
    its steps' timings re-measuring the machine's speed (`AdaptiveBudget._time`)."""

    shapes: list[TreeShape]
    params: dict[str, float | int] = field(default_factory=dict)
    policies: dict[bool, AdaptiveBudget] = field(default_factory=dict)
    greedy: bool = True

    def use(self, greedy: bool) -> None:
        """This step's batch is greedy (every request at T = 0), or samples."""
        self.greedy = greedy

    @property
    def policy(self) -> AdaptiveBudget:
        """The policy of the regime in use."""
        policy = self.policies.get(self.greedy)
        if policy is None:
            policy = self.policies[self.greedy] = AdaptiveBudget(self.shapes, **self.params)
        return policy

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        return self.policy.choose(num_requests, context_tokens)

    def observe(
        self, num_requests: int, used: TreeShape, seconds: float | None, tokens: dict[TreeShape, float], context_tokens: float = 0.0
    ) -> None:
        self.policy.observe(num_requests, used, seconds, tokens, context_tokens)

    def requests_arrived(self, num_requests: int) -> None:
        """Told to every regime's policy: the new request's regime is not known yet, and new text is new
        to either."""
        for policy in self.policies.values():
            policy.requests_arrived(num_requests)
