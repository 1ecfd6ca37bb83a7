"""The V2 layer's reader of each request's sampling options: `TreeSamplingParams` from V2's
`SamplingStates` (per request-state slot, host mirrors), and whether vLLM's own sampler may draw a
step without drafts.

V2 gives every request a seed (a random one where the user set none, `seeds_set` False): only the
user's seeds key the core rule's draws by (seed, position); the others draw from torch's generator.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_ddtree.core import TreeSamplingParams
from vllm_ddtree.core.sampling import GREEDY_EPS


def tree_sampling_params(states: Any, idx_mapping_np: np.ndarray, vocab_size: int, device: torch.device) -> TreeSamplingParams:
    """TreeSamplingParams of the batch (rows in batch order, `idx_mapping_np` [R] their state slots), on
    `device`. top_k 1 draws as greedy (plain sampling keeps only the largest logit), as V1's reader."""
    temperature = states.temperature.np[idx_mapping_np].copy()
    top_k = states.top_k.np[idx_mapping_np]
    temperature[top_k == 1] = 0.0
    greedy = temperature < GREEDY_EPS
    if greedy.all():
        return TreeSamplingParams(temperature=torch.zeros(len(idx_mapping_np), device=device), all_greedy=True)
    top_p, min_p = states.top_p.np[idx_mapping_np], states.min_p.np[idx_mapping_np]
    seeded = np.nonzero(states.seeds_set[idx_mapping_np])[0]
    seeds = states.seeds.np[idx_mapping_np]
    return TreeSamplingParams(
        temperature=torch.from_numpy(temperature).to(device),
        top_k=torch.from_numpy(top_k.astype(np.int64)).to(device) if (top_k < vocab_size).any() else None,
        top_p=torch.from_numpy(top_p.copy()).to(device) if (top_p < 1).any() else None,
        min_p=torch.from_numpy(min_p.copy()).to(device) if (min_p > 0).any() else None,
        seeds={int(i): int(seeds[i]) for i in seeded},
        all_greedy=False,
        any_greedy=bool(greedy.any()),
    )


def all_greedy(states: Any, idx_mapping_np: np.ndarray) -> bool:
    """Every request of the batch is greedy (temperature 0, or top_k 1)."""
    return bool(((states.temperature.np[idx_mapping_np] < GREEDY_EPS) | (states.top_k.np[idx_mapping_np] == 1)).all())


def vllm_sampler_serves(states: Any, idx_mapping_np: np.ndarray) -> bool:
    """Whether vLLM's sampler may draw a step without drafts: unless some request has the user's seed.
    The core rule keys a seeded request's token at position p by (seed, p), so its tokens never depend
    on which steps the budget policy ran without drafts; vLLM's seeded draws are keyed otherwise. Every
    other option V2 admits for method 'ddtree' draws from the same distribution either way."""
    return not bool(states.seeds_set[idx_mapping_np].any())
