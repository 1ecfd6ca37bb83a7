"""Step costs timed when the engine starts: where the adaptive budget policy starts from
(`AdaptiveBudget.seed_costs`), instead of paying its first steps to time shapes one by one.

What is timed, with dummy inputs, per batch size b (one per batch bucket of the policy, `BATCHES`, up
to max_num_seqs):
- the target: its forward over b requests of `rows` tokens each (vLLM's `_dummy_run` in its uniform
  layout, attention metadata built, the drafter not run; `_target_step`) and its LM head over the rows
  a step samples (b for off, every row otherwise), for the rows each candidate shape verifies: 1 (off),
  1 + depth (the chain), 1 + n (a tree of n nodes). At a short context a forward costs what its tokens
  cost, however they split into requests: the linear layers, whose cost follows the tokens, dominate the
  attention (measured in docs/benchmarks.md, "Start-up costs by tokens"). So batch 1 times every row
  count and each larger batch size its largest and its smallest only (off's, one row per request); the
  other shapes' b x rows tokens cost the seconds of the forwards timed at batch 1 and at each batch
  size's largest rows, interpolated at those tokens (`interpolated`). Off is timed at every batch size,
  not interpolated: it is the reference every shape is weighed against, and its forward holds the most
  requests per token, whose per-request costs a count of tokens does not show;
- the draft, once per b: every speculative shape drafts the same depth (`DDTreeProposer.propose`), so
  one pass (DFlash's `dummy_run` over b x (1 + depth) rows: the context store and the block pass) and
  its LM head and top-k over b x depth rows serve them all;
- the trees' host build, per speculative shape (its cost grows with the nodes).
A shape's start-up cost at b is the sum of its parts. The engine's step around them (scheduling, input
preparation, sampling, the walk) is not timed here: the policy adds the overhead its timed steps show
(`AdaptiveBudget._prior_cost`).

Invariants:
- A time is the least of REPEATS runs: first-call costs (allocations, lazy kernels) and another
  process on the machine only add time.
- A shape whose tokens at b exceed max_num_batched_tokens is not timed at b (the scheduler never runs
  it there), nor one whose rows exceed max_model_len (a dummy request's sequence must fit in its
  block-table row, `_target_step`), nor one whose tokens exceed the most a timed forward held (no
  extrapolation), nor is a larger batch size once it would end the timing past TIME_LIMIT_S (its work
  is the last size's smallest and largest forwards, draft pass and builds at the larger size's rows: at
  most as many times the time as it has requests); batch 1 is always timed.
- Under tensor parallelism every rank runs the same dummy forwards (they all-reduce together) and seeds
  its own policy, of which TP rank 0's decides every step (`rank_zero.shape_from_rank_zero`); rank 0
  alone decides when the timing stops, broadcast to the others, so every rank runs as many forwards.
- Dummy inputs are zeros and fixed values: no random draw, so vLLM's seeded state is as it left it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed import get_tp_group

from vllm_ddtree.core import AdaptiveBudget, SamplingRegimes, TreeShape
from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host

logger = logging.getLogger("vllm.ddtree")

BATCHES = (1, 3, 6, 12, 24, 48, 96, 192, 384)
"""Batch sizes timed: one per batch bucket of the policy (1 | 2-3 | 4-7 | ...), in the bucket's upper
half, where a bucket's steps run (batches grow and shrink through it)."""

REPEATS = 2
"""Runs per measurement; the least counts (a first call's one-time costs, allocations and lazy kernels,
fall on the first run only)."""

WARM_UP = 4
"""Untimed forwards before the timing: the forwards after a large one (vLLM's profile run at
max_num_batched_tokens) run slow for several forwards, every run of the least of REPEATS alike, so
REPEATS alone does not remove it; one untimed forward did not either, four did (docs/benchmarks.md)."""

TIME_LIMIT_S = 5.0
"""No larger batch size is timed once it would end the timing past this many seconds: the largest
batches cost the most and run the least (an offline batch's first steps; a server at its peak), and the
policy times shapes online anyway. A batch size the table lacks is learnt online by the climb, several
steps per shape (each shape's first step in a bucket is untimed), which a short job at that batch pays
for; the limit is set to cover batch 1-12 of a 0.6B-class model in bf16 on a 2-core CPU
(docs/benchmarks.md)."""


