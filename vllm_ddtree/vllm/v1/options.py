"""`RequestOptions` read from vLLM's V1 model runner. V1 only: vLLM 0.34 deleted V1's `SamplingMetadata`
and logits processors, and this file goes with the V1 layer (the V2 layer reads `SamplingStates` and
its `Sampler`'s states instead).

V1 keeps a batch's options in its input batch's `SamplingMetadata` (temperature, top_k, top_p,
generators, penalties, allowed tokens, bad words, logprobs) and in its logits processors: min_tokens
(the one vLLM builds under speculative decoding), min_p and logit_bias (added by our runner,
`_serve_min_p_and_logit_bias`). vLLM refuses custom logits processors under speculative decoding, so
those three are all there are.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_ddtree.vllm.options import MinTokens, Penalties, RequestOptions, token_counts


def read_v1_options(metadata: Any, num_reqs: int, device: torch.device, vocab_size: int) -> RequestOptions:
    """The options of the batch's first `num_reqs` requests from V1's sampling metadata (its state
    after `_update_states`: committed outputs up to date), tensors on `device`."""
    processors = {type(p): p for p in (*metadata.logitsprocs.argmax_invariant, *metadata.logitsprocs.non_argmax_invariant)}
    assert set(processors) <= {MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor}, processors
    greedy = metadata.all_greedy or metadata.temperature is None
    return RequestOptions(
        num_reqs=num_reqs,
        device=device,
        all_greedy=greedy,
        all_random=metadata.all_random,
        temperature=None if greedy else metadata.temperature[:num_reqs],
        top_k=_rows(metadata.top_k, num_reqs),
        top_p=_rows(metadata.top_p, num_reqs),
        min_p=_min_p(processors.get(MinPLogitsProcessor), num_reqs, device),
        seeds={int(i): g.initial_seed() for i, g in metadata.generators.items() if int(i) < num_reqs},
        disallowed=_rows(metadata.allowed_token_ids_mask, num_reqs),
        bad_words={r: words for r, words in (metadata.bad_words_token_ids or {}).items() if r < num_reqs},
        min_tokens=_min_tokens(processors.get(MinTokensLogitsProcessor), num_reqs),
        logit_bias=_logit_bias(processors.get(LogitBiasLogitsProcessor), num_reqs),
        penalties=None if metadata.no_penalties else _penalties(metadata, num_reqs, vocab_size, device),
        output_token_ids=metadata.output_token_ids,
        num_logprobs=metadata.max_num_logprobs,
        logprob_token_ids=metadata.logprob_token_ids or {},
    )


def _rows(values: torch.Tensor | None, num_reqs: int) -> torch.Tensor | None:
    return None if values is None else values[:num_reqs]


def _min_p(processor: MinPLogitsProcessor | None, num_reqs: int, device: torch.device) -> torch.Tensor | None:
    if processor is None or not processor.min_p_count:
        return None
    return processor.min_p_cpu_tensor[:num_reqs].to(device, copy=True)


def _min_tokens(processor: MinTokensLogitsProcessor | None, num_reqs: int) -> dict[int, MinTokens]:
    """The processor's requests (by batch index) whose output is still short of min_tokens."""
    if processor is None:
        return {}
    return {
        r: MinTokens(min_tokens - len(output), tuple(sorted(stops)), structured)
        for r, (min_tokens, output, stops, structured) in processor.min_toks.items()
        if r < num_reqs and len(output) < min_tokens
    }


def _logit_bias(processor: LogitBiasLogitsProcessor | None, num_reqs: int) -> dict[int, dict[int, float]]:
    if processor is None:
        return {}
    return {r: biases for r, biases in processor.biases.items() if r < num_reqs}


def _penalties(metadata: Any, num_reqs: int, vocab_size: int, device: torch.device) -> Penalties:
    prompt = metadata.prompt_token_ids[:num_reqs]  # [R, P], padded with vocab_size
    prompt_mask = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt.to(device), True)
    return Penalties(
        presence=metadata.presence_penalties[:num_reqs],
        frequency=metadata.frequency_penalties[:num_reqs],
        repetition=metadata.repetition_penalties[:num_reqs],
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=token_counts(metadata.output_token_ids[:num_reqs], vocab_size, device),
    )
