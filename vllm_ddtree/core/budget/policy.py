"""The adaptive policy: each step, the candidate shape with the best measured throughput in its bucket.

Rules:
- Measure. Seconds per step are kept per shape and bucket (`step_bucket`), except a shape's first step
  in a bucket (one-time costs: new tensor shapes, caches) and the steps the clock reports untimed.
  Tokens committed per request and step are kept per shape, pooled over all buckets: acceptance depends
  on the text, not on the batch, and small buckets see few steps. Every step measures the tokens of the
  shapes read off it as well (`read_off`). The rate of a shape is its tokens over its seconds.
- Time in pairs. A shape's seconds are its cost times the machine's speed now, which the held shape's
  steps measure (`_time`): shapes timed minutes apart on a machine whose speed drifts compare as if
  timed together, and a slow moment during a probe is charged to the machine, not to the probe.
- Climb. A bucket starts where an adjacent measured bucket stands, else at off, else (nothing measured
  anywhere) at the first tree of at least 8 nodes (`_start_index`), for one step where the start-up table
  has its cost (`_start`); it times the references next (off, the cheap one, and the chain: what a user
  would run instead of trees), then the measured leader's untimed neighbours, and takes the best rate. A
  bucket visited rarely follows an adjacent bucket's best until it has run FOLLOW_STEPS steps of its own
  (`_followed`).
- Hold. The best shape is held `hold` steps, a probe `probe_hold`. The held best yields only to a rival
  whose rate beats it by `margin` times how many of its steps one of the rival's costs (`_cost`): timing
  noise between near-equal shapes does not flip the choice, and a costly shape needs stronger evidence.
  At 4 or more requests speculation's rates are discounted by `batched_discount` (`_rates`): a batch's
  requests progress unevenly under speculation, and the tail of steps that run its slowest few is a
  cost no step's rate shows.
- Re-measure. Estimates age (the text changes, the machine drifts), so the held best's rivals (its
  neighbours, and the references) are measured again: a rival whose upper confidence rate would win
  the switch (`_doubted`), else a rival whose timing is overdue (`_retime_after`), paid from a credit
  of `reprobe` of the bucket's timed seconds, each probe charged what it costs over the held best
  (`_probe_cost`) per step of it that runs (`ProbeCharge`). At batch 1 a new request is new text, so
  a rival measured on little text is re-measured even when the credit cannot pay (`requests_arrived`);
  and with probability `explore` a random rival is probed (seeded), so the policy is never stuck.
- At batch 1 a shape not measured for a while is expected to commit what it commits over longer
  stretches (`expected_tokens`): the text's dips end, and off, while it holds, measures nothing else.
- Start from measured costs. Costs timed when the engine starts (`seed_costs`: the target's forward
  and the draft pass, per batch size) stand in for a shape not yet timed in a bucket, shifted by the
  per-step overhead the bucket's timed shapes show over their own start-up costs (`_prior_cost`): the
  start-up table times forwards, not whole engine steps. A shape with a start-up cost and a token
  estimate has a rate before it runs, so a bucket ranks its shapes from its first step instead of
  probing the references and climbing; its own timed steps then replace the start-up cost. Without a
  start-up table (`prior` empty) every rule above holds as stated.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_ddtree.core.budget.estimators import DecayedMean, RecentMedian, SampleSpread
from vllm_ddtree.core.budget.read_off import read_off_shapes
from vllm_ddtree.core.budget.shapes import BATCH_BUCKETS, OFF, TreeShape, batch_bucket, batch_of, step_bucket

SPEED_WINDOW = 3
"""Steps the machine's speed is the median of (`AdaptiveBudget._time`): shorter than a shape's cost
window, so a change of speed moves the speed within two steps, before it can move the held shape's
cost (whose window holds more values)."""

FEW_SAMPLES = 16
"""A rival measured on fewer steps than this is re-measured when a new request arrives at batch 1
(`AdaptiveBudget.requests_arrived`)."""

FOLLOW_STEPS = 32
"""Timed steps before a bucket chooses for itself, while an adjacent bucket has run this many
(`AdaptiveBudget._followed`)."""

STEP_SECONDS = (1e-6, 3600.0)
"""A step timed outside this range counts as untimed (`AdaptiveBudget.observe`): no engine step takes
under a microsecond or over an hour, so such a time is a stopped, stepped or jumping clock, and rates
from it would divide by zero or overflow."""

RETIME_AFTER_STEPS = 512
"""Timings older than this many steps of their bucket are re-taken (the machine's speed drifts).
Counted in the bucket's own steps, not the engine's: the speed its held shape measures when it runs
again carries the drift over the time it did not run, and a bucket visited now and then (an offline
batch between many batch-1 steps) would otherwise re-time its rivals on most visits, where a probe of
speculation costs several off steps and the switches."""

STARTUP_RETIME_STEPS = 32
"""A rival known by its start-up cost alone (`seed_costs`), or timed before its bucket's machine speed
was first measured (`_unframed`), is timed once older than this many of its bucket's steps, times the
square of how far it is behind (`_retime_after`), instead of RETIME_AFTER_STEPS: a start-up cost times
forwards, and the per-step overhead carried over from other shapes (`_prior_cost`) cannot see work a
shape alone does; a timing taken before the speed was measured is raw seconds at whatever speed the
machine ran then (a bucket's first shapes are timed a probe of one or two steps each, minutes before
any speed is known), which paired timing cannot correct. Either is less sure than a timing of its own
in the frame of the bucket's speed."""

CONFIDENCE = 0.75
"""Standard errors above its token estimate at which a rival is doubted at batch 1 (`_doubted`): a step
there brings one request's sample, and its rate is the end-to-end rate."""

BATCHED_CONFIDENCE = 0.5
"""The same beyond batch 1, narrower: a step's rate there overstates what speculation gains the batch
end to end (requests finish at different steps), so the policy asks for more evidence before it
re-probes its way onto speculation, which off, while it holds, never measures."""

PRIOR_STEPS = 8.0
"""Weight, in steps, of the prior variance a shape's sample variance is shrunk towards at batch 1
(`SampleSpread`): a few steps of one request say little about the spread of the next one's."""

BATCHED_PRIOR_STEPS = 2.0
"""The same beyond batch 1, where a step brings one sample per request and a wide prior would doubt
speculation sooner than `BATCHED_CONFIDENCE` means to."""

SAMPLES_DECAY = 0.99
"""Decay per engine step of the samples behind a shape's standard error and longer-memory mean
(`SampleSpread`): a longer memory than the token estimate's (`tokens_decay`), to outlast the text's
dips while still letting an estimate not measured for a while grow doubtful."""


class ProbeCharge(NamedTuple):
    """A probe's cost over the held best (`AdaptiveBudget._probe_cost`), charged to its bucket's
    re-probe credit one step at a time as its steps are observed: `per_step` for each of up to `steps`
    steps of `shape` among the next `window` observed steps (a step is observed one step after the choice
    that shaped it, so a probe held h steps shows within h + 1). A probe picked for a request that
    finishes first (a request of one output token: its step after the choice never comes) costs
    nothing: charged when picked, such probes would drain the credit without measuring anything."""

    bucket: int
    shape: TreeShape
    per_step: float
    steps: int
    window: int


def _ratio(a: float, b: float) -> float:
    """a / b, +inf where b is 0 (a rate or count of 0 comes only from odd inputs: no exception for them)."""
    return a / b if b else math.inf


@dataclass
class AdaptiveBudget:
    """The policy of the module's rules over `shapes` (from `candidate_shapes`)."""

    shapes: list[TreeShape]
    hold: int = 4
    """Steps the best shape is held once chosen."""
    probe_hold: int = 2
    """Steps a shape tried for timing only is held: a bucket's short-lived batch sizes (the tail of a
    batch whose requests finish) must not spend their steps probing. Fed by `StepClock`, at least two:
    a shape held one step between steps of the other kind is never timed."""
    explore: float = 0.02
    """Probability per choice of probing a random rival."""
    margin: float = 0.03
    """Relative margin a rival's rate must beat the held best's by, times how many of the best's steps
    one of its steps costs (`_cost`)."""
    seconds_window: int = 9
    """Timed steps a shape's cost is the median of (`RecentMedian`)."""
    tokens_decay: float = 0.97
    """Decay per engine step of a shape's token estimate (`DecayedMean`): a memory of about thirty
    steps, so a drop in acceptance takes the policy off trees within tens of steps."""
    reprobe: float = 0.015
    """Share of a bucket's timed seconds credited to re-probes (`_reprobed`)."""
    batched_discount: float = 0.35
    """Discount of speculative shapes' rates against off's at 4 or more requests (`_rates`)."""
    seed: int = 0
    """Seed of exploration's generator."""
    tokens: dict[TreeShape, DecayedMean] = field(default_factory=dict)
    spread: dict[TreeShape, SampleSpread] = field(default_factory=dict)
    costs: dict[tuple[int, TreeShape], RecentMedian] = field(default_factory=dict)
    speed: dict[int, RecentMedian] = field(default_factory=dict)
    credit: dict[int, float] = field(default_factory=dict)
    _past_first_step: set[tuple[int, TreeShape]] = field(default_factory=set)
    """(bucket, shape) pairs observed at least once: their later steps are timed (the first is not)."""
    _retimed: set[tuple[int, TreeShape]] = field(default_factory=set)
    _unframed: set[tuple[int, TreeShape]] = field(default_factory=set)
    """(bucket, shape) pairs whose kept seconds were timed before the bucket's speed was first measured
    (`_time`): raw seconds, not costs in the frame of the bucket's speed."""
    _current: TreeShape | None = None
    _bucket: int = -1
    _held: int = 0
    _hold_now: int = 0
    _rng: random.Random | None = None
    _best: dict[int, int] = field(default_factory=dict)
    _observed_steps: int = 0
    _bucket_steps: dict[int, int] = field(default_factory=dict)
    _credited: set[int] = field(default_factory=set)
    """Buckets that have had their initial re-probe credit (`observe`)."""
    _start_pending: int | None = None
    """The observed steps when a start shape was last picked for its tokens alone (`_start`)."""
    _new_text: bool = False
    _probe: ProbeCharge | None = None
    prior: dict[tuple[int, TreeShape], float] = field(default_factory=dict)
    """Start-up costs (`seed_costs`): seconds of a step of a shape, by batch bucket (`batch_of`) and shape,
    for every context length: they are timed at short contexts, and a long-context bucket's offsets
    (`_prior_offsets`) and timed steps carry its attention's growth."""
    _offsets: dict[int, tuple[float, float] | None] = field(default_factory=dict)
    """Per bucket, the step overhead over the start-up costs of (off, speculation) (`_prior_offsets`),
    cleared whenever a cost is timed."""

    def seed_costs(self, seconds: dict[tuple[int, TreeShape], float]) -> None:
        """Start from costs timed when the engine starts: seconds[(num_requests, shape)] of a step of `shape`
        at `num_requests` requests (the module's last rule). Entries of shapes not in `shapes`, and times
        that are no step's (`STEP_SECONDS`), are left out; of several batch sizes in one bucket, the
        largest's."""
        for (num_requests, shape), value in sorted(seconds.items(), key=lambda item: item[0][0]):
            if shape in self.shapes and STEP_SECONDS[0] <= value <= STEP_SECONDS[1]:
                self.prior[batch_bucket(num_requests), shape] = value
        self._offsets.clear()

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
        the rival's estimate rests on fewer than FEW_SAMPLES steps: estimates taken on one request's
        text say little about the next one's. Once a rival has been measured on more text, the credit
        alone pays its re-probes: a probe granted per new request would cost too much where off is
        right."""
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
        if seconds is not None and (bucket, used) in self._past_first_step:
            self._time(bucket, used, seconds)
            initial = 0.0
            if bucket not in self._credited and (batch_of(bucket) == 0 or self._best.get(bucket) == self.shapes.index(used)):
                # a bucket starts with the credit of RETIME_AFTER_STEPS steps: its first estimates, from a
                # few steps each, are the least sure. At batch 1, steps of the first timed shape (a tree:
                # the climb starts there), as its probes are charged what their tokens lose; at a batch,
                # steps of its held best, as its probes are charged the seconds they take over the held
                # best: a tree's step at a large batch costs several off steps, and a credit counted in
                # them would pay for several probes of the whole batch where off holds
                initial = self.reprobe * seconds * RETIME_AFTER_STEPS
                self._credited.add(bucket)
            self.credit[bucket] = self.credit.get(bucket, 0.0) + initial + self.reprobe * seconds
        self._past_first_step.add((bucket, used))
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
            spread.add(count / requests, requests, SAMPLES_DECAY, self._observed_steps)

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
        ran at half speed is charged its cost, not the slowdown, as the held shape's steps around it
        carry the slowdown into the speed.

        A probe's own steps never move the speed: a cost measured wrongly (a slow moment) would
        otherwise explain its next steps away as a change of speed, and never be corrected. The held
        shape's steps never move its own cost: fed both ways, the split of its seconds into cost and
        speed would random-walk, and with it every rival's seconds; the held shape's cost is its first
        full window's, the speed its ratio to now. A rival re-timed because its timing was overdue
        (`_reprobed`) starts a new window: its old values may rest on another frame of speed (taken
        before any shape measured the speed, or divided by a speed a slow spell left behind when the
        held best changed), and diluted by the re-timing's one or two steps they would need several
        re-timings, RETIME_AFTER_STEPS or more apart, to leave the median."""
        if self.prior:
            self._offsets.clear()
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
        key = (bucket, used)
        if len(costs.values) == costs.window and costs.median > 0 and (best is None or self.shapes[best] == used):
            speed.add(seconds / costs.median, self._observed_steps)
            costs.count(step)
            self._unframed.discard(key)  # the cost the speed is measured against: the frame itself
        elif not speed.values:
            costs.add(seconds, step)
            self._unframed.add(key)
        else:
            if key in self._unframed:  # raw seconds of another speed: a new window, in the frame
                self._unframed.discard(key)
                costs.values.clear()
            costs.add(seconds / speed.median, step)

    def seconds(self, bucket: int, shape: TreeShape) -> float | None:
        """A step of `shape` in `bucket` at the machine's speed now (None until timed, unless the start-up
        table has it: `_prior_cost`)."""
        cost = self._cost_of(bucket, shape)
        if cost is None:
            return None
        speed = self.speed.get(bucket)
        return cost * (speed.median if speed is not None and speed.values else 1.0)

    def _cost_of(self, bucket: int, shape: TreeShape) -> float | None:
        """The cost of a step of `shape` in `bucket` (seconds at the speed its costs are kept in): the
        median of its timed steps, else its start-up cost shifted (`_prior_cost`), else None."""
        costs = self.costs.get((bucket, shape))
        if costs is not None and costs.values:
            return costs.median
        return self._prior_cost(bucket, shape) if self.prior else None

    def _prior_cost(self, bucket: int, shape: TreeShape) -> float | None:
        """The start-up cost of `shape` at this bucket's batch size plus the step overhead of its kind
        (`_prior_offsets`), at least the start-up cost's tenth; None without one. The start-up table times
        the target's forward and the draft pass, not the engine's step around them (scheduling, input
        preparation, sampling, the trees' host work), which adds about as much to every shape of a kind;
        so an offset per kind, not a factor, carries a timed shape's step over to its untimed rivals."""
        prior = self.prior.get((batch_of(bucket), shape))
        if prior is None:
            return None
        offsets = self._prior_offsets(bucket)
        offset = 0.0 if offsets is None else offsets[0] if shape.is_off else offsets[1]
        return max(prior + offset, 0.1 * prior)

    def _prior_offsets(self, bucket: int) -> tuple[float, float] | None:
        """(off's, speculation's) step overhead over their start-up costs: the least, over the shapes of a
        kind timed in this bucket, of their cost less their start-up cost (one-time costs only add time: a
        shape timed on its first slow steps must not set it, and off, when it borrows speculation's, is
        never timed while a tree holds); a kind none of whose shapes is timed here takes the other kind's. A bucket where no shape with a start-up cost is timed takes the
        offsets of a neighbour that has one: an adjacent batch bucket of the same context length, else
        the same batch bucket at another context length. No farther: the overhead grows with the batch
        (each request's host work: its tree, its walk), so batch 12's would swamp batch 1's costs. None
        where no neighbour has any (the start-up costs alone then rank the shapes)."""
        if bucket in self._offsets:
            return self._offsets[bucket]
        offsets = self._own_offsets(bucket)
        if offsets is None:
            batch, context = batch_of(bucket), bucket // BATCH_BUCKETS
            near = [b for b, _ in self.costs if b != bucket and (
                (b // BATCH_BUCKETS == context and abs(batch_of(b) - batch) <= 1) or batch_of(b) == batch)]
            near.sort(key=lambda b: (b // BATCH_BUCKETS != context, abs(b // BATCH_BUCKETS - context), b))
            offsets = next((found for b in dict.fromkeys(near) if (found := self._own_offsets(b)) is not None), None)
        self._offsets[bucket] = offsets
        return offsets

    def _own_offsets(self, bucket: int) -> tuple[float, float] | None:
        """`_prior_offsets` from this bucket's timed shapes alone (None if none has a start-up cost)."""
        kinds: tuple[list[float], list[float]] = ([], [])
        for shape in self.shapes:
            costs, prior = self.costs.get((bucket, shape)), self.prior.get((batch_of(bucket), shape))
            if costs is not None and costs.values and prior is not None:
                kinds[0 if shape.is_off else 1].append(costs.median - prior)
        off, speculative = (min(kind) if kind else None for kind in kinds)
        if off is None and speculative is None:
            return None
        return (off if off is not None else speculative, speculative if speculative is not None else off)  # type: ignore[return-value]

    def best_shape(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape | None:
        """The shape this batch's bucket holds as its best (None until it has measurements). Not read by
        the engine, which needs only `choose` (the best or a probe); kept to observe the policy in tests."""
        best = self._best.get(step_bucket(num_requests, context_tokens))
        return None if best is None else self.shapes[best]

    def tokens_per_second(self, bucket: int, shape: TreeShape) -> float | None:
        """Measured tokens per second and request of the batch (ranks the shapes of one bucket), or None
        until the shape has been timed in this bucket (after its untimed first step)."""
        seconds = self.seconds(bucket, shape)
        if shape not in self.tokens or seconds is None or seconds <= 0:
            return None
        return self.expected_tokens(bucket, shape) / seconds

    def expected_tokens(self, bucket: int, shape: TreeShape) -> float:
        """Tokens per request a step of `shape` is expected to commit now: the decayed mean of its last
        steps (the text's stretch it was measured on). At batch 1 a shape not measured for a while is
        expected to commit what it commits over longer stretches: the estimate regresses to the
        longer-memory mean of its samples (`SampleSpread.recent_mean`) with the weight that memory's own
        decay (SAMPLES_DECAY per engine step) has taken from its last steps since. A request's text has
        dips, and off, measuring nothing else while it holds, would otherwise keep a rival at its dip's
        estimate until a re-probe. Larger batches average their requests' dips, and there a step's rate
        overstates what speculation gains end to end (see `_doubted`), so they keep the decayed mean."""
        tokens = self.tokens[shape]
        if batch_of(bucket) != 0:
            return tokens.mean
        kept = SAMPLES_DECAY ** max(0, self._observed_steps - tokens.last_step)
        return kept * tokens.mean + (1 - kept) * self.spread[shape].recent_mean

    def _pick(self, bucket: int) -> tuple[TreeShape, int]:
        """(shape, steps to hold it)."""
        if self._rng is None:
            self._rng = random.Random(self.seed)
        if (followed := self._followed(bucket)) is not None:
            return self.shapes[followed], self.hold
        rates = self._rates(bucket)
        if not rates:
            return self._start(bucket)
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
        # Python's generator, not torch's: a pick runs on the engine's step, and torch's generator costs
        # several times as much per call
        if self._rng.random() < self.explore:  # a neighbour or a reference: never stuck
            probe = self._rng.choice(retimed)
            if self._rng.random() * self._cost(bucket, probe, best) < 1:
                if probe in rates:  # an untimed probe has no cost to charge (`_probe_cost`)
                    self._charge(bucket, probe, self._probe_cost(bucket, rates, best, probe))
                return self.shapes[probe], self.probe_hold
        return self.shapes[best], self.hold

    def _start(self, bucket: int) -> tuple[TreeShape, int]:
        """A bucket without rates (nothing timed, or no token estimate yet): the start shape (`_start_index`),
        held `probe_hold` steps to be timed. A start shape with a start-up cost is run for its tokens alone
        (its seconds are the table's): one step, and a pick made before that step is observed (a step is
        reported when the next one starts, `StepClock`), in any bucket (tokens are pooled over buckets),
        runs off for one step instead of a second probe: at a large batch a tree's step costs several off
        steps, and a fresh engine's first step often runs the few requests that reached it first. If the
        step is never observed (an idle gap), the next pick after an observed step probes again."""
        start = self.shapes[self._start_index(bucket)]
        if start.is_off or (batch_of(bucket), start) not in self.prior:
            return start, self.probe_hold
        if self._start_pending == self._observed_steps:
            return OFF, 1
        self._start_pending = self._observed_steps
        return start, 1

    def _beside(self, best: int) -> list[int]:
        """The shapes either side of `best` in the list, re-timed while it is held, and past the chain where
        the chain is one of them: the chain is no tree, so a tree held beside it, the chain's rate a tie
        with its own, would otherwise never re-time the next tree however much faster it is."""
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
        of adding to them."""
        timed = [i for i in rivals if i in rates]
        rival = self._doubted(bucket, rates, best, timed)
        if rival is not None and batch_of(bucket) == 0 and self._new_text and self.spread[self.shapes[rival]].steps < FEW_SAMPLES:
            self._new_text = False  # a new request's text, and the rival measured on little text (`requests_arrived`)
            self._charge(bucket, rival, self._probe_cost(bucket, rates, best, rival))
            return rival
        overdue_retime = rival is None
        if rival is None:
            now = self._bucket_steps.get(bucket, 0)
            overdue = {i: (now - self._timed_at(bucket, i)) / self._retime_after(rates, best, i, self._provisional(bucket, i)) for i in timed}
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

    def _timed_at(self, bucket: int, shape: int) -> int:
        """The bucket step of the last timing of `shape` in `bucket`; 0 for a shape known by its start-up cost
        alone (a timing taken before the bucket's first step)."""
        costs = self.costs.get((bucket, self.shapes[shape]))
        return costs.last_step if costs is not None else 0

    def _untimed(self, bucket: int, shape: int) -> bool:
        """`shape` has no timed step in `bucket` (its seconds, if any, are its start-up cost's)."""
        costs = self.costs.get((bucket, self.shapes[shape]))
        return costs is None or not costs.values

    def _provisional(self, bucket: int, shape: int) -> bool:
        """`shape`'s seconds in `bucket` are its start-up cost's (`_untimed`) or were timed before the
        bucket's speed was measured (`_unframed`): re-timed after STARTUP_RETIME_STEPS (`_retime_after`)."""
        return self._untimed(bucket, shape) or (bucket, self.shapes[shape]) in self._unframed

    def _charge(self, bucket: int, rival: int, seconds: float) -> None:
        """Charge `seconds`, the cost of a probe of `rival` picked now, to the bucket's re-probe credit as
        its steps run (`ProbeCharge`); the credit may go negative (a new request's re-measurement and
        exploration run whatever it holds)."""
        steps = max(1, self.probe_hold)
        self._probe = ProbeCharge(bucket, self.shapes[rival], seconds / steps, steps, steps + 1)

    def _retime_after(self, rates: dict[int, float], best: int, rival: int, provisional: bool = False) -> float:
        """Bucket steps after which `rival`'s timing is re-taken: RETIME_AFTER_STEPS, times the square of
        how many times the held best's rate exceeds the rival's (at least 1). Timings are paired (`_time`),
        so the machine's drift moves all shapes' seconds alike and what ages is only their ratio, which
        drifts little: the further a rival is behind, the less likely drift alone lifts it over the best
        (a stale token estimate is `_doubted`'s to re-measure), and a probe of a shape far behind is the
        costliest. Off is re-timed at RETIME_AFTER_STEPS: its step is the cheapest there is and its
        tokens are exact, so only a slow timing can make it look behind. A rival whose seconds are
        provisional (`_provisional`: a start-up cost, or raw seconds timed before the bucket's speed was
        measured): STARTUP_RETIME_STEPS instead of RETIME_AFTER_STEPS."""
        steps = STARTUP_RETIME_STEPS if provisional else RETIME_AFTER_STEPS
        if self.shapes[rival].is_off and not provisional:
            return steps
        behind = max(1.0, _ratio(rates[best], rates[rival]))
        return steps * behind * behind  # (a product: inf where a power would raise on overflow)

    def _doubted(self, bucket: int, rates: dict[int, float], best: int, rivals: list[int]) -> int | None:
        """The rival whose upper confidence rate beats the held best by the margin a switch needs, by the
        most (None if none does): CONFIDENCE standard errors (`SampleSpread`, its prior weighing
        PRIOR_STEPS steps; BATCHED_CONFIDENCE and BATCHED_PRIOR_STEPS beyond batch 1) above the
        larger of its token estimate and the longer-memory mean of its samples (an estimate taken in a
        dip of the text is doubted sooner). Off is never doubted: its tokens are exact. Nor is a rival whose
        tokens the held best's steps measure (read off them, `read_off_shapes`, and measured on the last step the
        best ran or since): its estimate and the best's rest on the same text, step for step, so a dip lowers both
        and the comparison of their rates already holds; lifted to its longer mean or by its error, such a
        rival (the chain beside a held tree) would be re-probed in every dip of the text, each probe
        running the shape the paired comparison has just found slower."""
        # prior: a step's tokens per request range over 1 + [0, most draft tokens a step accepts], and
        # no count in a range of width D varies more than (D / 2)^2
        prior_variance = (max((s.budget for s in self.shapes if s.is_chain), default=self.shapes[-1].budget) / 2) ** 2
        confidence, prior_steps = (CONFIDENCE, PRIOR_STEPS) if batch_of(bucket) == 0 else (BATCHED_CONFIDENCE, BATCHED_PRIOR_STEPS)
        doubts = {}
        held = self.shapes[best]
        nested, chain = read_off_shapes(self.shapes, held, held.budget)
        paired, held_at = {*nested, chain}, self.tokens[held].last_step
        for i in rivals:
            shape = self.shapes[i]
            if not shape.is_off and not (shape in paired and self.tokens[shape].last_step >= held_at):
                spread, tokens = self.spread[shape], self.expected_tokens(bucket, shape)
                # however old its samples, an estimate of a count confined to a range of width D is not
                # uncertain by more than D / 2: a rival far behind is doubted never, not every few hundred
                # steps as its samples age (re-timing and exploration still re-measure it)
                error = spread.standard_error(prior_variance, prior_steps, SAMPLES_DECAY, self._observed_steps)
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
        (into a draft pass and back). At batch 1 the step's tokens are the one request's, so the rate's
        view is the whole cost: a probe that commits more tokens per step than the best costs less than
        the seconds it takes longer, and charged those, a rival close to the best would be re-probed too
        rarely."""
        seconds, best_seconds = self.seconds(bucket, self.shapes[rival]), self.seconds(bucket, self.shapes[best])
        assert seconds is not None and best_seconds is not None  # both have rates
        unproductive = seconds - _ratio(self.expected_tokens(bucket, self.shapes[rival]), rates[best])
        extra = seconds - best_seconds if batch_of(bucket) != 0 else 0.0
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
        mine, theirs = self._cost_of(bucket, self.shapes[shape]), self._cost_of(bucket, self.shapes[best])
        if mine is None or theirs is None or theirs <= 0:
            return 1.0
        return max(1.0, mine / theirs)

    def _rates(self, bucket: int) -> dict[int, float]:
        """Rates of this bucket by index in `shapes`: the measured ones, speculative shapes' discounted by
        `batched_discount` at 4 or more requests. A batch's requests progress unevenly under speculation,
        and an offline batch then ends with a tail of steps that run the slowest few requests, which
        no step's rate shows (the batch waits for its hardest prompt); continuous batching refills the
        batch instead. The per-step rate cannot see which, so at large batches speculation must win by
        more than ties and timing noise before it runs. From 2-3 requests on down the steps run the
        tail itself, which speculation shortens."""
        rates = {i: rate for i, shape in enumerate(self.shapes) if (rate := self.tokens_per_second(bucket, shape)) is not None}
        if batch_of(bucket) >= 2:
            rates = {i: rate if self.shapes[i].is_off else rate * (1 - self.batched_discount) for i, rate in rates.items()}
        return rates

    def _followed(self, bucket: int) -> int | None:
        """The held best of an adjacent bucket (the larger batch first, the same context lengths) that has
        run FOLLOW_STEPS timed steps, while this bucket has run fewer; else None (the bucket chooses for
        itself). A bucket visited now and then, such as the few steps of 1-3 requests while an offline
        batch's requests reach the engine one by one, would otherwise spend its rare steps timing the
        references and climbing, each a probe."""
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

