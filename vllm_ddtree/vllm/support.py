"""Per-request options method 'ddtree' supports, checked when vLLM admits a request.

Served exactly: temperature, top_k, top_p, seeds, n > 1 (each sample is its own request), stop strings
and stop token ids (stops act on committed tokens), logprobs (top n, the whole vocabulary with -1,
`logprob_token_ids`: each emitted token's from its node's logits row, gathered by vLLM's sampler) and
prompt_logprobs (-1 too; vLLM's own prompt rows), the options that depend on the tokens generated so
far: presence / frequency / repetition penalties, min_tokens, bad_words and allowed_token_ids (every
tree node is processed with its own history: the committed output plus its path, `node_logits`), min_p
and logit_bias (vLLM 0.32 refuses both under any speculative method; a declared patch lifts that for
'ddtree' engines), and structured outputs (JSON schema, JSON object, regex, choice, grammar) with the
xgrammar or guidance backend (every tree node masked by the grammar state after its path,
`node_grammar`), also under a reasoning parser (the grammar starts where vLLM starts it: nodes are
masked once the reasoning has ended on the output or the node's path, `node_reasoning`). (vLLM 0.32
itself caps logprobs and prompt_logprobs at the engine's max_logprobs, -1 included, and refuses
prompt_logprob_token_ids on the V1 model runner, which method 'ddtree' runs on.) Refused: structured
outputs with another backend (outlines, lm-format-enforcer: not tested under trees), thinking budgets
and watermarking. Such requests are refused at admission (`check_request`, called from vLLM's request
validation: the caller gets `UnsupportedRequestError`, HTTP 400 when serving, a ValueError offline, and
the engine keeps serving the other requests), never served with the options ignored.
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError

SERVED_BACKENDS = ("xgrammar", "guidance")
"""The structured-output backends method 'ddtree' serves (`node_grammar.BACKENDS` builds them)."""


class UnsupportedRequestError(VLLMValidationError, ValueError):
    """A request option method 'ddtree' cannot honour: vLLM's request-validation error (HTTP 400 when
    serving) that is also a ValueError (what an offline caller expects of invalid parameters)."""


def unsupported_options(params: Any) -> list[str]:
    """Names of the options in a vLLM SamplingParams that method 'ddtree' does not support, once vLLM
    validated it (which resolves the structured-output backend)."""
    structured = params.structured_outputs
    backend = None if structured is None else structured._backend
    checks = {
        f"structured outputs with the {backend!r} backend (served: {', '.join(SERVED_BACKENDS)})": (
            structured is not None and backend is not None and backend not in SERVED_BACKENDS
        ),
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
