"""The adaptive policy (`AdaptiveBudget`, `SamplingRegimes`): the climb, holding, buckets, paired timing,
the re-measurement of rivals, and convergence to the fastest shape, against simulated step costs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.core.budget import (
    FOLLOW_STEPS,
    OFF,
    AdaptiveBudget,
    SamplingRegimes,
    TreeShape,
    batch_bucket,
    candidate_shapes,
    nested_shapes,
)
from vllm_ddtree.core.budget.policy import RETIME_AFTER_STEPS, SAMPLES_DECAY, STARTUP_RETIME_STEPS

MEMORY = round(1 / (1 - SAMPLES_DECAY))
"""Engine steps a rival's samples are remembered for (the time constant of SAMPLES_DECAY): the scale
on which an estimate the held shape cannot refresh grows doubtful and regresses to its longer-memory
mean, so the scale of the bounds on how long a stale estimate can keep the policy off a faster shape."""


def test_a_longer_context_is_timed_apart_instead_of_holding_the_short_contexts_best():
    """Trees win at short contexts; at 2k tokens of context a tree's step grows more than off's (its rows'
    attention), so off wins there. The policy, its costs kept per context length, holds off at 2k after
    a few probes instead of carrying the short context's ratios over (paired timing would scale every
    shape by the held tree's slowdown), and resumes the tree when short contexts return."""
    shapes = candidate_shapes(16, 7)
    tokens = {OFF: 1.0, TreeShape(4): 2.2, TreeShape(7, 1): 2.4, TreeShape(8): 2.8, TreeShape(16): 3.0}
    seconds = {"short": {OFF: 0.003, TreeShape(4): 0.0055, TreeShape(7, 1): 0.0058, TreeShape(8): 0.006, TreeShape(16): 0.007},
               "long": {OFF: 0.007, TreeShape(4): 0.021, TreeShape(7, 1): 0.024, TreeShape(8): 0.026, TreeShape(16): 0.03}}
    context = {"short": 128.0, "long": 1900.0}
    policy = AdaptiveBudget(shapes, seed=3)
    phases = {}
    for phase in ("short", "long", "short"):
        chosen = []
        for _ in range(600):
            shape = policy.choose(1, context[phase])
            chosen.append(shape)
            policy.observe(1, shape, seconds[phase][shape], {s: tokens[s] for s in reported_shapes(shapes, shape)}, context[phase])
        phases.setdefault(phase, []).append(chosen)
    first_short, long, second_short = phases["short"][0], phases["long"][0], phases["short"][1]
    fastest = {phase: max(shapes, key=lambda s: tokens[s] / seconds[phase][s]) for phase in seconds}
    assert fastest == {"short": TreeShape(8), "long": OFF}
    assert policy.best_shape(1, context["short"]) == TreeShape(8) and policy.best_shape(1, context["long"]) == OFF
    assert sum(s == TreeShape(8) for s in first_short[-300:]) >= 270
    assert sum(not s.is_off for s in long) <= 20  # learning the new bucket: a few probes, not hundreds of tree steps
    assert sum(s == TreeShape(8) for s in second_short[:50]) >= 40  # the short contexts' best kept


def simulate(policy: AdaptiveBudget, rates: dict[TreeShape, float], steps: int, num_requests: int = 4) -> list[TreeShape]:
    """Run the policy against a fixed throughput per shape and request (tokens/step / seconds/step; at
    rates near 100, about a token per request and step, as a step commits at least one). Tests of the
    climb's mechanics at batch 4 or more set `batched_discount` to 0 (their rates differ by 10%)."""
    chosen = []
    for _ in range(steps):
        shape = policy.choose(num_requests)
        chosen.append(shape)
        policy.observe(num_requests, shape, 0.01, {shape: rates[shape] * 0.01 * num_requests})
    return chosen


def test_climbs_to_the_fastest_shape_without_trying_far_ones():
    shapes = candidate_shapes(64, 7)  # off, 4, chain of 7, 8, 16, 32, 64
    peak = shapes.index(TreeShape(16))
    rates = {s: 100.0 - 10 * abs(i - peak) for i, s in enumerate(shapes)}
    policy = AdaptiveBudget(shapes, hold=3, probe_hold=3, explore=0.0, reprobe=0.0, batched_discount=0.0)
    chosen = simulate(policy, rates, 60)
    assert chosen[0] == TreeShape(8)  # start: the first tree of >= 8 nodes
    assert chosen[3:6] == [TreeShape(0, 1)] * 3  # then off, the reference
    assert all(chosen[3 * i] == chosen[3 * i + 1] == chosen[3 * i + 2] for i in range(20))  # held 3 steps
    assert set(chosen[-30:]) == {TreeShape(16)}
    assert TreeShape(64) not in chosen and TreeShape(4) not in chosen


def test_probes_briefly_and_a_new_batch_size_starts_where_an_adjacent_one_stands():
    shapes = candidate_shapes(64, 7)  # off, 4, chain of 7, 8, 16, 32, 64
    rates = {s: 100.0 - 10 * abs(i - 2) for i, s in enumerate(shapes)}  # the chain is fastest
    policy = AdaptiveBudget(shapes, hold=4, probe_hold=2, explore=0.0, reprobe=0.0, batched_discount=0.0)
    chosen = simulate(policy, rates, 40, num_requests=16)
    assert chosen[:2] == [TreeShape(8)] * 2 and chosen[6:8] == [TreeShape(7, 1)] * 2  # probes: 2 steps each
    assert chosen[2:6] == [TreeShape(0, 1)] * 4  # off, the reference, is timed over a full hold
    assert chosen[-4:] == [TreeShape(7, 1)] * 4
    assert simulate(policy, rates, 1, num_requests=8)[0] == TreeShape(7, 1)  # bucket 8-15 starts at 16's best
    assert simulate(policy, rates, 1, num_requests=1)[0] == OFF  # a far bucket starts at the cheap reference


def test_walks_down_to_off_when_speculation_does_not_pay():
    shapes = candidate_shapes(64, 7)
    policy = AdaptiveBudget(shapes, explore=0.0, reprobe=0.0)
    chosen = simulate(policy, {s: 100.0 - s.budget for s in shapes}, 60)
    assert set(chosen[-15:]) == {TreeShape(0, 1)}
    assert TreeShape(64) not in chosen


