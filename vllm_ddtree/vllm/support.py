"""Per-request options method 'ddtree' supports, checked when vLLM admits a request.

Served exactly: temperature, top_k, top_p, seeds, n > 1 (each sample is its own request), stop
strings and stop token ids (stops act on committed tokens), logprobs (top n >= 0) and prompt_logprobs
(each emitted token's from its node's logits row), and the options that depend on the tokens
generated so far: presence / frequency / repetition penalties, min_tokens, bad_words and
allowed_token_ids (every tree node is processed with its own history: the committed output plus its
path, `node_logits`). Refused: logprobs of the whole vocabulary (-1), logprob_token_ids, structured
outputs (no grammar state per tree node yet), thinking budgets and watermarking; vLLM 0.32 itself
refuses min_p and logit_bias under any speculative method (and builds no processor for them).
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