def seed_budget_policy(runner: Any) -> tuple[dict[tuple[int, TreeShape], float], float] | None:
    """Time the step costs of the shapes of `runner`'s adaptive budget policy (`time_step_costs`) and seed
    the policy with them; returns (the costs, seconds the timing took). None, and nothing timed, without
    an adaptive policy (`ddtree_adaptive` false, or a policy set by hand), or where the timing failed
    (logged: the policy then times every shape online, as it would without a table)."""
    policy = runner.drafter.budget_policy
    if not isinstance(policy, (SamplingRegimes, AdaptiveBudget)):
        return None
    stage_times = runner.stage_times
    enabled, stage_times.enabled = stage_times.enabled, False  # dummy passes are no step's stages
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            costs = time_step_costs(runner, policy.shapes)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the policy then times every shape online
        logger.warning("method 'ddtree': step costs could not be timed at start-up (%s: %s); the budget policy "
                       "times every shape online", type(exc).__name__, exc)
        return None
    finally:
        stage_times.enabled = enabled
    seconds = time.perf_counter() - start
    policy.seed_costs(costs)
    logger.info("method 'ddtree': step costs of %d shapes timed at batch sizes %s in %.2f s (the budget policy starts from them)",
                len(policy.shapes), sorted({batch for batch, _ in costs}), seconds)
    return costs, seconds


