"""The V2 layer's reader of each request's options: a `RequestOptions` (`vllm/options.py`, the record
both runner layers hand the shared sampling code) from V2's `SamplingStates` (temperature, top_k, top_p,
min_p, seeds: per request-state slot, host mirrors) and from the host's copy of each request's
SamplingParams, prompt and committed output (`output_mirror`, D12): penalties, min_tokens, bad words,
logit bias and allowed token ids, read as V1's input batch and logits processors read them
(`v1/options.py`), so both layers process every tree node alike (`node_logits`).

V2 gives every request a seed (a random one where the user set none, `seeds_set` False): only the
user's seeds key the core rule's draws by (seed, position); the others draw from torch's generator.
Logprobs are not part of the record on V2: vLLM's sampler keeps them (`Sampler.get_logprobs_dims`),
and `v2/logprobs.py` reads them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_ddtree.core.sampling import GREEDY_EPS
from vllm_ddtree.vllm.options import MinTokens, Penalties, RequestOptions, token_counts
from vllm_ddtree.vllm.v2.output_mirror import MirroredRequest, has_penalties


def read_v2_options(states: Any, idx_mapping_np: np.ndarray, requests: Sequence[MirroredRequest], vocab_size: int, device: torch.device) -> RequestOptions:
    """The options of the batch's requests (rows in batch order, `idx_mapping_np` [R] their state slots,
    `requests` [R] their mirrored params and output), tensors on `device`. all_greedy counts top_k 1
    as greedy (plain sampling keeps only the largest logit), as `RequestOptions.sampling_params` draws it."""
    # fancy indexing copies: the record never aliases vLLM's host mirrors
    temperature, top_k = states.temperature.np[idx_mapping_np], states.top_k.np[idx_mapping_np]
    seed_values = states.seeds.np[idx_mapping_np]
    seeds = {int(i): int(seed_values[i]) for i in np.nonzero(states.seeds_set[idx_mapping_np])[0]}
    greedy = temperature < GREEDY_EPS
    num_reqs = len(idx_mapping_np)
    options = RequestOptions(num_reqs=num_reqs, device=device, all_greedy=True, all_random=False, seeds=seeds)
    if not (greedy | (top_k == 1)).all():
        top_p, min_p = states.top_p.np[idx_mapping_np], states.min_p.np[idx_mapping_np]
        options.all_greedy = False
        options.all_random = not bool(greedy.any())
        options.temperature = torch.from_numpy(temperature).to(device)
        options.top_k = torch.from_numpy(top_k.astype(np.int64)).to(device) if (top_k < vocab_size).any() else None
        options.top_p = torch.from_numpy(top_p).to(device) if (top_p < 1).any() else None
        options.min_p = torch.from_numpy(min_p).to(device) if (min_p > 0).any() else None
    _read_history_options(options, requests, vocab_size, device)
    return options


def _read_history_options(options: RequestOptions, requests: Sequence[MirroredRequest], vocab_size: int, device: torch.device) -> None:
    """Fill `options`' per-node fields from the requests' params, as V1's reader has them: allowed ids as
    a [R, V] mask (True: banned), bad words and logit bias of the requests that have some, min_tokens
    while the output is short of it (stops: `all_stop_token_ids`), every request's penalties once one
    has any, and the committed outputs."""
    outputs = [request.output if request.output is not None else () for request in requests]
    disallowed = None
    for row, request in enumerate(requests):
        params = request.params
        if params.allowed_token_ids:
            if disallowed is None:
                disallowed = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
            disallowed[row] = True
            disallowed[row, params.allowed_token_ids] = False
        if params.bad_words_token_ids:
            options.bad_words[row] = params.bad_words_token_ids
        if params.logit_bias:
            options.logit_bias[row] = params.logit_bias
        if params.min_tokens and len(outputs[row]) < params.min_tokens:
            stops = tuple(sorted(params.all_stop_token_ids))
            options.min_tokens[row] = MinTokens(params.min_tokens - len(outputs[row]), stops, params.structured_outputs is not None)
    options.disallowed = None if disallowed is None else disallowed.to(device)
    options.output_token_ids = outputs
    if any(has_penalties(request.params) for request in requests):
        options.penalties = _penalties(requests, outputs, vocab_size, device)


def _penalties(requests: Sequence[MirroredRequest], outputs: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Penalties:
    """Every request's penalties (0, 0, 1 for those without: their logits come out unchanged)."""
    values = torch.tensor([[r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty] for r in requests], dtype=torch.float32)
    return Penalties(
        presence=values[:, 0].to(device),
        frequency=values[:, 1].to(device),
        repetition=values[:, 2].to(device),
        prompt_mask=token_counts([r.prompt for r in requests], vocab_size, device) > 0,
        output_counts=token_counts(outputs, vocab_size, device),
    )


def vllm_sampler_serves(options: RequestOptions, has_structured_requests: bool, wants_logprobs: bool) -> bool:
    """Whether vLLM's sampler may draw a step without drafts: unless some request has the user's seed,
    an option processed at every node, a grammar or logprobs (`wants_logprobs`: vLLM's sampler reports
    some for the batch). The core rule keys a seeded request's token at position p by (seed, p), so its
    tokens never depend on which steps the budget policy ran without drafts; vLLM's seeded draws are
    keyed otherwise. The options `node_logits` processes, the grammars (`node_grammar`: the scheduler
    sends 'ddtree' engines no masks) and logprobs (each from its node's row, `v2/logprobs.py`) take one
    path, this rule's, at every step (and the output mirror, which the first two read, is fed only by
    it), as V1's `sampling.plain_sampler_serves`. Every other option V2 admits for method 'ddtree' draws
    from the same distribution either way."""
    return not (options.seeds or options.needs_node_processing or has_structured_requests or wants_logprobs)
