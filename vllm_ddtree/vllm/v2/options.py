"""The V2 layer's reader of each request's sampling options: a `RequestOptions` (`vllm/options.py`, the
record both runner layers hand the shared sampling code) from V2's `SamplingStates` (per request-state
slot, host mirrors).

V2 gives every request a seed (a random one where the user set none, `seeds_set` False): only the
user's seeds key the core rule's draws by (seed, position); the others draw from torch's generator.
The options V2 does not carry yet for method 'ddtree' are refused at admission (`support.REFUSALS`), so
the record holds the sampling parameters alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_ddtree.core.sampling import GREEDY_EPS
from vllm_ddtree.vllm.options import RequestOptions


def read_v2_options(states: Any, idx_mapping_np: np.ndarray, vocab_size: int, device: torch.device) -> RequestOptions:
    """The options of the batch's requests (rows in batch order, `idx_mapping_np` [R] their state slots),
    tensors on `device`. all_greedy counts top_k 1 as greedy (plain sampling keeps only the largest
    logit), as `RequestOptions.sampling_params` draws it."""
    # fancy indexing copies: the record never aliases vLLM's host mirrors
    temperature, top_k = states.temperature.np[idx_mapping_np], states.top_k.np[idx_mapping_np]
    seed_values = states.seeds.np[idx_mapping_np]
    seeds = {int(i): int(seed_values[i]) for i in np.nonzero(states.seeds_set[idx_mapping_np])[0]}
    greedy = temperature < GREEDY_EPS
    num_reqs = len(idx_mapping_np)
    if (greedy | (top_k == 1)).all():
        return RequestOptions(num_reqs=num_reqs, device=device, all_greedy=True, all_random=False, seeds=seeds)
    top_p, min_p = states.top_p.np[idx_mapping_np], states.min_p.np[idx_mapping_np]
    return RequestOptions(
        num_reqs=num_reqs,
        device=device,
        all_greedy=False,
        all_random=not bool(greedy.any()),
        temperature=torch.from_numpy(temperature).to(device),
        top_k=torch.from_numpy(top_k.astype(np.int64)).to(device) if (top_k < vocab_size).any() else None,
        top_p=torch.from_numpy(top_p).to(device) if (top_p < 1).any() else None,
        min_p=torch.from_numpy(min_p).to(device) if (min_p > 0).any() else None,
        seeds=seeds,
    )


def vllm_sampler_serves(options: RequestOptions) -> bool:
    """Whether vLLM's sampler may draw a step without drafts: unless some request has the user's seed.
    The core rule keys a seeded request's token at position p by (seed, p), so its tokens never depend
    on which steps the budget policy ran without drafts; vLLM's seeded draws are keyed otherwise. Every
    other option V2 admits for method 'ddtree' draws from the same distribution either way."""
    return not options.seeds
