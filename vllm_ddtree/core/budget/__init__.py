"""Adaptive tree budget: each step, the tree shape with the best measured throughput at this batch size
and context length.

One module per concept, each stating its rules:
- `shapes`: the candidate shapes (off, the chain, trees of 4, 8, ... nodes up to the cap) and the
  buckets of batch size and context length shapes are timed in.
- `estimators`: a shape's seconds (median of recent steps) and tokens (means decayed by engine steps,
  with their standard error).
- `read_off`: what every smaller tree and the chain would have accepted, read off one verified tree.
- `clock`: which engine steps are timed, and how they reach the policy.
- `policy`: `AdaptiveBudget`, which measures, climbs, holds and re-measures.
- `regimes`: one policy for greedy batches, one for sampled ones.
"""

from vllm_ddtree.core.budget.clock import BudgetPolicy, StepClock
from vllm_ddtree.core.budget.estimators import DecayedMean, SampleSpread
from vllm_ddtree.core.budget.policy import FOLLOW_STEPS, AdaptiveBudget
from vllm_ddtree.core.budget.read_off import accepted_by_shape, chain_accepted, nested_shapes, read_off_shapes, tokens_by_shape
from vllm_ddtree.core.budget.regimes import SamplingRegimes
from vllm_ddtree.core.budget.shapes import OFF, TreeShape, batch_bucket, candidate_shapes, context_bucket, step_bucket

__all__ = [
    "FOLLOW_STEPS",
    "OFF",
    "AdaptiveBudget",
    "BudgetPolicy",
    "DecayedMean",
    "SampleSpread",
    "SamplingRegimes",
    "StepClock",
    "TreeShape",
    "accepted_by_shape",
    "batch_bucket",
    "candidate_shapes",
    "chain_accepted",
    "context_bucket",
    "nested_shapes",
    "read_off_shapes",
    "step_bucket",
    "tokens_by_shape",
]
