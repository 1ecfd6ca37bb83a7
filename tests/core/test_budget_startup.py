"""The adaptive policy started from costs timed when the engine starts (`AdaptiveBudget.seed_costs`):
a bucket ranks its shapes from its first step, its own timed steps replace the start-up costs, and a
policy without a start-up table keeps every rule (tests/core/test_budget.py)."""

from __future__ import annotations

import math

import pytest

from vllm_ddtree.core.budget import OFF, AdaptiveBudget, SamplingRegimes, TreeShape, candidate_shapes, step_bucket
from tests.core.test_budget import reported_shapes

SHAPES = candidate_shapes(16, 7)  # off, tree of 4, chain of 7, trees of 8 and 16
CHAIN = TreeShape(7, 1)
TOKENS = {OFF: 1.0, TreeShape(4): 2.2, CHAIN: 2.4, TreeShape(8): 2.8, TreeShape(16): 3.0}
"""Tokens per request and step of each shape."""
STEP_SECONDS = {
    2: {OFF: 0.003, TreeShape(4): 0.0055, CHAIN: 0.0058, TreeShape(8): 0.006, TreeShape(16): 0.007},  # as batch 1's
    1: {OFF: 0.003, TreeShape(4): 0.0055, CHAIN: 0.0058, TreeShape(8): 0.006, TreeShape(16): 0.007},
    12: {OFF: 0.006, TreeShape(4): 0.016, CHAIN: 0.02, TreeShape(8): 0.022, TreeShape(16): 0.04},
}
"""Engine step seconds per batch size: at batch 1 a tree of 8 commits the most per second (467 tokens/s
against off's 333), at batch 12 off (167 against the tree of 4's 138, before the batched discount)."""
OVERHEAD = 0.001
"""The engine's per-step work the start-up table does not time (its steps are forwards)."""


def startup_table(batches=(1, 12)) -> dict[tuple[int, TreeShape], float]:
    """What the engine's start-up timing would give: each step's seconds less the engine's overhead."""
    return {(batch, shape): STEP_SECONDS[batch][shape] - OVERHEAD for batch in batches for shape in SHAPES}


def fastest(batch: int, discount: float = 0.0) -> TreeShape:
    def rate(shape: TreeShape) -> float:
        return TOKENS[shape] / STEP_SECONDS[batch][shape] * (1.0 if shape.is_off else 1 - discount)

    return max(SHAPES, key=rate)


def learn_tokens(policy: AdaptiveBudget) -> None:
    """One untimed step of the tree of 16 at batch 1 (a shape's first step in a bucket is never timed):
    it reports the tokens of every shape nested in it, and times nothing."""
    policy.observe(1, TreeShape(16), None, {s: TOKENS[s] for s in reported_shapes(SHAPES, TreeShape(16))})


def run(policy: AdaptiveBudget, batch: int, steps: int, seconds: dict[TreeShape, float] | None = None) -> list[TreeShape]:
    seconds = STEP_SECONDS[batch] if seconds is None else seconds
    chosen = []
    for _ in range(steps):
        shape = policy.choose(batch)
        chosen.append(shape)
        policy.observe(batch, shape, seconds[shape], {s: TOKENS[s] * batch for s in reported_shapes(SHAPES, shape)})
    return chosen


def test_a_seeded_policy_takes_the_cheapest_shape_per_token_from_its_first_step():
    """Batch 1: with the start-up costs and the tokens of one untimed step, the first choice is the tree
    of 8, the fastest, and it is held from then on without timing the references (off, the chain) or the
    trees below it (the tree of 16, measured on one step of text, is re-measured as a doubted rival, a
    rule of its own). The same policy without start-up costs first times off and the chain: what the
    table saves."""
    assert fastest(1) == TreeShape(8)
    seeded = AdaptiveBudget(SHAPES, explore=0.0)
    seeded.seed_costs(startup_table())
    learn_tokens(seeded)
    chosen = run(seeded, 1, 40)
    assert chosen[0] == TreeShape(8) and seeded.best_shape(1) == TreeShape(8)
    assert set(chosen) == {TreeShape(8), TreeShape(16)}
    unseeded = AdaptiveBudget(SHAPES, explore=0.0)
    learn_tokens(unseeded)
    assert {OFF, CHAIN} <= set(run(unseeded, 1, 40))  # the references timed


