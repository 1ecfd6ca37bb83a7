"""Tree shapes, the candidates among them, and the buckets the policy times them in.

Rules:
- A shape is (budget, topk): `budget` tree nodes besides the root, `topk` candidates per depth (1: the
  chain; None: best-first, no cap beyond the budget). `OFF` (no nodes) is a plain decoding step: the
  draft only stores its context, without its block pass.
- The candidates are off, the chain and best-first trees of 4, 8, 16, ... nodes up to the cap (the cap
  included), ordered by node count: the order the policy climbs. Speed peaks at an intermediate size
  and a far size can be very slow, so sizes are reached by steps, never tried blindly.
- A step's cost depends on the batch size and on the context length (a verify forward's attention
  reads every row's context, so a tree's step grows with the context faster than off's): costs are
  kept per bucket of batch size (1 | 2-3 | 4-7 | ...) and context tokens per request (below
  CONTEXT_BUCKET_TOKENS, then one bucket per doubling), and shapes are compared within a bucket only.
"""

from __future__ import annotations

from typing import NamedTuple

CONTEXT_BUCKET_TOKENS = 512
"""Context tokens per request from which the policy times shapes apart by context length, per doubling
(`context_bucket`): a verify forward's attention grows with the context, and with it the shapes' costs
relative to each other, which paired timing (`AdaptiveBudget._time`) assumes fixed within a bucket."""

BATCH_BUCKETS = 64
"""Batch buckets per context bucket in a bucket's number (`step_bucket`): more than any batch has."""


class TreeShape(NamedTuple):
    """budget: tree nodes besides the root (0: no speculation this step); topk: candidates per depth
    (1: the chain; None: no cap beyond the budget). A named tuple: shapes key every table of the
    policy, hashed many times per step, and a tuple's hash is computed in C (a frozen dataclass's in
    Python)."""

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
    `batch_of(bucket)`; short contexts keep the batch bucket's number)."""
    return batch_bucket(num_requests) + BATCH_BUCKETS * context_bucket(context_tokens)


def batch_of(bucket: int) -> int:
    """The batch bucket of a policy bucket (`step_bucket`): 0 is batch 1."""
    return bucket % BATCH_BUCKETS
