"""The target's token at every tree node, from the batch's `RequestOptions` (greedy or sampled).

Invariants:
- every tree request is sampled with the core's exact rule (`sample_tree_tokens`) under its own
  parameters (temperature, top_k, top_p, min_p: `RequestOptions.sampling_params`): greedy and sampled
  requests mix freely in one batch;
- a seeded request's draws are keyed by (its seed, the position drawn) (on V1 the seed is its vLLM
  generator's initial seed; the generator's stream is not used for tree nodes), so its tokens do not
  depend on its tree's shape or size, on the scheduler cutting trees, or on the rest of the batch;
- every tree node's token comes from this rule; vLLM's rejection sampler is never used (on CPU it is
  biased at T > 0). A step without drafts (no speculation this step, prefills) is plain decoding, and
  vLLM's own sampler serves it when that changes nothing (`plain_sampler_serves`): the same
  distribution and greedy token, and no request whose tokens must not depend on which steps ran
  without drafts (seeded draws) or whose options take a path only this rule implements.
"""

from __future__ import annotations

import torch

from vllm_ddtree.core import TreeSamplingParams, sample_tree_tokens
from vllm_ddtree.vllm.options import RequestOptions


def plain_sampler_serves(options: RequestOptions, has_structured_requests: bool) -> bool:
    """Whether the runner's own (vLLM's) sampler may draw a step without drafts for a batch with these
    options; on a CPU it is the cheaper of the two (one fused draw, no per-node gathers). It may when
    every request is greedy, or sampled with temperature and top_p alone, and none is:
    - seeded: this rule keys its draws by (seed, position), so its tokens do not depend on which steps
      the policy ran without drafts; vLLM's generator stream would;
    - top_k: vLLM's CPU top-k-only path raises on a top_k above the vocabulary size (engine down);
    - min_p, penalties, bad words, allowed tokens, logit bias, min_tokens (`needs_node_processing`),
      structured (the runner masks grammar itself, `node_grammar`), asking for logprobs: each is served
      by one path, this rule's, at every step, so what it yields never depends on the policy."""
    return not (
        has_structured_requests
        or options.seeds
        or options.top_k is not None
        or options.wants_logprobs
        or options.min_p is not None
        or options.needs_node_processing
    )


def plain_layout_serves(options: RequestOptions, has_structured_requests: bool) -> bool:
    """Whether a step without drafts may keep vLLM's plain layout (one logits row per request, no
    `TreeStep`): vLLM's sampler draws it (`plain_sampler_serves`), or this rule does from each request's
    parameters alone (temperature, top_k, top_p, min_p, its seed and the position drawn). Options that
    read the request's history (`needs_node_processing`), grammars and logprobs take the tree path, which
    serves them for every step alike."""
    return not (has_structured_requests or options.wants_logprobs or options.needs_node_processing)


def gather_node_logits(logits: torch.Tensor, node_logit_rows: torch.Tensor) -> torch.Tensor:
    """[T, N, V] float32 copy of every node's logits row (index_select: logits[rows] is several times slower on CPU)."""
    return logits.index_select(0, node_logit_rows.flatten()).view(*node_logit_rows.shape, -1).to(torch.float32)


def sample_nodes(
    logits: torch.Tensor,
    node_logit_rows: torch.Tensor,
    draw_positions: torch.Tensor | None,
    params: TreeSamplingParams,
    processed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's token [T, N] at every (padded) node, from the step's logits [rows, V] and the row of
    each node's logits node_logit_rows [T, N]; draw_positions [T, N]: the sequence position each node's
    token is drawn for (root position + depth + 1; None when no request is seeded). processed
    [T, N, V]: the nodes' logits after their history-dependent options
    (`node_logits.process_node_logits`; left unchanged), None when the batch uses none. (A greedy batch
    without them never comes here: the runner reads its nodes' tokens off the rows' argmaxes,
    `host_tree.accept_greedy_rows_on_host`.)"""
    if processed is not None:
        return sample_tree_tokens(processed, params, draw_positions)
    return sample_tree_tokens(gather_node_logits(logits, node_logit_rows), params, draw_positions, inplace=True)