def test_a_seeded_policy_turns_speculation_off_at_a_large_batch_from_its_first_step():
    """Batch 12 (tokens pooled from batch 1): off is the fastest, and the seeded policy runs it from its
    first step of the bucket; unseeded, the bucket times off, the chain and the leader's neighbours
    first (speculative steps at several times off's cost)."""
    assert fastest(12) == OFF
    seeded = AdaptiveBudget(SHAPES, explore=0.0)
    seeded.seed_costs(startup_table())
    learn_tokens(seeded)
    chosen = run(seeded, 12, 60)
    assert chosen[0] == OFF
    assert set(chosen) == {OFF}
    unseeded = AdaptiveBudget(SHAPES, explore=0.0)
    learn_tokens(unseeded)
    assert sum(not s.is_off for s in run(unseeded, 12, 60)) >= 4


def test_the_start_up_costs_are_shifted_by_the_step_overhead_the_bucket_measures():
    """Once off is timed at batch 1, an untimed shape's seconds are its start-up cost plus the overhead
    off's timed steps show over off's start-up cost (an offset, not a factor: the table times forwards,
    and the engine's step adds about as much to every shape)."""
    policy = AdaptiveBudget(SHAPES, explore=0.0)
    policy.seed_costs(startup_table())
    bucket = step_bucket(1, 0.0)
    assert policy.seconds(bucket, TreeShape(8)) == pytest.approx(STEP_SECONDS[1][TreeShape(8)] - OVERHEAD)
    for _ in range(3):  # the first step untimed
        policy.observe(1, OFF, STEP_SECONDS[1][OFF], {OFF: 1.0})
    assert policy.seconds(bucket, OFF) == pytest.approx(STEP_SECONDS[1][OFF])
    assert policy.seconds(bucket, TreeShape(8)) == pytest.approx(STEP_SECONDS[1][TreeShape(8)])
    # a bucket with nothing timed borrows an adjacent batch bucket's offsets, and no farther one's
    policy.seed_costs(startup_table((1, 2, 12)))
    assert policy.seconds(step_bucket(2, 0.0), TreeShape(4)) == pytest.approx(STEP_SECONDS[1][TreeShape(4)])
    assert policy.seconds(step_bucket(12, 0.0), TreeShape(4)) == pytest.approx(STEP_SECONDS[12][TreeShape(4)] - OVERHEAD)


def test_timed_steps_replace_start_up_costs_that_are_wrong():
    """The start-up table says the tree of 8 is the fastest at batch 1; in the engine its step costs twice
    that (a path the table's forwards miss) and the chain is the fastest. The policy starts on the tree,
    times it, times the chain, which its start-up cost puts close behind, within STARTUP_RETIME_STEPS
    steps or so, and moves to it."""
    seconds = dict(STEP_SECONDS[1]) | {TreeShape(8): 0.012, TreeShape(16): 0.014}
    best = max(SHAPES, key=lambda s: TOKENS[s] / seconds[s])
    assert best == CHAIN
    policy = AdaptiveBudget(SHAPES, explore=0.0)
    policy.seed_costs(startup_table())
    learn_tokens(policy)
    chosen = run(policy, 1, 200, seconds)
    assert chosen[0] == TreeShape(8)
    assert chosen.index(CHAIN) < 60
    assert policy.best_shape(1) == CHAIN and TreeShape(8) not in chosen[-100:]


def test_every_regime_starts_from_the_start_up_costs():
    regimes = SamplingRegimes(SHAPES)
    greedy = regimes.policy
    regimes.seed_costs(startup_table())
    regimes.use(greedy=False)
    for policy in (greedy, regimes.policy):
        assert policy.seconds(step_bucket(12, 0.0), OFF) == pytest.approx(STEP_SECONDS[12][OFF] - OVERHEAD)


def test_start_up_costs_of_unknown_shapes_or_no_step_are_left_out():
    policy = AdaptiveBudget(SHAPES)
    policy.seed_costs({(1, TreeShape(32)): 0.01, (1, OFF): math.nan, (1, CHAIN): -1.0, (1, TreeShape(4)): 0.004})
    assert policy.prior == {(0, TreeShape(4)): 0.004}


