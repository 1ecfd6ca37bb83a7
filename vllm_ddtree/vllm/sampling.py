"""The target's token at every tree node, from vLLM's per-request sampling state (greedy or sampled).

Invariants:
- every tree request is sampled with the core's exact rule (`sample_tree_tokens`) under its own
  processed parameters (temperature, top_k, top_p as vLLM's input batch holds them; vLLM itself
  refuses min_p under speculative decoding): greedy and sampled requests mix freely in one batch;
- a seeded request's draws are keyed by (its seed, the position drawn) (the seed is its vLLM
  generator's initial seed; the generator's stream is not used for tree nodes), so its tokens do not
  depend on its tree's shape or size, on the scheduler cutting trees, or on the rest of the batch;
- every tree node's token comes from this rule; vLLM's rejection sampler is never used (on CPU it is
  biased at T > 0). A step without drafts (no speculation this step, prefills) is plain decoding, and
  vLLM's own sampler serves it when that changes nothing (`plain_sampler_serves`): the same
  distribution and greedy token, and no request whose tokens must not depend on which steps ran
  without drafts (seeded draws) or whose options take a path only this rule implements.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

from vllm_ddtree.core import TreeSamplingParams, sample_tree_tokens
from vllm_ddtree.vllm.node_logits import needs_node_processing


def tree_sampling_params(
    sampling_metadata: Any, num_reqs: int, device: torch.device, top_k_one_is_greedy: bool = True
) -> TreeSamplingParams:
    """TreeSamplingParams of the batch's first `num_reqs` requests (vLLM's input batch order), their
    tensors on `device` (the logits').

    top_k_one_is_greedy: draw top_k 1 as greedy: plain sampling keeps only the largest logit (ties
    aside), and the argmax is exactly what a greedy request emits (logprobs keep the request's own
    parameters)."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return TreeSamplingParams(temperature=torch.zeros(num_reqs, device=device), all_greedy=True)
    temperature = sampling_metadata.temperature[:num_reqs]
    top_k = _rows(sampling_metadata.top_k, num_reqs)
    if top_k is not None and top_k_one_is_greedy:
        temperature = torch.where(top_k == 1, 0.0, temperature)
    # vLLM's host flag: no request is greedy (and none was made greedy above): no device sync to learn it.
    no_greedy = sampling_metadata.all_random and (top_k is None or not top_k_one_is_greedy)
    return TreeSamplingParams(
        all_greedy=False if no_greedy else None,
        any_greedy=False if no_greedy else None,
        temperature=temperature,
        top_k=top_k,
        top_p=_rows(sampling_metadata.top_p, num_reqs),
        min_p=_min_p(sampling_metadata, num_reqs, device),
        seeds={int(i): g.initial_seed() for i, g in sampling_metadata.generators.items() if int(i) < num_reqs},
    )


def plain_sampler_serves(metadata: Any, has_structured_requests: bool) -> bool:
    """Whether vLLM's sampler may draw a step without drafts for the batch of `metadata` (vLLM's
    sampling metadata); on a CPU it is the cheaper of the two (one fused draw, no per-node gathers). It may when every request is greedy, or sampled with temperature and top_p alone, and
    none is:
    - seeded: this rule keys its draws by (seed, position), so its tokens do not depend on which steps
      the policy ran without drafts; vLLM's generator stream would;
    - top_k: vLLM's CPU top-k-only path raises on a top_k above the vocabulary size (engine down);
    - min_p, penalties, bad words, allowed tokens, logit bias, min_tokens (`needs_node_processing`),
      structured (the runner masks grammar itself, `node_grammar`), asking for logprobs: each is served
      by one path, this rule's, at every step, so what it yields never depends on the policy."""
    return not (
        has_structured_requests
        or metadata.generators
        or metadata.top_k is not None
        or metadata.max_num_logprobs is not None
        or metadata.logprob_token_ids
        or _min_p_processor(metadata) is not None
        or needs_node_processing(metadata)
    )


def _min_p(sampling_metadata: Any, num_reqs: int, device: torch.device) -> torch.Tensor | None:
    """[num_reqs] min_p of each request (0: off), from vLLM's min_p processor; None when none uses it."""
    processor = _min_p_processor(sampling_metadata)
    return None if processor is None else processor.min_p_cpu_tensor[:num_reqs].to(device, copy=True)


def _min_p_processor(sampling_metadata: Any) -> MinPLogitsProcessor | None:
    """vLLM's min_p processor of the batch when some request uses min_p."""
    for processor in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
            return processor
    return None


def _rows(values: torch.Tensor | None, num_reqs: int) -> torch.Tensor | None:
    return None if values is None else values[:num_reqs]


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
