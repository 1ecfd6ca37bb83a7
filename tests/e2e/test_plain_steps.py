"""A step without drafts is plain decoding, drawn by vLLM's own sampler where that changes nothing.

With the policy scripted to never speculate, a batch of greedy and unseeded sampled requests
(temperature, top_p) gets exactly plain vLLM's tokens from the same engine seed: the same sampler
consumes the same random stream. A batch with any request whose tokens must not depend on which
steps ran without drafts (seeded), or whose options only the core rule serves, is drawn by the core
rule on every step instead (`sampling.plain_sampler_serves`): in vLLM's plain layout, no tree step
built, when its options are each request's parameters alone (seed, top_k, min_p), through a tree
step of roots alone when they read the request's history or ask for logprobs
(`sampling.plain_layout_serves`).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, model_runner, prompts
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, candidate_shapes

BUDGET = 8
VLLM = "vLLM's sampler"
MAX_TOKENS = 12


def _engine(target: str, draft: str | None):
    """Both engines schedule the same batches (no prompt is prefilled in chunks: a speculative
    engine's scheduler splits chunks differently), so their samplers draw the same random stream."""
    from vllm import LLM

    spec = None if draft is None else {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET}
    return LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
               kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN,
               max_num_seqs=16, seed=0, speculative_config=spec)


def _mixed_params():
    from vllm import SamplingParams

    options = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.3}]
    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options[i % len(options)]) for i in range(len(prompts()))]


@pytest.fixture(scope="module")
def plain_tokens(pair_dirs):
    target, _ = pair_dirs["random"]
    llm = _engine(target, None)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), _mixed_params(), use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def off_engine(pair_dirs, plain_tokens):
    """A method 'ddtree' engine whose policy never speculates, and the log of its steps' draws: VLLM for
    vLLM's sampler, the runner's method's name for a tree step built or plain rows drawn by the core
    rule (built after the plain engine is gone: one in-process engine at a time)."""
    llm = _engine(*pair_dirs["random"])
    runner = model_runner(llm)
    runner.use_budget_policy(ScriptedBudget(candidate_shapes(BUDGET, runner.drafter.max_depth), [OFF]))
    draws = []
    for owner, name, label in ((runner.sampler, "forward", VLLM), (runner, "_build_step", None), (runner, "_sample_plain_rows", None)):
        method = getattr(owner, name)

        def logged(*args, _method=method, _label=label or name, **kwargs):
            draws.append(_label)
            return _method(*args, **kwargs)

        setattr(owner, name, logged)
    yield llm, draws
    llm.llm_engine.engine_core.shutdown()


def test_off_steps_of_unseeded_requests_equal_plain_vllm_from_the_same_seed(off_engine, plain_tokens):
    llm, draws = off_engine
    draws.clear()
    outputs = llm.generate(prompts(), _mixed_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_tokens
    assert draws and set(draws) == {VLLM}, "vLLM's sampler drew no step, or a step was not plain"


PARAMETERS_ALONE = [{"seed": 7}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 3, "top_k": 2, "min_p": 0.05}]
HISTORY_OR_LOGPROBS = [
    {"logprobs": 2},
    {"presence_penalty": 0.5},
    {"repetition_penalty": 1.2},
    {"logit_bias": {3: 2.0}},
    {"min_tokens": 4},
    {"allowed_token_ids": [3, 4, 5, 6]},
]


@pytest.mark.parametrize("option", PARAMETERS_ALONE + HISTORY_OR_LOGPROBS, ids=str)
def test_a_request_only_the_core_rule_serves_keeps_its_batch_on_the_core_rule(off_engine, option):
    from vllm import SamplingParams

    llm, draws = off_engine
    draws.clear()
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **option)]
    outputs = llm.generate(prompts()[:2], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert VLLM not in draws, f"vLLM's sampler drew a batch with {option}"
    # every step of the batch (prefill and 3 decodes) in one layout: plain, or a tree step of roots alone
    expected = "_sample_plain_rows" if option in PARAMETERS_ALONE else "_build_step"
    assert draws == [expected] * 4, f"{option}: {draws}"