def test_a_fresh_engines_slow_first_steps_do_not_keep_a_large_batch_off_off():
    """Batch 12, nothing measured yet: the bucket starts on a tree, whose first timed steps carry one-time
    costs (4x). Off is untimed, its start-up cost shifted by speculation's step overhead over the table
    (`_prior_offsets`): the least a speculative shape shows, as one-time costs only add time. With the
    median of a few shapes the slow one set it, off looked dearer than the trees, and a held tree never
    times off: the policy ran trees for hundreds of steps at several times off's cost."""
    assert fastest(12, discount=0.35) == OFF
    policy = AdaptiveBudget(SHAPES, explore=0.0)
    policy.seed_costs(startup_table())
    chosen = []
    for step in range(300):
        shape = policy.choose(12)
        chosen.append(shape)
        seconds = STEP_SECONDS[12][shape] * (4.0 if step < 2 else 1.0)
        policy.observe(12, shape, seconds, {s: TOKENS[s] * 12 for s in reported_shapes(SHAPES, shape)})
    assert policy.best_shape(12) == OFF
    assert sum(not shape.is_off for shape in chosen) <= 30, chosen


def run_lagged(policy: AdaptiveBudget, batch: int, steps: int) -> list[TreeShape]:
    """`run` as the engine feeds the policy: a step is observed when the next one starts (`StepClock`), so
    each choice is made before the step before it is observed; a step followed by one of the other kind
    is observed untimed."""
    chosen: list[TreeShape] = []
    for _ in range(steps):
        shape = policy.choose(batch)
        if chosen:
            last = chosen[-1]
            seconds = None if last.is_off != shape.is_off else STEP_SECONDS[batch][last]
            policy.observe(batch, last, seconds, {s: TOKENS[s] * batch for s in reported_shapes(SHAPES, last)})
        chosen.append(shape)
    return chosen


def test_a_fresh_seeded_bucket_runs_its_start_shape_once_for_its_tokens():
    """Batch 12, nothing measured: the start shape (the tree of 8) runs one step, its seconds being the
    start-up table's; the next choice, made before that step is observed, runs off instead of a second
    probe (a tree's step costs several off steps there), and once the tokens are in, off, the fastest, holds.
    Without a start-up table the start shape is held `probe_hold` steps, to be timed."""
    seeded = AdaptiveBudget(SHAPES, explore=0.0)
    seeded.seed_costs(startup_table())
    chosen = run_lagged(seeded, 12, 60)
    assert chosen[:2] == [TreeShape(8), OFF]
    assert set(chosen[1:]) == {OFF}
    unseeded = AdaptiveBudget(SHAPES, explore=0.0)
    assert run_lagged(unseeded, 12, 2) == [TreeShape(8)] * unseeded.probe_hold


def test_a_start_step_never_observed_is_probed_again():
    """The start shape's step is lost (the engine idled after it, so the clock reports nothing): after the
    off step that follows, observed, the bucket knows off's tokens alone, and probes speculation again
    rather than holding off on no estimate of it."""
    policy = AdaptiveBudget(SHAPES, explore=0.0)
    policy.seed_costs(startup_table())
    assert [policy.choose(12), policy.choose(12)] == [TreeShape(8), OFF]
    policy.observe(12, OFF, None, {OFF: 12.0})
    assert not policy.choose(12).is_off


def test_a_start_step_at_the_first_few_requests_is_not_repeated_at_the_full_batch():
    """A fresh engine's requests reach it one by one: its first step may run 1 request, and the choice for
    the full batch of 12 comes before that step is observed (the clock reports it when the next one
    starts). That choice runs off rather than a second start probe at 12 requests, where a tree's step
    costs several off steps; once the first request's tokens are in, the batch of 12 ranks its shapes."""
    policy = AdaptiveBudget(SHAPES, explore=0.0)
    policy.seed_costs(startup_table())
    assert policy.choose(1) == TreeShape(8)
    assert policy.choose(12) == OFF
    policy.observe(1, TreeShape(8), None, {s: TOKENS[s] for s in reported_shapes(SHAPES, TreeShape(8))})
    assert run(policy, 12, 40) == [OFF] * 40
