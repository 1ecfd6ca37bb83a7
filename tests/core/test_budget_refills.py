"""Whether a batch's departures are refilled (`Refills`), and the tail discount that follows it
(`AdaptiveBudget._rates`): a batch refilled as requests leave runs speculation where its per-step rate
wins; a batch that drains keeps the discount."""

from __future__ import annotations

from vllm_ddtree.core.budget import OFF, AdaptiveBudget, SamplingRegimes, TreeShape, candidate_shapes
from vllm_ddtree.core.budget.refills import DECAY, REFILL_WITHIN_STEPS, Refills

CHAIN = TreeShape(7, 1)


def steps(refills: Refills, count: int) -> None:
    for _ in range(count):
        refills.tick()


def test_an_arrival_soon_after_a_departure_refills_it():
    refills = Refills()
    refills.departed(2, remaining=6)
    steps(refills, 3)
    refills.arrived(1)
    assert refills.refilled_share() == 1 - DECAY  # one refill recorded; the other departure still open
    steps(refills, REFILL_WITHIN_STEPS)
    assert refills.refilled_share() == DECAY * (1 - DECAY)  # the open one expired: not refilled


def test_arrivals_without_departures_refill_nothing():
    refills = Refills()
    refills.arrived(16)  # a batch's first requests
    steps(refills, 5)
    refills.arrived(3)
    assert refills.refilled_share() == 0.0


def test_departures_that_empty_the_batch_are_not_refilled_by_the_next_batch():
    """The last requests of one `generate` call leave in a step that schedules nothing; the next call's
    requests arrive at once, but after a drained batch: no refill."""
    refills = Refills()
    refills.departed(3, remaining=1)
    refills.departed(1, remaining=0)
    refills.arrived(16)
    assert refills.refilled_share() == 0.0


def test_the_share_follows_the_recent_departures():
    refills = Refills()
    for _ in range(30):  # a server: every departure refilled within a step
        refills.departed(1, remaining=7)
        refills.tick()
        refills.arrived(1)
        steps(refills, 4)
    assert refills.refilled_share() > 0.95
    for _ in range(8):  # its load ends: the batch drains
        refills.departed(1, remaining=7)
        steps(refills, 4)
    steps(refills, REFILL_WITHIN_STEPS + 1)
    assert refills.refilled_share() < 0.45


def run_batch_8(policy: AdaptiveBudget | SamplingRegimes, steps_to_run: int, refilled: bool) -> list[TreeShape]:
    """Steps at batch 8 where the chain commits 2.6 tokens per request in twice an off step's seconds (a
    per-step rate 1.3x off's, under the 35% discount); a request leaves every 4 steps, and with
    `refilled` another arrives the step after (a server's closed-loop client), else none does until the
    batch is topped up again after REFILL_WITHIN_STEPS steps (offline batches one after another)."""
    seconds = {OFF: 0.005, CHAIN: 0.010}
    tokens = {OFF: 1.0, CHAIN: 2.6}
    chosen = []
    for step in range(steps_to_run):
        if step % 4 == 0:
            policy.requests_finished(1, remaining=7)
        if refilled and step % 4 == 1:
            policy.requests_arrived(8, 1)
        shape = policy.choose(8)
        chosen.append(shape)
        policy.observe(8, shape, seconds[shape], {shape: tokens[shape] * 8})
    return chosen


def test_a_refilled_batch_runs_speculation_its_per_step_rate_wins_and_a_draining_one_does_not():
    shapes = [OFF, CHAIN]
    for make in (lambda: AdaptiveBudget(shapes, explore=0.0, reprobe=0.0), lambda: SamplingRegimes(shapes)):
        served, draining = make(), make()
        served_choices = run_batch_8(served, 300, refilled=True)
        draining_choices = run_batch_8(draining, 300, refilled=False)
        assert served_choices[-100:].count(CHAIN) >= 95
        assert draining_choices[-100:].count(OFF) >= 95


def test_a_policy_starts_with_the_full_discount():
    """No departure seen yet: a batch is taken to drain until its departures show refills."""
    assert AdaptiveBudget(candidate_shapes(8, 7)).refills.refilled_share() == 0.0