def _least(run: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds of one `run`: the least of REPEATS runs."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _rows(shape: TreeShape, depth: int) -> int:
    """Rows a step of `shape` verifies per request: the root and its nodes (a chain: as deep as the draft)."""
    return 1 + (min(shape.budget, depth) if shape.is_chain else shape.budget)


def time_step_costs(runner: Any, shapes: list[TreeShape]) -> dict[tuple[int, TreeShape], float]:
    """seconds[(b, shape)] for the `shapes` of the policy at the batch sizes b of BATCHES (the module's
    rules); `runner` is the DDTree model runner, its model, KV cache and drafter ready."""
    drafter = runner.drafter
    depth = min(drafter.ddtree.budget, drafter.max_depth)
    max_tokens = runner.max_num_tokens
    max_seqs = runner.scheduler_config.max_num_seqs
    max_model_len = runner.max_model_len
    sync = runner._sync_device
    speculative = [shape for shape in shapes if not shape.is_off]
    candidates = max((drafter.candidates_for(shape) for shape in speculative), default=1)
    row_counts = sorted({_rows(shape, depth) for shape in shapes})
    group = get_tp_group()
    measured: dict[tuple[int, int], float] = {}  # the target's forward and LM head, by (batch, rows) timed
    by_tokens: dict[int, float] = {}  # those timed at batch 1 or at a batch size's largest rows, by their tokens
    table: dict[tuple[int, TreeShape], float] = {}
    start = time.perf_counter()
    for _ in range(WARM_UP):  # untimed
        _target_step(runner, 1, 1)
    for batch, next_batch in itertools.pairwise((*(b for b in BATCHES if b <= max_seqs), None)):
        fits = [rows for rows in row_counts if batch * rows <= max_tokens and rows <= max_model_len]
        every_batch = sorted({fits[0], fits[-1]}) if fits else []  # off's own forward; the token table's point
        batch_one_only = [rows for rows in fits if rows not in every_batch] if batch == 1 else []
        for rows in batch_one_only:
            measured[batch, rows] = by_tokens[rows] = _least(functools.partial(_target_step, runner, batch, rows), sync)
        batch_start = time.perf_counter()
        for rows in every_batch:
            measured[batch, rows] = _least(functools.partial(_target_step, runner, batch, rows), sync)
            if batch == 1 or rows == fits[-1]:
                by_tokens[batch * rows] = measured[batch, rows]
        draft = None
        if speculative and batch * (1 + depth) <= max_tokens:
            draft = _least(functools.partial(_draft_pass, drafter, batch, depth, candidates), sync)
        for shape in shapes:
            rows = _rows(shape, depth)
            target = measured.get((batch, rows))
            if target is None and rows <= max_model_len:
                target = interpolated(by_tokens, batch * rows)
            if target is None or (not shape.is_off and draft is None):
                continue
            table[batch, shape] = target + (0.0 if shape.is_off else draft + _least(_tree_build(batch, depth, candidates, shape), sync))
        now = time.perf_counter()
        # the next batch size repeats this one's work at up to next / batch times the rows (`TIME_LIMIT_S`)
        go_on = next_batch is not None and now - start + (now - batch_start) * next_batch / batch <= TIME_LIMIT_S
        if group.world_size > 1:  # rank 0's decision on every rank: all run the same collective forwards
            go_on = bool(group.broadcast(torch.tensor([int(go_on)]), src=0)[0])
        if not go_on:
            break
    return table


def interpolated(seconds: dict[int, float], tokens: int) -> float | None:
    """seconds[tokens] where timed, else linear between the nearest timed token counts either side; None
    outside the timed range (the module's rules: a forward's cost is a function of its tokens)."""
    if tokens in seconds:
        return seconds[tokens]
    below = max((t for t in seconds if t < tokens), default=None)
    above = min((t for t in seconds if t > tokens), default=None)
    if below is None or above is None:
        return None
    return seconds[below] + (seconds[above] - seconds[below]) * (tokens - below) / (above - below)


def _target_step(runner: Any, batch: int, rows: int) -> None:
    """The target's forward over `batch` dummy requests of `rows` tokens each, as a verify step lays
    them out, each request's sequence its own rows (a short context), and its LM head over the rows a
    step with `rows` rows per request samples (all of them with drafts; one per request without).

    The layout is `_dummy_run`'s uniform one, its query length set to `rows` for this forward: its other
    layout makes min(tokens, max_num_seqs) requests, each with a sequence as long as all the tokens,
    which past max_model_len reads block ids beyond the request's block-table row (past the table's end
    for the last request), and the CPU attention kernel then loads keys from wild addresses (SIGSEGV).
    Here every request is a row of the block table (batch <= max_num_seqs) and its sequence fits in
    that row (rows <= max_model_len); slots are -1, so nothing is written to the KV cache. Eager
    (`CUDAGraphMode.NONE`): a graph captured for another query length must not replay this layout; the
    launch overhead that adds on a GPU is about the same for every shape, and the policy's per-kind
    offsets (`AdaptiveBudget._prior_offsets`) carry such a shared overhead."""
    runner._plain_step = True  # no speculative config: `_dummy_run` runs the target alone
    query_len, runner.uniform_decode_query_len = runner.uniform_decode_query_len, rows
    try:
        hidden_states, _ = runner._dummy_run(batch * rows, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                             uniform_decode=True)
    finally:
        runner._plain_step, runner.uniform_decode_query_len = False, query_len
    sampled = batch * rows if rows > 1 else batch
    runner.model.compute_logits(hidden_states[:sampled])


def _draft_pass(drafter: Any, batch: int, depth: int, candidates: int) -> None:
    """DFlash's dummy pass for `batch` requests (context store and block pass over batch x (1 + depth)
    rows), then its LM head and top-`candidates` over the batch x depth mask rows (`_sample_draft_tokens`)."""
    drafter.dummy_run(batch * (1 + depth))  # on a GPU, the graphs the engine's own draft passes replay
    saved = drafter._candidates
    drafter._candidates = candidates
    try:
        drafter._sample_draft_tokens(drafter.hidden_states[: batch * depth], None)
    finally:
        drafter._candidates, drafter._top = saved, None


def _tree_build(batch: int, depth: int, candidates: int, shape: TreeShape) -> Callable[[], Any]:
    """The host build of `batch` trees of `shape` from a fixed top-k (log-probs falling with depth and
    rank, every tree as full as its budget)."""
    k = min(candidates, shape.topk or candidates)
    logprobs = -(torch.arange(depth, dtype=torch.float32)[:, None] + torch.arange(k, dtype=torch.float32)[None, :] * 2 + 1) / 4
    top_logprobs = logprobs.expand(batch, depth, k).contiguous()
    top_token_ids = torch.arange(k, dtype=torch.int64).expand(batch, depth, k).contiguous() + 1
    roots = torch.zeros(batch, dtype=torch.int64)
    return lambda: build_draft_trees_on_host(roots, top_logprobs, top_token_ids, shape.budget, with_chain=True)
