"""Arithmetic of the interleaved benchmarks (no engine): per-round ratios, step splits, the zero-overhead bound."""

from __future__ import annotations

import pytest

from vllm_ddtree.demo.stats import OWN_STAGES, StepSplit, median_split, per_round_ratios, spread, step_split, zero_overhead_bound
from vllm_ddtree.vllm.stage_times import DRAFT_FORWARD, STAGES, STEP, TARGET_FORWARD


def test_ratios_are_taken_inside_rounds_not_between_medians():
    variant, baseline = [100.0, 200.0, 300.0], [50.0, 400.0, 150.0]  # the machine drifts between rounds
    ratios = per_round_ratios(variant, baseline)
    assert ratios.values == (2.0, 0.5, 2.0)
    assert (ratios.median, ratios.low, ratios.high) == (2.0, 0.5, 2.0)
    assert spread(variant).median / spread(baseline).median == pytest.approx(200 / 150)  # what it is not


def test_drift_common_to_both_terms_cancels():
    speed = [0.6, 1.0, 1.3]  # machine speed per round
    ratios = per_round_ratios([300 * s for s in speed], [200 * s for s in speed])
    assert ratios.low == pytest.approx(1.5) and ratios.high == pytest.approx(1.5)


def test_ratios_need_one_baseline_per_round():
    with pytest.raises(ValueError):
        per_round_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        spread([])


def test_spread_formats_the_range_only_for_several_rounds():
    assert spread([1.234]).format(2, "x") == "1.23x"
    assert spread([1.0, 1.5, 1.25]).format(2, "x") == "1.25x [1.00-1.50]"


def test_every_stage_is_counted_once_in_a_split():
    assert sorted([DRAFT_FORWARD, TARGET_FORWARD, STEP, *OWN_STAGES]) == sorted(STAGES)


def _stage_seconds(draft: float, own_each: float, forward: float, rest: float) -> dict[str, float]:
    return {DRAFT_FORWARD: draft, TARGET_FORWARD: forward, STEP: rest, **{name: own_each for name in OWN_STAGES}}


def test_step_split_per_step_and_outside_the_runner():
    split = step_split(1.0, _stage_seconds(draft=0.1, own_each=0.025, forward=0.4, rest=0.2), steps=100, rows=3300)
    assert split.wall == pytest.approx(10.0)
    assert (split.draft, split.own, split.forward, split.rest) == pytest.approx((1.0, 1.0, 4.0, 2.0))
    assert split.outside == pytest.approx(2.0)
    assert split.rows == pytest.approx(33.0)
    assert split.forward_per_row == pytest.approx(4.0 / 33)
    assert split.steps == 100


def test_bound_removes_own_stages_and_charges_the_chains_cost_per_row():
    tree = StepSplit(wall=10.0, draft=1.0, own=1.0, forward=4.0, rest=2.0, outside=2.0, rows=33.0, steps=100)
    bound = zero_overhead_bound(tree, run_seconds=1.2, run_tokens=400, chain_forward_per_row=0.1, chain_tokens_per_second=300.0)
    assert bound.step == pytest.approx(10.0 - 1.0 - 4.0 + 0.1 * 33)  # 8.3 ms
    saved = (10.0 - 8.3) * 100 / 1000  # seconds the decode steps save; the rest of the run (its prefill) stays
    assert bound.tokens_per_second == pytest.approx(400 / (1.2 - saved))
    assert bound.ratio == pytest.approx(400 / (1.2 - saved) / 300.0)


def test_bound_of_a_tree_without_overhead_is_its_measured_speed():
    tree = StepSplit(wall=8.0, draft=1.0, own=0.0, forward=3.3, rest=2.0, outside=1.7, rows=33.0, steps=50)
    bound = zero_overhead_bound(tree, run_seconds=0.5, run_tokens=200, chain_forward_per_row=0.1, chain_tokens_per_second=400.0)
    assert bound.step == pytest.approx(8.0)
    assert bound.tokens_per_second == pytest.approx(400.0)
    assert bound.ratio == pytest.approx(1.0)


def test_median_split_is_field_by_field():
    a = StepSplit(1, 2, 3, 4, 5, 6, 7, 8)
    b = StepSplit(3, 0, 3, 8, 5, 0, 7, 8)
    c = StepSplit(2, 1, 9, 6, 5, 3, 7, 8)
    assert median_split([a, b, c]) == StepSplit(2, 1, 3, 6, 5, 3, 7, 8)
