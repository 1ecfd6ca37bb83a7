"""Per-request options method 'ddtree' supports, checked when vLLM admits a request.

The tree walk compares the target's token at every node with the node's children. Options that change
the target's distribution as a function of the tokens generated so far (penalties, min_tokens, logit
bias, bad words, grammars) would need each node's own history, which the flat batch does not give them.
logprobs (top n >= 0) and prompt_logprobs are served (each emitted token's from its node's logits
row); logprobs of the whole vocabulary (-1) and logprob_token_ids are not. Temperature, top_k, top_p, seeds, n > 1 (each
sample is its own request), stop strings and stop token ids are supported (the target's distribution at
a node depends on the node's logits only; stops act on committed tokens). vLLM 0.32 itself refuses
min_p and logit_bias under any speculative method.
Such requests are refused at admission (`check_request`, called from vLLM's request validation: the
caller gets `UnsupportedRequestError`, HTTP 400 when serving, a ValueError offline, and the engine
keeps serving the other requests), never served with the options ignored.
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError


class UnsupportedRequestError(VLLMValidationError, ValueError):
    """A request option method 'ddtree' cannot honour: vLLM's request-validation error (HTTP 400 when
    serving) that is also a ValueError (what an offline caller expects of invalid parameters)."""


def unsupported_options(params: Any) -> list[str]:
    """Names of the options in a vLLM SamplingParams that method 'ddtree' does not support."""
    checks = {
        "logprobs=-1 (the whole vocabulary)": params.logprobs is not None and params.logprobs < 0,
        "logprob_token_ids": bool(getattr(params, "logprob_token_ids", None)),
        "prompt_logprob_token_ids": getattr(params, "prompt_logprob_token_ids", None) is not None,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "min_tokens": params.min_tokens > 0,
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": bool(params.allowed_token_ids),
        "bad_words": bool(params.bad_words),
        "structured outputs": params.structured_outputs is not None,
        "thinking_token_budget": params.thinking_token_budget is not None,
        "watermarking": bool(params.watermarking),
    }
    return [name for name, present in checks.items() if present]


def check_request(params: Any) -> None:
    """Raise UnsupportedRequestError if a SamplingParams uses options method 'ddtree' does not support."""
    found = unsupported_options(params)
    if found:
        raise UnsupportedRequestError(
            f"method 'ddtree' does not support {', '.join(found)}; "
            "use method 'dflash' or plain decoding for such requests",
            parameter=found[0],
        )
