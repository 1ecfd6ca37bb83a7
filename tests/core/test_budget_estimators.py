"""The estimators behind a shape's seconds and tokens (`vllm_ddtree.core.budget.estimators`)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core.budget import DecayedMean, SampleSpread
from vllm_ddtree.core.budget.estimators import RecentMedian


def test_a_recent_median_is_not_moved_by_one_slow_step_and_forgets_old_values():
    """A cost is the median of the last `window` values: one step slowed tenfold leaves it where it was,
    and values older than the window no longer count."""
    costs = RecentMedian(5)
    for value in (1.0, 1.1, 0.9, 1.0):
        costs.add(value)
    costs.add(10.0)  # a step the machine slowed
    assert costs.median == 1.0
    for _ in range(5):
        costs.add(2.0)
    assert costs.median == 2.0 and list(costs.values) == [2.0] * 5
    costs.count(step=7)  # a step measured without a value kept
    assert costs.steps == 11 and costs.last_step == 7 and costs.median == 2.0
    assert RecentMedian(3).median == 0.0


def test_a_shape_measured_long_ago_is_relearnt_from_its_next_steps():
    stale = DecayedMean()
    stale.add(3.0, 0.97, step=1)
    stale.add(1.0, 0.97, step=201)  # 200 engine steps later: the old value weighs 0.97**200
    assert stale.mean == pytest.approx(1.0, abs=0.01)
    fresh = DecayedMean()
    fresh.add(3.0, 0.97, step=1)
    fresh.add(1.0, 0.97, step=2)
    assert fresh.mean == pytest.approx((0.97 * 3.0 + 1.0) / 1.97)


@given(st.lists(st.tuples(st.floats(1.0, 16.0), st.integers(1, 64)), min_size=2, max_size=20), st.floats(0.0, 30.0), st.floats(0.0, 4.0))
def test_sample_spread_is_the_request_weighted_standard_error(steps, prior_variance, prior_steps):
    """Against the textbook formula: steps of R requests with mean x are R samples each; the variance
    is sum R (x - mean)^2 / (steps - 1), shrunk towards the prior with prior_steps' weight; the error
    is sqrt(variance / sum R). Without decay (decay 1), all steps on the same engine step."""
    spread = SampleSpread()
    for value, requests in steps:
        spread.add(value, requests, 1.0, step=0)
    weights = sum(r for _, r in steps)
    mean = sum(v * r for v, r in steps) / weights
    squares = sum(r * (v - mean) ** 2 for v, r in steps)
    variance = (squares + prior_steps * prior_variance) / (len(steps) - 1 + prior_steps)
    assert spread.standard_error(prior_variance, prior_steps, 1.0, step=0) == pytest.approx((variance / weights) ** 0.5, rel=1e-6, abs=1e-9)


def test_sample_spread_grows_as_its_samples_age():
    """The samples behind an estimate decay per engine step since they were observed: the same
    estimate's standard error, read 100 steps later at decay 0.99, is 0.99**-50 times larger."""
    spread = SampleSpread()
    for step, value in enumerate((1.0, 3.0, 2.0)):
        spread.add(value, 4, 0.99, step)
    now, later = (spread.standard_error(1.0, 2.0, 0.99, step) for step in (2, 102))
    assert later == pytest.approx(now * 0.99**-50)