def test_switches_when_the_fastest_shape_changes_and_falls_back_to_off():
    shapes = candidate_shapes(16, 7)
    policy = AdaptiveBudget(shapes, explore=0.1, seconds_window=5, tokens_decay=0.8)
    simulate(policy, {s: 100.0 + s.budget for s in shapes}, 200)  # big trees pay (100.0 + budget)
    falling = {s: 100.0 - s.budget for s in shapes}  # now nothing pays
    late = simulate(policy, falling, 400)[-100:]
    assert policy.best_shape(4) == OFF
    assert sum(falling[s] for s in late) >= 0.98 * 100 * falling[OFF]  # re-probes of near ties cost little


def test_batch_sizes_are_timed_separately_and_share_tokens():
    """Trees pay at batch 1 but not at 16, where their verify costs more than the chain's; tokens per
    request are the same at any batch size, so either bucket's steps measure them for both."""
    shapes = candidate_shapes(8, 7)
    policy = AdaptiveBudget(shapes, explore=0.0, reprobe=0.0)
    tokens = {TreeShape(0, 1): 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 2.2, TreeShape(8): 2.5}
    seconds = {1: {s: 0.01 for s in shapes}, 16: {TreeShape(0, 1): 0.01, TreeShape(4): 0.02, TreeShape(7, 1): 0.012, TreeShape(8): 0.03}}
    for _ in range(60):
        for n in (1, 16):
            shape = policy.choose(n)
            policy.observe(n, shape, seconds[n][shape], {s: n * tokens[s] for s in nested_shapes(shapes, shape)})
    assert policy.choose(1) == TreeShape(8)
    assert policy.choose(16) == TreeShape(7, 1)
    assert policy.tokens[TreeShape(4)].mean == pytest.approx(2.0)


def test_a_rarely_visited_bucket_holds_its_neighbours_best_until_it_has_run_enough_steps():
    """Batch 4's bucket has settled on off; the few steps of 2 requests (an offline batch's requests
    reaching the engine one by one) hold off too, probing nothing, until their bucket has run
    FOLLOW_STEPS timed steps; then it times the references itself (the chain first)."""
    shapes = candidate_shapes(8, 7)
    policy = AdaptiveBudget(shapes, explore=0.0)
    tokens = {TreeShape(0, 1): 1.0, TreeShape(4): 1.2, TreeShape(7, 1): 1.3, TreeShape(8): 1.4}
    seconds = {TreeShape(0, 1): 0.01, TreeShape(4): 0.03, TreeShape(7, 1): 0.03, TreeShape(8): 0.04}

    def step(n: int) -> TreeShape:
        shape = policy.choose(n)
        policy.observe(n, shape, seconds[shape], {s: n * tokens[s] for s in nested_shapes(shapes, shape)})
        return shape

    for _ in range(200):
        step(4)
    assert policy.best_shape(4) == OFF
    assert [step(2) for _ in range(FOLLOW_STEPS)] == [OFF] * FOLLOW_STEPS
    assert TreeShape(7, 1) in [step(2) for _ in range(8)]  # its own choice from here on


def test_exploration_is_seeded():
    shapes = candidate_shapes(64, 7)
    rates = {s: float(i) for i, s in enumerate(shapes)}
    runs = [simulate(AdaptiveBudget(shapes, explore=0.3, seed=5, batched_discount=0.0), rates, 200) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0][-120:])) > 1  # exploration does leave the best shape
    assert sum(s == max(rates, key=rates.get) for s in runs[0][-120:]) / 120 > 0.6


def test_counterfactual_tokens_need_only_timing_to_compare():
    """Tokens of nested trees come with every step of the big one; a shape is ranked once it is timed
    (its first step in a bucket is not timed)."""
    shapes = candidate_shapes(16, 7)
    policy = AdaptiveBudget(shapes, explore=0.0, reprobe=0.0)
    tokens = {TreeShape(0, 1): 1.0, TreeShape(4): 2.0, TreeShape(8): 2.5, TreeShape(16): 2.6}
    policy.observe(1, TreeShape(16), 0.5, tokens)  # first step: one-time costs, not timed
    assert policy.tokens_per_second(0, TreeShape(16)) is None
    policy.observe(1, TreeShape(16), 0.02, tokens)
    assert policy.tokens_per_second(0, TreeShape(16)) == pytest.approx(2.6 / 0.02)
    assert policy.tokens_per_second(0, TreeShape(8)) is None  # counted, not yet timed
    for _ in range(2):
        policy.observe(1, TreeShape(8), 0.01, {s: tokens[s] for s in nested_shapes(shapes, TreeShape(8))})
    assert policy.tokens_per_second(0, TreeShape(8)) == pytest.approx(2.5 / 0.01)
    assert policy.tokens_per_second(1, TreeShape(8)) is None  # another batch bucket: its own first step


def held_best_changes(margin: float, seed: int) -> int:
    """Changes of the held best shape over 300 steps (after 100), for two equally fast shapes timed with
    +-5% noise per step and re-timed often (explore 0.3)."""
    shapes = candidate_shapes(16, 7)  # off, 4, chain 7, 8, 16
    rates = {s: 10.0 for s in shapes}
    rates[TreeShape(8)] = rates[TreeShape(16)] = 100.0
    rng = random.Random(seed)
    policy = AdaptiveBudget(shapes, hold=2, probe_hold=1, explore=0.3, margin=margin, seed=seed)
    held = []
    for _ in range(400):
        shape = policy.choose(4)
        held.append(policy.best_shape(4))
        policy.observe(4, shape, 0.01 * (1 + rng.uniform(-0.05, 0.05)), {shape: rates[shape] * 0.01 * 4})
    tail = held[-300:]
    assert tail[-1] in (TreeShape(8), TreeShape(16))
    return sum(a != b for a, b in zip(tail, tail[1:]))


def test_equal_shapes_do_not_flip_flop_under_timing_noise():
    """The best shape the policy holds stays put under timing noise (hysteresis): over 10 seeds, at most
    2 changes in 300 steps on average, and at most a fifth as many as without the margin (the held
    shape's cost is steady, as its steps measure the machine's speed)."""
    with_margin = [held_best_changes(0.03, seed) for seed in range(10)]
    without = [held_best_changes(0.0, seed) for seed in range(10)]
    assert sum(with_margin) <= 2 * len(with_margin) and 5 * sum(with_margin) <= sum(without), (with_margin, without)


