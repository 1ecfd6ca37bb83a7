"""The target's token at every tree node, from vLLM's per-request sampling state (greedy or sampled).

Invariants:
- every tree request is sampled with the core's exact rule (`sample_tree_tokens`) under its own
  processed parameters (temperature, top_k, top_p as vLLM's input batch holds them; vLLM itself
  refuses min_p under speculative decoding): greedy and sampled requests mix freely in one batch;
- a seeded request draws from its own generator exactly once per valid node of its tree (one [n, V]
  exponential draw), whatever else is in the batch: same seed, same trees -> same tokens;
- vLLM's rejection sampler is never used (on CPU it is biased at T > 0 and crashes with top-k/top-p).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.core import TreeSamplingParams, sample_tree_tokens


def tree_sampling_params(sampling_metadata: Any, req_indices: torch.Tensor) -> TreeSamplingParams:
    """TreeSamplingParams of the tree requests `req_indices` (batch indices), in that order; generators
    are re-keyed to positions in `req_indices`."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return TreeSamplingParams(temperature=torch.zeros(len(req_indices)), all_greedy=True)
    positions = {r: t for t, r in enumerate(req_indices.tolist())}
    return TreeSamplingParams(
        temperature=sampling_metadata.temperature[req_indices],
        top_k=_rows(sampling_metadata.top_k, req_indices),
        top_p=_rows(sampling_metadata.top_p, req_indices),
        generators={positions[r]: g for r, g in sampling_metadata.generators.items() if r in positions},
        all_greedy=False,
    )


def _rows(values: torch.Tensor | None, rows: Any) -> torch.Tensor | None:
    return None if values is None else values[rows]


def _select(params: TreeSamplingParams, rows: list[int], generators: dict[int, torch.Generator]) -> TreeSamplingParams:
    """The parameters of requests `rows`, with `generators` keyed by position in `rows`."""
    return TreeSamplingParams(
        temperature=params.temperature[rows],
        top_k=_rows(params.top_k, rows),
        top_p=_rows(params.top_p, rows),
        generators=generators,
    )


def sample_nodes(node_logits: torch.Tensor, num_nodes: torch.Tensor, params: TreeSamplingParams) -> torch.Tensor:
    """[T, N, V] target logits at every (padded) node -> [T, N] the target's token at every node.

    Requests without a generator are sampled in one call; each seeded request alone over its valid
    nodes only, so its generator's draws do not depend on the batch's padding.
    """
    if params.all_greedy:
        return node_logits.argmax(dim=-1)
    seeded = params.generators
    unseeded = [t for t in range(node_logits.shape[0]) if t not in seeded]
    tokens = torch.zeros(node_logits.shape[:2], dtype=torch.long)
    if unseeded:
        tokens[unseeded] = sample_tree_tokens(node_logits[unseeded], _select(params, unseeded, {}))
    for t, generator in seeded.items():
        n = int(num_nodes[t])
        tokens[t, :n] = sample_tree_tokens(node_logits[t : t + 1, :n], _select(params, [t], {0: generator}))[0]
    return tokens
