"""Which engine steps reach the policy, and with what time (`vllm_ddtree.core.budget.clock`)."""

from __future__ import annotations

from collections import deque

from vllm_ddtree.core.budget import OFF, AdaptiveBudget, StepClock, TreeShape, batch_bucket, candidate_shapes


class RecordingPolicy:
    shapes = [OFF, TreeShape(4)]

    def __init__(self) -> None:
        self.observed: list[tuple] = []

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        return TreeShape(4)

    def observe(self, num_requests, used, seconds, tokens, context_tokens=0.0) -> None:
        self.observed.append((num_requests, used, None if seconds is None else round(seconds, 6), tokens, context_tokens))


def test_step_clock_reports_contiguous_decode_steps_only():
    """A step is reported at the next step's start with the time between the starts, unless the engine
    sat idle in between, it committed nothing, or it prefilled prompt tokens."""
    policy = RecordingPolicy()
    clock = StepClock(policy, idle_slack=0.01)
    shape = TreeShape(4)
    clock.step_started(0.0, 2, shape, decode_only=True, context_tokens=700.0)
    clock.step_sampled(6, {OFF: 0, shape: 4})
    clock.step_ended(0.05)
    clock.step_started(0.06, 2, shape, decode_only=True)  # contiguous: reported, with its own context
    assert policy.observed == [(2, shape, 0.06, {OFF: 2, shape: 6}, 700.0)]
    clock.step_sampled(2, {shape: 0})
    clock.step_ended(0.1)
    clock.step_started(0.5, 2, shape, decode_only=True)  # idle gap (0.44 > 2 x 0.04 + 0.01): dropped
    clock.step_ended(0.55)
    clock.step_started(0.6, 2, shape, decode_only=True)  # committed nothing: dropped
    clock.step_sampled(3, {shape: 1})
    clock.step_ended(0.65)
    clock.step_started(0.7, 3, shape, decode_only=False)  # reported; this prefill step is not timed
    clock.step_sampled(5, {shape: 2})
    clock.step_ended(0.8)
    clock.step_started(0.85, 3, shape, decode_only=True)
    assert [o[2] for o in policy.observed] == [0.06, 0.1]


def test_steps_drafting_the_other_kind_of_step_count_tokens_but_not_time():
    """off -> chain -> chain -> off -> off -> off: a step ends by drafting for the next one, so the last
    off step before the chain (it runs the draft pass) and the last chain step before off (it drafts
    nothing) are reported without their time; the policy then times neither, but counts their tokens."""
    chain = TreeShape(7, 1)
    policy = RecordingPolicy()
    clock = StepClock(policy)
    for i, shape in enumerate([OFF, chain, chain, OFF, OFF, OFF]):
        clock.step_started(0.01 * i, 2, shape, decode_only=True)
        clock.step_sampled(2 if shape.is_off else 6, {shape: 0 if shape.is_off else 4})
        clock.step_ended(0.01 * i + 0.005)
    assert [(o[1], o[2]) for o in policy.observed] == [(OFF, None), (chain, 0.01), (chain, None), (OFF, 0.01), (OFF, 0.01)]
    assert [o[3] for o in policy.observed] == [{OFF: 2}, {chain: 6}, {chain: 6}, {OFF: 2}, {OFF: 2}]
    adaptive = AdaptiveBudget(candidate_shapes(8, 7))
    for seconds in (0.01, None, 0.02):  # first step in the bucket (untimed), a switch, a timed step
        adaptive.observe(2, chain, seconds, {chain: 6})
    assert adaptive.costs[(batch_bucket(2), chain)].values == deque([0.02])
    assert adaptive.spread[chain].steps == 3


def test_a_mixed_step_reports_its_verified_requests_untimed():
    """A step that also prefilled (a request's prompt beside decoding ones) is reported without its time,
    as the requests that verified drafts and the tokens they committed: the prefills' first tokens would
    count one per request whatever the shape. A mixed step that verified no drafts is not reported."""
    policy = RecordingPolicy()
    clock = StepClock(policy)
    shape = TreeShape(4)
    clock.step_started(0.0, 12, shape, decode_only=False)  # 11 prefills, 1 request verifying its tree
    clock.step_sampled(14, {OFF: 0, shape: 2}, verified=(1, 3))
    clock.step_ended(0.05)
    clock.step_started(0.06, 12, OFF, decode_only=False)  # 12 more prefills... and no drafts verified
    clock.step_sampled(12, {OFF: 0}, verified=(0, 0))
    clock.step_ended(0.1)
    clock.step_started(0.11, 12, OFF, decode_only=False)  # vLLM's sampler drew it: nothing verified
    clock.step_sampled(12, {OFF: 0})
    clock.step_ended(0.15)
    clock.step_started(0.16, 12, OFF, decode_only=True)
    assert policy.observed == [(1, shape, None, {OFF: 1, shape: 3}, 0.0)]
