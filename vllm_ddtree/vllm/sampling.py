"""The target's token at every tree node, from vLLM's per-request sampling state (greedy or sampled).

Invariants:
- every tree request is sampled with the core's exact rule (`sample_tree_tokens`) under its own
  processed parameters (temperature, top_k, top_p as vLLM's input batch holds them; vLLM itself
  refuses min_p under speculative decoding): greedy and sampled requests mix freely in one batch;
- a seeded request's draws are keyed by (its seed, the position drawn) (the seed is its vLLM
  generator's initial seed; the generator's stream is not used for tree nodes), so its tokens do not
  depend on its tree's shape or size, on the scheduler cutting trees, or on the rest of the batch;
- vLLM's rejection sampler is never used (on CPU it is biased at T > 0 and crashes with top-k/top-p).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.core import TreeSamplingParams, sample_tree_tokens
from vllm_ddtree.core.sampling import argmax_first


def tree_sampling_params(sampling_metadata: Any, req_indices: torch.Tensor) -> TreeSamplingParams:
    """TreeSamplingParams of the tree requests `req_indices` (batch indices), in that order; seeds are
    keyed by position in `req_indices`."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return TreeSamplingParams(temperature=torch.zeros(len(req_indices)), all_greedy=True)
    positions = {r: t for t, r in enumerate(req_indices.tolist())}
    return TreeSamplingParams(
        temperature=sampling_metadata.temperature[req_indices],
        top_k=_rows(sampling_metadata.top_k, req_indices),
        top_p=_rows(sampling_metadata.top_p, req_indices),
        seeds={positions[r]: g.initial_seed() for r, g in sampling_metadata.generators.items() if r in positions},
        all_greedy=False,
    )


def _rows(values: torch.Tensor | None, rows: Any) -> torch.Tensor | None:
    return None if values is None else values[rows]


def sample_nodes(
    logits: torch.Tensor, node_logit_rows: torch.Tensor, draw_positions: torch.Tensor, params: TreeSamplingParams
) -> torch.Tensor:
    """The target's token [T, N] at every (padded) node, from the step's logits [rows, V] and the row of
    each node's logits node_logit_rows [T, N]; draw_positions [T, N]: the sequence position each node's
    token is drawn for (root position + depth + 1). Greedy batches take row argmaxes before selecting
    nodes (no [T, N, V] copy)."""
    if params.all_greedy:
        return argmax_first(logits)[node_logit_rows]
    node_logits = logits.index_select(0, node_logit_rows.flatten()).view(*node_logit_rows.shape, -1)  # not logits[rows]: 6x slower on CPU
    return sample_tree_tokens(node_logits, params, draw_positions, inplace=True)