def test_an_unlucky_early_timing_of_off_does_not_keep_it_out():
    """Off is timed once while the machine is slow (10x), then is really the fastest shape: re-timing
    (exploration includes off, not only the best shape's neighbours) brings the policy to it."""
    shapes = candidate_shapes(32, 7)  # off, 4, chain 7, 8, 16, 32
    rates = {s: 100.0 for s in shapes}
    rates[TreeShape(0, 1)], rates[TreeShape(7, 1)] = 200.0, 120.0
    policy = AdaptiveBudget(shapes, hold=2, probe_hold=2, explore=0.1, seed=1)
    first_off = True
    chosen = []
    for _ in range(600):
        shape = policy.choose(16)
        chosen.append(shape)
        slow = 10.0 if shape == TreeShape(0, 1) and first_off else 1.0
        policy.observe(16, shape, 0.01 * slow, {shape: rates[shape] * 0.01})
        if shape == TreeShape(0, 1) and slow > 1:
            first_off = policy.costs.get((batch_bucket(16), shape)) is None
    assert policy.best_shape(16) == TreeShape(0, 1)
    assert chosen[-100:].count(TreeShape(0, 1)) > 80


def test_a_drop_in_acceptance_takes_the_policy_off_trees_within_a_few_dozen_steps():
    """Greedy code accepts long paths (trees pay), then sampling at T > 0 accepts few: the tree's token
    estimate must follow within tens of steps (`tokens_decay`). At batch 1 a shape off has not
    measured for a while regresses to its longer-memory mean (a dip in the text ends:
    `expected_tokens`), so after a lasting drop the policy still returns to a tree for a few steps now
    and then, but holds off on at least 80 of every 100 steps."""
    shapes = candidate_shapes(16, 7)  # off, 4, chain of 7, 8, 16
    policy = AdaptiveBudget(shapes, explore=0.05)
    seconds = {s: 0.01 * (1 + s.budget / 16) for s in shapes}  # a tree of 16 costs twice an off step

    def run(tokens: dict[TreeShape, float], steps: int) -> list[TreeShape]:
        chosen = []
        for _ in range(steps):
            shape = policy.choose(1)
            chosen.append(shape)
            policy.observe(1, shape, seconds[shape], {s: tokens[s] for s in nested_shapes(shapes, shape)})
        return chosen

    budgets = {s: s.budget for s in shapes}
    greedy = {s: 1.0 + 2.5 * min(1.0, budgets[s] / 8) for s in shapes}  # tree 16: 3.5 tokens in 0.02 s > off
    sampled = {s: 1.0 + 0.5 * min(1.0, budgets[s] / 16) for s in shapes}  # tree 16: 1.5 tokens: off is best
    assert run(greedy, 300)[-50:].count(OFF) < 10
    after = run(sampled, 300)
    assert after[100:200].count(OFF) >= 80 and after[200:].count(OFF) >= 80


BATCH1_SECONDS = {OFF: 0.0029, TreeShape(4): 0.0068, TreeShape(7, 1): 0.0061, TreeShape(8): 0.0075, TreeShape(16): 0.0085, TreeShape(32): 0.010}
"""Step seconds per shape at batch 1: off cheapest, the trees growing with their nodes, the chain
between the trees of 4 and 8 (the proportions of the engine's steps on the demo pair)."""


def reported_shapes(shapes: list[TreeShape], shape: TreeShape) -> list[TreeShape]:
    """The shapes a simulated step of `shape` reports tokens for: the nested ones and, off a tree of 8
    or more nodes, the chain of 7 (as `accepted_by_shape` reads it off the walk)."""
    return nested_shapes(shapes, shape) + ([TreeShape(7, 1)] if shape.topk is None and shape.budget >= 8 else [])


def steps_until_the_chain_is_held(policy: AdaptiveBudget, dry_steps: int = 100, limit: int = 1500) -> int | None:
    """Batch 1 (off 2.3 ms a step, the chain 5.3 ms): for `dry_steps` no shape accepts a draft
    token (off is best), then the chain accepts 2 per step (3 tokens: 1.3x off's rate). Steps after the
    change until the policy holds the chain (None: not within `limit`)."""
    shapes = policy.shapes
    seconds = {OFF: 0.0023, TreeShape(4): 0.0062, TreeShape(7, 1): 0.0053, TreeShape(8): 0.007}
    later = {OFF: 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 3.0, TreeShape(8): 3.0}
    for step in range(dry_steps + limit):
        shape = policy.choose(1)
        if step >= dry_steps and policy.best_shape(1) == TreeShape(7, 1):
            return step - dry_steps
        tokens = later if step >= dry_steps else dict.fromkeys(later, 1.0)
        policy.observe(1, shape, seconds[shape], {s: tokens[s] for s in reported_shapes(shapes, shape)})
    return None


def test_an_estimate_gone_stale_is_measured_again_within_a_bounded_number_of_steps():
    """A shape measured while the text accepted nothing keeps that estimate while off holds (off steps
    measure nothing else). Its samples age, its standard error grows, and once its upper confidence
    rate would win, the re-probe credit re-measures it: the policy holds the chain within one and a half
    MEMORY of the change on every seed (the chain's samples lose their weight on that scale, and its
    standard error grows as they do). Random exploration alone keeps it off for longer than twice
    MEMORY: it picks the chain with probability `explore` / 2 rivals (the tree of 4, the chain) / its
    cost in off steps (2.3) per choice of off held 4 steps, about once per thousand steps."""
    shapes = candidate_shapes(8, 7)  # off, 4, chain 7, 8
    with_reprobes = [steps_until_the_chain_is_held(AdaptiveBudget(shapes, seed=seed)) for seed in range(5)]
    without = [steps_until_the_chain_is_held(AdaptiveBudget(shapes, seed=seed, reprobe=0.0)) for seed in range(5)]
    assert all(steps is not None and steps <= 1.5 * MEMORY for steps in with_reprobes), with_reprobes
    assert all(steps is None or steps > 2 * MEMORY for steps in without), without


def steps_until_the_chain_is_held_after_a_slow_start(policy: AdaptiveBudget, slow_steps: int = 12, limit: int = 1500) -> int | None:
    """Batch 1: for the first `slow_steps` steps every shape accepts fewer draft tokens than later (a
    request's first output tokens: the chain 1.4 tokens per step there, 3.4 afterwards), so off leads
    when the candidates are first timed; afterwards the chain
    is the fastest shape. Steps after the slow start until the policy holds the chain (None: not within
    `limit`)."""
    chain = TreeShape(7, 1)
    seconds = {OFF: 0.00285, TreeShape(4): 0.0093, chain: 0.0075, TreeShape(8): 0.0101, TreeShape(16): 0.012, TreeShape(32): 0.014}
    first = {OFF: 1.0, TreeShape(4): 2.0, chain: 1.4, TreeShape(8): 2.3, TreeShape(16): 2.4, TreeShape(32): 2.5}
    later = {OFF: 1.0, TreeShape(4): 2.7, chain: 3.4, TreeShape(8): 3.5, TreeShape(16): 3.7, TreeShape(32): 3.8}
    for step in range(slow_steps + limit):
        shape = policy.choose(1)
        if step >= slow_steps and policy.best_shape(1) == chain:
            return step - slow_steps
        tokens = later if step >= slow_steps else first
        policy.observe(1, shape, seconds[shape], {s: tokens[s] for s in reported_shapes(policy.shapes, shape)})
    return None


