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
and watermarking; also values vLLM admits offline but no engine serves: seeds a torch generator cannot
take (they stop any vLLM engine) and NaN logit_bias values. Such requests are refused at admission
(`check_request`, called from vLLM's request validation: the caller gets `UnsupportedRequestError`,
HTTP 400 when serving, a ValueError offline, and the engine keeps serving the other requests), never
served with the options ignored.
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


SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds a torch generator takes; vLLM's runner seeds one per seeded request (sample i of n > 1
with seed + i) when it first schedules it, and a seed outside this range raises there, stopping the
engine (plain decoding too; vLLM's server bounds seeds, offline calls are not bounded)."""


def invalid_values(params: Any) -> dict[str, str]:
    """Option -> why, for values vLLM admits but no engine can serve: a seed a torch generator cannot
    take (not an integer, or out of range: it would stop the engine), NaN logit_bias values (no
    distribution to draw from; vLLM's server clamps biases to [-100, 100], offline values pass as given)."""
    found = {}
    seed, samples = params.seed, max(1, params.n)
    if seed is not None and not (isinstance(seed, int) and SEED_RANGE[0] <= seed and seed + samples - 1 <= SEED_RANGE[1]):
        found["seed"] = (f"seed {seed!r} (with n={samples}) is not an integer a torch generator takes; "
                         f"use a seed in [{SEED_RANGE[0]}, {SEED_RANGE[1] - samples + 1}]")
    if params.logit_bias and any(bias != bias for bias in params.logit_bias.values()):
        found["logit_bias"] = "logit_bias values must be numbers (NaN given); use finite biases, or -inf / inf to ban / force a token"
    return found


def check_request(params: Any) -> None:
    """Raise UnsupportedRequestError if a SamplingParams uses options method 'ddtree' does not support,
    or values no engine can serve (`invalid_values`)."""
    invalid = invalid_values(params)
    if invalid:
        raise UnsupportedRequestError("; ".join(invalid.values()), parameter=next(iter(invalid)))
    found = unsupported_options(params)
    if found:
        raise UnsupportedRequestError(
            f"method 'ddtree' does not support {', '.join(found)}; "
            "use method 'dflash' or plain decoding for such requests",
            parameter=found[0],
        )
