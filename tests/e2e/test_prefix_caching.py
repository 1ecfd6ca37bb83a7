"""Prefix caching under method 'ddtree': a hit reuses every full block of the prompt, the trailing one
included (vLLM drops it for EAGLE-like drafts; `config.rewrite_engine_args` keeps it), and the blocks a
request leaves in the cache hold the draft's context K/V of every position, also of positions computed
by steps without speculation (their context is deferred: `DDTreeProposer.defer_context`).

The embedded trained pair, one request of 400 prompt tokens (blocks of 128 on CPU: three full blocks
cached), greedy, the policy's shapes forced (`ScriptedBudget`): the chain verifies a request as many
steps after a hit as without one, when the hit's blocks were filled by steps without speculation and the
draft's KV cache was zeroed before (so any position whose context was not stored would read zeros, and
the chain would accept fewer drafts and take more steps after the hit). Of the finished
request's deferred rows, those of its full blocks are stored, once each, and those of its last, partial
block are not: the engine caches full blocks only, so nothing reads them.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import model_runner
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, candidate_shapes

BUDGET = 8
PROMPT_TOKENS = 400
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine(pair_dirs):
    from vllm import LLM

    target, draft = pair_dirs["trained"]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni", seed=0,
              kv_cache_memory_bytes=128 * 2**20, max_model_len=1024, enable_prefix_caching=True,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_a_hit_keeps_the_trailing_block_and_finds_the_drafts_context_of_steps_without_speculation(engine):
    from vllm import SamplingParams

    from vllm_ddtree.demo.engines import context_prompts

    runner = model_runner(engine)
    block_size = engine.llm_engine.vllm_config.cache_config.block_size
    shapes = candidate_shapes(BUDGET, runner.drafter.max_depth)
    chain = next(shape for shape in shapes if shape.is_chain)
    prompt = [{"prompt_token_ids": context_prompts(1, PROMPT_TOKENS)[0]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    steps: list[int] = []
    execute_model = runner.execute_model

    def counting(*args, **kwargs):
        steps.append(1)
        return execute_model(*args, **kwargs)

    runner.execute_model = counting

    def serve(shape):
        runner.use_budget_policy(ScriptedBudget(shapes, [shape]))
        steps.clear()
        output = engine.generate(prompt, params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids), output.num_cached_tokens, len(steps)

    def zero_draft_kv_cache():
        context = runner.compilation_config.static_forward_context
        for name in runner.drafter._draft_attn_layer_names:
            kv_cache = context[name].kv_cache
            (kv_cache[0] if isinstance(kv_cache, list) else kv_cache).zero_()

    engine.reset_prefix_cache()
    fresh_tokens, fresh_cached, fresh_steps = serve(chain)
    assert fresh_cached == 0

    engine.reset_prefix_cache()
    zero_draft_kv_cache()
    drafter = runner.drafter
    store_deferred, store = drafter.store_deferred_context, drafter.model.precompute_and_store_context_kv
    stored: list[int] = []  # positions a store of deferred rows wrote

    def recording_store_deferred(*args):
        drafter.model.precompute_and_store_context_kv = recording_store
        try:
            return store_deferred(*args)
        finally:
            drafter.model.precompute_and_store_context_kv = store

    def recording_store(states, positions, slots):
        stored.extend(positions.tolist())
        return store(states, positions, slots)

    drafter.store_deferred_context = recording_store_deferred
    try:
        off_tokens, off_cached, _ = serve(OFF)  # every step without drafts: the context is deferred
        assert off_cached == 0
        # stored by the next request's first step, where the engine reports the request finished
        hit_tokens, hit_cached, hit_steps = serve(chain)
    finally:
        drafter.store_deferred_context = store_deferred
    # stored once each: the full blocks' positions; the last, partial block's never (nothing reads it)
    computed = PROMPT_TOKENS + MAX_TOKENS - 1
    assert sorted(stored) == list(range(computed // block_size * block_size))
    assert hit_cached == (PROMPT_TOKENS - 1) // block_size * block_size  # every full block, the last included
    assert hit_tokens == fresh_tokens == off_tokens
    assert abs(hit_steps - fresh_steps) <= 1, (hit_steps, fresh_steps)
    assert fresh_steps < MAX_TOKENS * 3 // 4  # the chain accepts drafts on this text: the comparison means something