def test_a_slow_start_does_not_keep_the_policy_off_for_hundreds_of_steps():
    """Estimates taken on a request's first steps are re-measured soon: the policy holds the chain within
    MEMORY steps of the slow start on every seed, not for hundreds of steps on the first steps'
    estimates."""
    shapes = candidate_shapes(32, 7)
    steps = [steps_until_the_chain_is_held_after_a_slow_start(AdaptiveBudget(shapes, seed=seed)) for seed in range(5)]
    assert all(n is not None and n <= MEMORY for n in steps), steps


def steps_until_off_is_held(policy: AdaptiveBudget, steps: int = 2000) -> int | None:
    """Batch 16: off is the fastest shape (150 against the chain's 120 and 100 for the others), but the
    machine runs at half speed while off is first timed (the first 50 steps). The first step from which
    the policy holds off for 50 steps (None: never)."""
    rates = {s: 100.0 for s in policy.shapes}
    rates[OFF], rates[TreeShape(7, 1)] = 150.0, 120.0
    chosen = []
    for step in range(steps):
        shape = policy.choose(16)
        chosen.append(shape)
        slow = 2.0 if shape == OFF and step < 50 else 1.0
        policy.observe(16, shape, 0.01 * slow, {shape: rates[shape] * 0.01 * 16})
    return next((i for i in range(len(chosen)) if all(s == OFF for s in chosen[i : i + 50])), None)


def steps_until_the_chain_is_held_after_a_dip(policy: AdaptiveBudget, before: int = 200, dip: int = 60, limit: int = 1500) -> int | None:
    """Batch 1: the chain is the fastest shape, except during a `dip` of the
    text (steps where no shape accepts more than 0.2 draft tokens: off is best). Steps after the dip
    until the policy holds the chain or a tree of 8 again (None: not within `limit`)."""
    chain = TreeShape(7, 1)
    normal = {OFF: 1.0, TreeShape(4): 2.7, chain: 3.4, TreeShape(8): 3.5, TreeShape(16): 3.6, TreeShape(32): 3.7}
    dipped = {**dict.fromkeys(normal, 1.2), OFF: 1.0}
    for step in range(before + dip + limit):
        shape = policy.choose(1)
        if step >= before + dip and policy.best_shape(1) in (chain, TreeShape(8)):
            return step - before - dip
        tokens = dipped if before <= step < before + dip else normal
        policy.observe(1, shape, BATCH1_SECONDS[shape], {s: tokens[s] for s in reported_shapes(policy.shapes, shape)})
    return None


def test_a_dip_in_the_text_does_not_keep_the_policy_off_for_hundreds_of_steps():
    """After a dip (off best for its last steps), the rivals' estimates regress to their longer-memory
    means as they age (`expected_tokens`, on the scale of MEMORY): the policy holds a speculative shape
    again within MEMORY steps of the dip's end on every seed, instead of keeping the rivals' dip
    estimates until a re-probe."""
    shapes = candidate_shapes(32, 7)
    steps = [steps_until_the_chain_is_held_after_a_dip(AdaptiveBudget(shapes, seed=seed)) for seed in range(6)]
    assert all(n is not None and n <= MEMORY for n in steps), steps


