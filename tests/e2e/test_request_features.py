"""Per-request features under method 'ddtree' (the README's "Per-request features" table), offline.

One ddtree engine and one plain engine on the trained pair (it has a tokenizer: text prompts, stop
strings, bad words and JSON schemas need one) serve the same script, `_serve`:

1. plain greedy requests are admitted and run a few engine steps; while they are in flight, a
   request for logprobs over max_logprobs, an empty prompt and one over max_model_len are offered
   (ddtree only) and each is refused on its own (by vLLM, as under plain decoding); one more plain request is admitted after the refusals;
   everything runs to completion;
2. one `generate` batch of supported features: stop strings, n > 1 (near-greedy and sampled, seeded).

The greedy outputs of both parts must equal the plain engine's. (Seeds across batch compositions and
stop token ids: tests/e2e/test_temperature.py; HTTP 400 under load: tests/e2e/test_load.py.)
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN

BUDGET = 16
MAX_TOKENS = 40
STOPS = [  # (stop strings, include_stop_str_in_output)
    (["\n"], False),
    (["(", ")"], False),
    ([" = "], True),
    (["return", "self"], False),
    (["\n\n"], True),
    ([":"], False),
]
SAMPLES = 3  # n of the n > 1 requests
# Scheduler token budget: enough for every running request's whole tree (at most 12 x (BUDGET + 1)).
# A smaller one cuts trees when the batch is full, and a seeded request's draws then depend on the batch.
TOKEN_BUDGET = 512


def _unsupported() -> dict[str, tuple[dict, str, dict | None]]:
    """option -> (SamplingParams keywords, the refusal's message, the prompt if not the usual one).
    vLLM 0.32 itself refuses empty prompts, prompts over max_model_len, logprobs over the engine's
    max_logprobs (20 by default; -1 asks for the whole vocabulary) (and greedy n > 1) whatever the
    method. (Penalties, min_tokens, bad_words, allowed_token_ids, min_p and logit_bias are served:
    test_history_options.py; logprobs=-1 and logprob_token_ids: test_logprobs_vocabulary.py;
    structured outputs and the refusals of method 'ddtree': test_structured_outputs.py.)"""
    cases = {"logprobs=-1 over max_logprobs": ({"logprobs": -1}, "greater than max allowed: 20", None)}
    cases["empty prompt"] = ({}, "The decoder prompt cannot be empty", {"prompt_token_ids": []})
    cases["prompt over max_model_len"] = (
        {}, f"maximum context length is {MAX_MODEL_LEN} tokens", {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}
    )
    return cases


def _greedy(**kw):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY, **kw)


def _serve(llm, texts: list[str], ddtree: bool) -> dict:
    """Run the script above; the refusals and the n > 1 requests only under ddtree (the plain engine
    supplies the greedy references)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    first, late = texts[:3], texts[3]
    for i, text in enumerate(first):
        engine.add_request(f"plain-{i}", text, _greedy(ignore_eos=True))
    for _ in range(3):
        engine.step()
    refusals = {}
    in_flight_at_refusal = engine.has_unfinished_requests()
    for name, (kw, _, prompt) in (_unsupported().items() if ddtree else ()):
        try:
            engine.add_request(f"bad-{name}", prompt or texts[4], _greedy(**kw))
            refusals[name] = None
        except Exception as error:  # noqa: BLE001 - the test inspects what was raised
            refusals[name] = error
    engine.add_request("plain-late", late, _greedy(ignore_eos=True))
    plain = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                plain[out.request_id] = list(out.outputs[0].token_ids)

    stop_params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=stop, include_stop_str_in_output=keep)
                   for stop, keep in STOPS]
    sample_params = [
        SamplingParams(temperature=0.01, n=SAMPLES, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, n=SAMPLES, seed=2, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    if not ddtree:
        sample_params = []
    outs = llm.generate(texts[: len(STOPS)] + texts[: len(sample_params)], stop_params + sample_params, use_tqdm=False)
    result = {
        "refusals": refusals,
        "in_flight_at_refusal": in_flight_at_refusal,
        "plain": plain,
        "stops": [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                  for o in outs[: len(STOPS)]],
        "samples": [[list(c.token_ids) for c in o.outputs] for o in outs[len(STOPS):]],
    }
    if ddtree:  # the sampled n > 1 request again, in another batch: its seeded samples must come back unchanged
        again = llm.generate([texts[5], texts[1]], [stop_params[5], sample_params[1]], use_tqdm=False)[1]
        result["samples_again"] = [list(c.token_ids) for c in again.outputs]
    return result


@pytest.fixture(scope="module")
def served(pair_dirs):
    from vllm import LLM

    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(len(STOPS), 48, as_text=True)
    results = {}
    for name, spec in (("ddtree", {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET}), ("plain", None)):
        llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=TOKEN_BUDGET,
                  max_num_seqs=16, seed=0, speculative_config=spec)
        try:
            results[name] = _serve(llm, texts, ddtree=name == "ddtree")
        finally:
            llm.llm_engine.engine_core.shutdown()
    return results


@pytest.mark.parametrize("option", list(_unsupported()))
def test_unsupported_option_refused_for_that_request_only(served, option):
    from vllm.exceptions import VLLMValidationError

    error = served["ddtree"]["refusals"][option]
    assert served["ddtree"]["in_flight_at_refusal"]
    assert isinstance(error, VLLMValidationError), f"{option}: {error!r}"  # HTTP 400 when serving
    assert _unsupported()[option][1] in str(error)


def test_requests_around_refusals_equal_plain_decoding(served):
    ddtree, plain = served["ddtree"]["plain"], served["plain"]["plain"]
    assert sorted(ddtree) == ["plain-0", "plain-1", "plain-2", "plain-late"]
    assert ddtree == plain
    assert all(len(tokens) == MAX_TOKENS for tokens in ddtree.values())


def test_stop_strings_equal_plain_decoding(served):
    """Text, tokens, finish and stop reason equal plain decoding (a ddtree step commits several tokens at
    once; those after the stop string must not reach the output)."""
    ddtree, plain = served["ddtree"]["stops"], served["plain"]["stops"]
    assert ddtree == plain
    stopped = [(text, reason) for text, _, finish, reason in ddtree if finish == "stop"]
    assert len(stopped) >= 3, ddtree
    for (text, _, finish, reason), (stop, keep) in zip(ddtree, STOPS):
        if finish == "stop":
            assert reason in stop and text.endswith(reason) == keep


def test_n_above_one_serves_each_sample(served):
    """n > 1 runs as n requests. At temperature 0.01 (vLLM's smallest; it clamps lower ones) the samples
    mostly follow the greedy output (not always: where the top-2 logits are within ~0.05 the runner-up
    keeps a few percent); at 0.8 the samples differ and their seeds reproduce them in another batch."""
    near_greedy, sampled = served["ddtree"]["samples"]
    greedy_plain = served["plain"]["plain"]["plain-0"]  # prompt 0, greedy, ignore_eos, MAX_TOKENS
    assert len(near_greedy) == SAMPLES and all(len(s) == MAX_TOKENS for s in near_greedy)
    assert all(s[:8] == greedy_plain[:8] for s in near_greedy)
    assert len(sampled) == SAMPLES and all(len(s) == MAX_TOKENS for s in sampled)
    assert len({tuple(s) for s in sampled}) > 1
    assert served["ddtree"]["samples_again"] == sampled


def test_seeded_sample_independent_of_batch_when_token_budget_cuts_trees(pair_dirs):
    """Same seed, same sample whatever the batch, also when max_num_batched_tokens cannot hold every
    running request's BUDGET + 1 tokens and the scheduler cuts trees: a seeded request's draws are keyed
    by position, not by its tree."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(11, 48, as_text=True)
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
              max_num_seqs=16, seed=0, speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    try:
        seeded = SamplingParams(temperature=0.8, seed=2, max_tokens=MAX_TOKENS, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        alone = llm.generate([texts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
        crowd = llm.generate(texts[1:] + texts[:1], [greedy] * 10 + [seeded], use_tqdm=False)[-1].outputs[0].token_ids
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(crowd) == list(alone)