def test_a_rival_read_off_the_held_tree_is_not_re_probed_in_every_dip_of_the_text():
    """Batch 1, the realistic-cost pair's proportions (a tree of 8 dearer than the chain by 7%, accepting
    30% more draft tokens on every step): the text alternates easy stretches and dips of 50 steps, and
    the tree of 8 is the fastest shape on every step of both. The chain and the tree of 4 are read off
    the tree's steps, so their estimates fall with the tree's in a dip: they are not doubted
    (`_doubted`), and run on at most 2% of the steps (exploration and the tree of 16's probes, whose
    steps report them too). Doubted like a rival the held shape does not measure, each dip lifted them
    to their longer means and re-probed them: 8-70% of the steps on these seeds."""
    shapes = candidate_shapes(32, 7)
    chain = TreeShape(7, 1)
    seconds = {OFF: 0.074, TreeShape(4): 0.090, chain: 0.093, TreeShape(8): 0.100, TreeShape(16): 0.114, TreeShape(32): 0.140}
    gain = {OFF: 0.0, TreeShape(4): 0.95, chain: 1.0, TreeShape(8): 1.3, TreeShape(16): 1.35, TreeShape(32): 1.4}
    for seed in range(6):
        policy, text = AdaptiveBudget(shapes, seed=seed), random.Random(100 + seed)
        chosen = []
        for step in range(2000):
            shape = policy.choose(1)
            chosen.append(shape)
            drafted = (2.0 if (step // 50) % 2 == 0 else 0.6) * text.uniform(0.3, 1.7)  # the chain's accepted drafts
            tokens = {s: 1 + gain[s] * drafted for s in shapes}
            policy.observe(1, shape, seconds[shape], {s: tokens[s] for s in reported_shapes(shapes, shape)})
        read_off = sum(s in (chain, TreeShape(4)) for s in chosen[200:])
        assert read_off <= 0.02 * len(chosen[200:]), (seed, read_off)


def test_at_large_batches_speculation_must_win_by_more_than_its_per_step_rate():
    """At 4 or more requests a speculative shape's rate is discounted by `batched_discount` (35%) against
    off (an offline batch's tail: `AdaptiveBudget._rates`): the chain 30% faster per step than off is
    not taken at batch 4 or 16, 60% faster is; at 2-3 requests (the tail's own steps) and at batch 1,
    15% faster is taken."""

    def held(num_requests: int, chain_rate: float) -> TreeShape | None:
        shapes = candidate_shapes(8, 7)  # off, 4, chain 7, 8
        rates = {s: 50.0 for s in shapes}
        rates[OFF], rates[TreeShape(7, 1)] = 100.0, chain_rate
        policy = AdaptiveBudget(shapes, explore=0.0, reprobe=0.0)
        simulate(policy, rates, 80, num_requests=num_requests)
        return policy.best_shape(num_requests)

    for num_requests in (4, 16):
        assert held(num_requests, 130.0) == OFF
        assert held(num_requests, 160.0) == TreeShape(7, 1)
    for num_requests in (1, 2):
        assert held(num_requests, 115.0) == TreeShape(7, 1)


def test_a_batchs_first_re_probe_credit_is_counted_in_steps_of_the_shape_it_holds():
    """At 16 requests off holds (each tree's step costs 3-7 off steps), and the bucket's first timed
    steps are the climb's trees. Its initial re-probe credit is RETIME_AFTER_STEPS steps of off, the
    shape it holds, not of the first timed step: counted in a tree's step it would pay for several
    re-timings of whole-batch trees while the batch holds off (the engine spent ~30% of a batch's
    rounds on them). Once off holds, the credit is at most `reprobe` x (RETIME_AFTER_STEPS off steps +
    the seconds timed so far)."""
    shapes = candidate_shapes(8, 7)  # off, 4, chain 7, 8
    seconds = {OFF: 0.004, TreeShape(4): 0.014, TreeShape(7, 1): 0.014, TreeShape(8): 0.015}
    tokens = {OFF: 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 2.5, TreeShape(8): 2.8}
    policy = AdaptiveBudget(shapes, explore=0.0)
    timed = 0.0
    for _ in range(40):
        shape = policy.choose(16)
        policy.observe(16, shape, seconds[shape], {s: 16 * tokens[s] for s in reported_shapes(shapes, shape)})
        timed += seconds[shape]
    bucket = batch_bucket(16)
    assert policy.best_shape(16) == OFF
    assert policy.credit[bucket] <= policy.reprobe * (RETIME_AFTER_STEPS * seconds[OFF] + timed)


def test_a_bucket_visited_now_and_then_does_not_re_time_its_rivals_on_every_visit():
    """An offline batch of 16 (64 steps) between stretches of 700 batch-1 steps, off clearly the best at
    16: timings age by the bucket's own steps, so after its first visit the batch of 16 runs off on
    every step but for one re-timing of each rival its climb timed before the bucket's speed was known
    (`_unframed`: the chain and the tree of 4, a probe of 2 steps each): its rivals' timings are
    re-taken once STARTUP_RETIME_STEPS (those) or RETIME_AFTER_STEPS of its own steps old, not once that
    many engine steps old (on nearly every visit, as far as the re-probe credit allows)."""
    assert 6 * 64 < RETIME_AFTER_STEPS
    shapes = candidate_shapes(32, 7)
    policy = AdaptiveBudget(shapes, explore=0.0)
    seconds = {1: {s: 0.003 if s.is_off else 0.006 + 0.0001 * s.budget for s in shapes}, 16: {s: 0.005 if s.is_off else 0.016 + 0.0005 * s.budget for s in shapes}}
    tokens = {s: 1.0 if s.is_off else 3.0 for s in shapes}
    speculative_steps = []
    for visit in range(6):
        for n, steps in ((1, 700), (16, 64)):
            count = 0
            for _ in range(steps):
                shape = policy.choose(n)
                count += not shape.is_off
                policy.observe(n, shape, seconds[n][shape], {s: n * tokens[s] for s in reported_shapes(shapes, shape)})
            if n == 16:
                speculative_steps.append(count)
    assert sum(speculative_steps[1:]) <= 2 * policy.probe_hold, speculative_steps
    assert sum(count > 0 for count in speculative_steps[1:]) <= 2, speculative_steps


def steps_until_speculation_is_held_after_a_hard_first_request(policy: AdaptiveBudget, announce: bool, first: int = 100) -> int | None:
    """Batch 1, requests served one at a time: a first request of `first` steps whose text the drafts
    predict badly (off is best), then requests of 50 steps where the chain and trees pay. Steps after
    the first request until the policy holds a shape of 7 or more nodes (None: not within 40 requests).
    `announce`: the policy is told of every new request (`requests_arrived`), as the runner does."""
    chain = TreeShape(7, 1)
    hard = {OFF: 1.0, TreeShape(4): 1.3, chain: 1.4, TreeShape(8): 1.5, TreeShape(16): 1.5, TreeShape(32): 1.5}
    later = {OFF: 1.0, TreeShape(4): 2.7, chain: 3.4, TreeShape(8): 3.5, TreeShape(16): 3.6, TreeShape(32): 3.7}
    step = 0
    for request in range(40):
        if announce:
            policy.requests_arrived(1)
        for _ in range(first if request == 0 else 50):
            shape = policy.choose(1)
            if request >= 1 and policy.best_shape(1) not in (None, OFF, TreeShape(4)):
                return step - first
            tokens = hard if request == 0 else later
            policy.observe(1, shape, BATCH1_SECONDS[shape], {s: tokens[s] for s in reported_shapes(policy.shapes, shape)})
            step += 1
    return None


def test_a_new_request_at_batch_1_re_measures_a_doubted_rival():
    """Estimates taken on one request's text say little about the next one's: told of a new request,
    the policy re-measures its most doubted rival once even when the re-probe credit cannot pay (while
    the rival rests on fewer than FEW_SAMPLES steps). Without any credit (reprobe 0), so that the grant
    alone pays: speculation is held within the two requests (50 steps each) after a hard first request
    on every seed, each new request granting one re-measurement. Not told, only exploration re-measures
    the rivals: off holds through more than four requests."""
    shapes = candidate_shapes(32, 7)
    told = [steps_until_speculation_is_held_after_a_hard_first_request(AdaptiveBudget(shapes, seed=seed, reprobe=0.0), True) for seed in range(6)]
    untold = [steps_until_speculation_is_held_after_a_hard_first_request(AdaptiveBudget(shapes, seed=seed, reprobe=0.0), False) for seed in range(6)]
    assert all(n is not None and n <= 2 * 50 for n in told), told
    assert all(n is None or n > 4 * 50 for n in untold), untold


def test_at_batch_1_the_credit_charges_a_probe_what_its_tokens_lose():
    """At batch 1 a probe costs the seconds its step takes beyond what its tokens would have taken the
    held best (`_probe_cost`), not the seconds it takes longer: after a hard first request the credit
    alone (the policy not told of new requests) pays the chain's re-probes soon enough to hold
    speculation within MEMORY steps on every seed. Beyond batch 1 a probe costs at least its extra
    seconds."""
    shapes = candidate_shapes(32, 7)
    untold = [steps_until_speculation_is_held_after_a_hard_first_request(AdaptiveBudget(shapes, seed=seed), False) for seed in range(6)]
    assert all(n is not None and n <= MEMORY for n in untold), untold

    chain = shapes.index(TreeShape(7, 1))
    for num_requests in (1, 16):
        policy = AdaptiveBudget(shapes, explore=0.0)
        for shape in (OFF, shapes[chain]):  # timed over full windows: off 3 ms, the chain 7.4 ms and 1.9 tokens
            for _ in range(12):
                policy.observe(num_requests, shape, 0.003 if shape.is_off else 0.0074, {OFF: num_requests, shape: 1.9 * num_requests})
        bucket = batch_bucket(num_requests)
        rates = policy._rates(bucket)
        off = shapes.index(OFF)
        unproductive = 0.0074 - policy.expected_tokens(bucket, shapes[chain]) / rates[off]
        switch = 0.003
        expected = 2 * (unproductive if num_requests == 1 else 0.0074 - 0.003) + switch
        assert policy._probe_cost(bucket, rates, off, chain) == pytest.approx(expected, rel=1e-6)


def test_probes_the_credit_cannot_refuse_are_charged_to_it_per_step_they_run():
    """A new request's re-measurement at batch 1 and a random exploration run whatever the re-probe
    credit holds, and are charged to it all the same (it may go negative): they replace the re-probes
    the credit pays instead of adding to them. The charge falls as the probe's steps are observed, so a
    probe picked for a request that ends before verifying a draft (one output token) costs nothing.
    Off held (3 ms steps), the chain timed at 7.4 ms and 2.2 tokens over 12 steps (doubted: fewer than
    FEW_SAMPLES steps), no credit earned (reprobe 0)."""
    chain = TreeShape(7, 1)
    tokens = {OFF: 1, chain: 2.2}

    def timed_policy(explore: float) -> AdaptiveBudget:
        policy = AdaptiveBudget([OFF, chain], explore=explore, reprobe=0.0)
        for shape in (OFF, chain):
            for _ in range(12):
                policy.observe(1, shape, 0.003 if shape.is_off else 0.0074, {OFF: 1, shape: tokens[shape]})
        return policy

    def run_step(policy: AdaptiveBudget, shape: TreeShape) -> None:
        policy.observe(1, shape, 0.003 if shape.is_off else 0.0074, {OFF: 1, shape: tokens[shape]})

    policy = timed_policy(explore=0.0)
    assert policy._pick(0) == (OFF, policy.hold)  # nothing to pay a re-probe with
    cost = policy._probe_cost(0, policy._rates(0), 0, 1)
    policy.requests_arrived(1)
    assert policy._pick(0) == (chain, policy.probe_hold)
    assert policy.credit.get(0, 0.0) == 0.0  # charged as its steps run
    run_step(policy, OFF)  # the step that drafted the probe's drafts: observed one step later
    run_step(policy, chain)
    assert policy.credit[0] == pytest.approx(-cost / 2)
    run_step(policy, chain)
    assert policy.credit[0] == pytest.approx(-cost)
    run_step(policy, chain)  # a held shape after the probe's steps: not charged
    assert policy.credit[0] == pytest.approx(-cost)
    assert policy._pick(0) == (OFF, policy.hold)  # once per request

    policy = timed_policy(explore=0.0)
    policy.requests_arrived(1)
    assert policy._pick(0) == (chain, policy.probe_hold)
    for _ in range(3):  # the request ended: its probe never verified a draft
        run_step(policy, OFF)
    run_step(policy, chain)  # a later chain step is no step of that probe
    assert policy.credit.get(0, 0.0) == 0.0

    policy = timed_policy(explore=1.0)
    probes = 0
    for _ in range(200):
        shape = policy.choose(1)
        probes += shape == chain
        run_step(policy, shape)
    assert probes > 0
    assert policy.credit[0] == pytest.approx(-cost * probes / policy.probe_hold, rel=0.05)


def test_a_timing_taken_while_the_machine_was_slow_is_taken_again():
    """Without random exploration, off (whose tokens are exact, so no confidence bound ever doubts it)
    is re-timed once its timing is older than RETIME_AFTER_STEPS steps, paid from the re-probe credit.
    Nothing else re-times it, so off is not held before then; and the re-timing starts a new window of
    its seconds, so that one re-timing brings the policy to off, before a second one would be due. Without
    re-probes off is never held."""
    shapes = candidate_shapes(32, 7)
    held_from = steps_until_off_is_held(AdaptiveBudget(shapes, hold=4, probe_hold=2, explore=0.0))
    assert held_from is not None and RETIME_AFTER_STEPS <= held_from < 2 * RETIME_AFTER_STEPS, held_from
    assert steps_until_off_is_held(AdaptiveBudget(shapes, hold=4, probe_hold=2, explore=0.0, reprobe=0.0)) is None


def test_a_climb_timed_before_the_machines_speed_was_known_is_timed_again_soon():
    """Batch 1, the realistic-cost pair's proportions: the tree of 8 is the fastest shape, but the machine
    runs at half speed for the climb's first steps, which time the start shape (the tree of 8) before
    any held shape has measured the machine's speed. That timing is raw seconds of another speed, which
    paired timing cannot correct (`_unframed`), so it is re-timed once older than STARTUP_RETIME_STEPS
    times the square of how far it is behind (re-timed after RETIME_AFTER_STEPS instead, the chain held
    for some 1800 steps): the tree of 8 is held within 4 x STARTUP_RETIME_STEPS steps, and on nearly
    every step after. Without exploration, so that only the re-timing rule brings it back."""
    shapes = candidate_shapes(32, 7)
    chain = TreeShape(7, 1)
    seconds = {OFF: 0.074, TreeShape(4): 0.090, chain: 0.093, TreeShape(8): 0.100, TreeShape(16): 0.114, TreeShape(32): 0.140}
    tokens = {OFF: 1.0, TreeShape(4): 2.7, chain: 2.75, TreeShape(8): 3.2, TreeShape(16): 3.35, TreeShape(32): 3.45}
    policy = AdaptiveBudget(shapes, explore=0.0)
    chosen, held_at = [], None
    for step in range(1000):
        shape = policy.choose(1)
        chosen.append(shape)
        slow = 2.0 if step < 4 else 1.0
        policy.observe(1, shape, seconds[shape] * slow, {s: tokens[s] for s in reported_shapes(shapes, shape)})
        if held_at is None and step >= 4 and policy.best_shape(1) == TreeShape(8):
            held_at = step
    assert held_at is not None and held_at <= 4 * STARTUP_RETIME_STEPS, held_at
    assert chosen[-500:].count(TreeShape(8)) > 450


def test_timings_taken_minutes_apart_compare_as_if_taken_together():
    """Paired timing: the chain is timed only while the machine runs at half speed; the tree of 8 held
    around it is timed before, during and after. Back at full speed, the chain's estimate is its
    full-speed cost (the slowdown went into the machine's speed, measured by the tree's steps), so the
    chain (3 tokens in 5.3 ms) outranks the tree (3.2 in 7 ms), as it would timed at any one speed.
    Absolute timings would keep the chain at 10.6 ms until it is timed again."""
    chain, tree = TreeShape(7, 1), TreeShape(8)
    policy = AdaptiveBudget(candidate_shapes(8, 7), explore=0.0, reprobe=0.0)
    tokens = {OFF: 1.0, TreeShape(4): 2.6, chain: 3.0, tree: 3.2}

    def steps(shape: TreeShape, seconds: float, count: int) -> None:
        for _ in range(count):
            policy.observe(1, shape, seconds, {s: tokens[s] for s in (OFF, TreeShape(4), chain, tree) if s in nested_shapes(policy.shapes, shape) or s == chain})

    steps(tree, 0.007, 12)
    steps(tree, 0.014, 6)  # the machine slows to half speed
    steps(chain, 0.0106, 4)
    steps(tree, 0.014, 3)
    steps(tree, 0.007, 12)  # full speed again
    assert policy.seconds(0, chain) == pytest.approx(0.0053, rel=0.02)
    assert policy.seconds(0, tree) == pytest.approx(0.007, rel=0.02)
    assert policy.tokens_per_second(0, chain) > policy.tokens_per_second(0, tree)


def run_costed(policy: AdaptiveBudget, seconds: dict[TreeShape, float], tokens: dict[TreeShape, float], steps: int) -> list[TreeShape]:
    """The policy at batch 16 against fixed seconds and tokens per step per shape (tokens of the nested
    shapes reported with each step, as the runner does)."""
    chosen = []
    for _ in range(steps):
        shape = policy.choose(16)
        chosen.append(shape)
        policy.observe(16, shape, seconds[shape], {s: tokens[s] * 16 for s in nested_shapes(policy.shapes, shape)})
    return chosen


BATCH_16_SECONDS = {OFF: 0.005, TreeShape(4): 0.012, TreeShape(7, 1): 0.015, TreeShape(8): 0.017, TreeShape(16): 0.03}


def test_a_costly_shape_needs_a_margin_scaled_by_its_cost_and_is_probed_rarely():
    """At a large batch a chain step costs 3 off steps and gains 6.7% per step: within noise of what
    the per-step rate leaves out (the batch tail's uneven progress), and a wrong switch costs three
    steps a step. The policy holds off (the margin is 3% x 3), and its probes of the costly shapes
    are rare: over 2000 steps the extra time they cost, re-probes (`reprobe`, 1.5% of the timed seconds)
    and random exploration together, is under 3% of the run."""
    shapes = candidate_shapes(16, 7)  # off, 4, chain 7, 8, 16
    tokens = {OFF: 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 3.2, TreeShape(8): 2.6, TreeShape(16): 3.0}
    policy = AdaptiveBudget(shapes, seed=3)
    chosen = run_costed(policy, BATCH_16_SECONDS, tokens, 2000)
    assert policy.best_shape(16) == OFF
    extra = sum(BATCH_16_SECONDS[s] - BATCH_16_SECONDS[OFF] for s in chosen[200:])
    assert extra < 0.03 * len(chosen[200:]) * BATCH_16_SECONDS[OFF], extra


def test_a_costly_shape_that_clearly_pays_is_still_chosen():
    """The same costs, but the chain gains 73% per step over off: the policy takes it."""
    shapes = candidate_shapes(16, 7)
    tokens = {OFF: 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 5.2, TreeShape(8): 2.6, TreeShape(16): 3.0}
    policy = AdaptiveBudget(shapes, explore=0.05, seed=3)
    chosen = run_costed(policy, BATCH_16_SECONDS, tokens, 600)
    assert policy.best_shape(16) == TreeShape(7, 1)
    assert chosen[-200:].count(TreeShape(7, 1)) > 180


def test_a_tree_held_beside_the_chain_still_re_times_the_next_tree():
    """The list orders shapes by node count: off, 4, chain of 7, 8, ... A tree of 4 held as a tie with the
    chain (its neighbour in the list), the tree of 8 measured on hard text only (the first 60 steps) and
    11% faster thereafter: re-timing reaches past the chain to the next tree, so the tree of 8 is held
    within MEMORY steps after the hard text, and on nearly every step after (re-timing only the
    neighbours in the list, off and the chain, the tree of 8 would stay out for good)."""
    shapes = candidate_shapes(32, 7)  # off, 4, chain 7, 8, 16, 32
    chain = TreeShape(7, 1)
    seconds = {OFF: 0.004, TreeShape(4): 0.0095, chain: 0.0095, TreeShape(8): 0.0105, TreeShape(16): 0.013, TreeShape(32): 0.016}
    tokens = {OFF: 1.0, TreeShape(4): 2.7, chain: 2.7, TreeShape(8): 3.3, TreeShape(16): 3.4, TreeShape(32): 3.5}
    hard = {shape: 1.6 if shape.topk is None and shape.budget >= 8 else count for shape, count in tokens.items()}
    for seed in range(4):
        policy = AdaptiveBudget(shapes, seed=seed)
        chosen, held_at = [], None
        for step in range(1500):
            shape = policy.choose(1)
            chosen.append(shape)
            text = hard if step < 60 else tokens
            reported = {s: text[s] for s in nested_shapes(shapes, shape)}
            if shape.topk is None and shape.budget >= chain.budget:  # the chain read off a tree as deep
                reported[chain] = text[chain]
            policy.observe(1, shape, seconds[shape], reported)
            if held_at is None and step >= 60 and policy.best_shape(1) == TreeShape(8):
                held_at = step - 60
        assert held_at is not None and held_at <= MEMORY, (seed, held_at)
        assert chosen[-500:].count(TreeShape(8)) > 450, seed


def run_regime(policy: AdaptiveBudget | SamplingRegimes, greedy: bool, rates: dict[TreeShape, float], steps: int) -> list[TreeShape]:
    """`simulate` at batch 1, each step's batch greedy or sampling (told to a `SamplingRegimes` first)."""
    chosen = []
    for _ in range(steps):
        if isinstance(policy, SamplingRegimes):
            policy.use(greedy)
        shape = policy.choose(1)
        chosen.append(shape)
        policy.observe(1, shape, 0.01, {shape: rates[shape] * 0.01})
    return chosen


def test_each_sampling_regime_resumes_with_its_own_best_shape():
    """Greedy requests, then sampled ones (off is best), then greedy again: the greedy regime's tree is
    held again from the first steps, its estimates untouched by the sampled text; the sampled steps went
    to their own policy (pooled, off measures no tree's tokens while it holds, and the trees would
    return only as re-probes find them)."""
    shapes = candidate_shapes(16, 7)  # off, 4, chain of 7, 8, 16
    greedy = {OFF: 100.0, TreeShape(4): 125.0, TreeShape(7, 1): 120.0, TreeShape(8): 140.0, TreeShape(16): 130.0}
    sampled = {OFF: 100.0, TreeShape(4): 90.0, TreeShape(7, 1): 85.0, TreeShape(8): 80.0, TreeShape(16): 70.0}
    regimes = SamplingRegimes(shapes)
    assert run_regime(regimes, True, greedy, 300)[-100:].count(TreeShape(8)) >= 80  # the rest: probes
    assert run_regime(regimes, False, sampled, 600)[-100:].count(OFF) >= 90
    assert set(regimes.policies) == {True, False}
    assert regimes.policies[True]._observed_steps == 300 and regimes.policies[False]._observed_steps == 600
    assert run_regime(regimes, True, greedy, 50).count(TreeShape(8)) >= 40


BATCH_4_SECONDS = {OFF: 0.004, TreeShape(4): 0.014, TreeShape(7, 1): 0.016, TreeShape(8): 0.017, TreeShape(16): 0.02, TreeShape(32): 0.026}
BATCH_4_TOKENS = {OFF: 1.0, TreeShape(4): 2.0, TreeShape(7, 1): 2.5, TreeShape(8): 2.2, TreeShape(16): 2.4, TreeShape(32): 2.5}


def test_the_held_shapes_timing_noise_does_not_move_its_rivals_seconds():
    """Off held at batch 4 (speculation costs 3.5-6.5 off steps for at most 2.5 tokens), its steps timed
    with 10% noise, no re-probes: the rivals' seconds, read against off's, stay where they were timed.
    Were the held shape's steps to update its own cost as well as the speed, the split of its seconds
    into the two would random-walk, and with it every rival's reading."""
    policy = AdaptiveBudget(candidate_shapes(32, 7), explore=0.0, reprobe=0.0)
    noise = random.Random(0)
    ratios = []
    for step in range(20000):
        shape = policy.choose(4)
        seconds = BATCH_4_SECONDS[shape] * noise.lognormvariate(0.0, 0.1)
        policy.observe(4, shape, seconds, {s: 4 * BATCH_4_TOKENS[s] for s in reported_shapes(policy.shapes, shape)})
        if step >= 1000 and step % 100 == 0:
            assert shape == OFF
            ratios.append(policy.seconds(2, TreeShape(7, 1)) / policy.seconds(2, OFF))
    assert 0.85 * 4.0 < min(ratios) and max(ratios) < 1.15 * 4.0, (min(ratios), max(ratios))


def test_a_rival_far_behind_the_best_is_re_timed_rarely_but_still_re_timed():
    """Off held at batch 4, the rivals' rates under half of off's: their timings are re-taken once they
    are RETIME_AFTER_STEPS x (how many times slower)^2 steps old, not every RETIME_AFTER_STEPS, and the
    confidence bound, its error capped at half the range of a step's tokens, never doubts them (uncapped,
    their aging samples would have it re-probe them every few hundred steps); yet every such rival is
    re-timed within 10000 steps (no exploration here): the policy never stops measuring."""
    policy = AdaptiveBudget(candidate_shapes(32, 7), explore=0.0)
    probes: dict[TreeShape, list[int]] = {}
    for step in range(10000):
        shape = policy.choose(4)
        if step >= 200 and not shape.is_off:
            probes.setdefault(shape, []).append(step)
        policy.observe(4, shape, BATCH_4_SECONDS[shape], {s: 4 * BATCH_4_TOKENS[s] for s in reported_shapes(policy.shapes, shape)})
    assert set(probes) == {TreeShape(4), TreeShape(7, 1)}  # off's neighbour and the chain
    rates = {policy.shapes[i]: rate for i, rate in policy._rates(batch_bucket(4)).items()}
    for shape, steps in probes.items():
        behind = rates[OFF] / rates[shape]
        assert behind > 2
        episodes = [s for i, s in enumerate(steps) if i == 0 or s - steps[i - 1] > 10]
        assert len(episodes) >= 2 and all(b - a > RETIME_AFTER_STEPS * behind**2 for a, b in zip(episodes, episodes[1:])), (shape, steps)


ODD_NUMBERS = st.sampled_from([0.0, -0.01, 5e-324, 1e-300, 1e-7, 1e300, float("inf"), float("nan")])


STEP_TIMES = st.one_of(*[st.floats(1e-3, 2e-2)] * 3, st.none(), ODD_NUMBERS)  # a stopped, stepped or jumping clock too


TOKENS = st.one_of(*[st.floats(1.0, 9.0)] * 3, ODD_NUMBERS)


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.sampled_from([1, 2, 4, 16]), min_size=1, max_size=3),
    steps=st.lists(st.tuples(STEP_TIMES, TOKENS, st.integers(0, 30)), min_size=50, max_size=400),
    seed=st.integers(0, 2**16),
)
def test_odd_timings_and_counts_never_raise(batches, steps, seed):
    """Whatever the clock reports (zero, negative, NaN, infinite, tiny or huge step times) and whatever
    counts it is fed, the policy keeps choosing candidate shapes: a time outside `STEP_SECONDS` is no
    timing, a count that is negative, infinite or NaN is dropped, and no rate divides by zero or
    overflows into an exception (a stopped clock after real timings must not make the machine's speed
    0, for the next rival's timing to divide by)."""
    shapes = candidate_shapes(32, 7)
    policy = AdaptiveBudget(shapes, explore=0.2, seed=seed)
    for index, (seconds, tokens, event) in enumerate(steps):
        num_requests = batches[index * len(batches) // len(steps)]  # a few stretches of one batch size
        if event == 0:
            policy.requests_arrived(num_requests)
        shape = policy.choose(num_requests)
        assert shape in shapes
        policy.observe(num_requests, shape, seconds, {shape: tokens * num_requests, OFF: float(num_requests)})
