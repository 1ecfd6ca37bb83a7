"""Structured outputs under method 'ddtree' with tensor parallelism 2 (multiprocess executor): every
rank keeps its own grammars (`node_grammar`), built from the request's params as they reach the worker,
so every rank must mask and prune alike and commit plain decoding's tokens.

The trained pair (tokenizer), xgrammar, budget 16, greedy, regex / JSON schema / EBNF grammar, against
an in-process plain engine's outputs computed first (`engine_runs` rule).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.e2e.test_structured_outputs import MAX_TOKENS, _kinds

KINDS = ("regex", "json schema", "grammar")
NUM_PROMPTS = 3


def _generate(llm) -> dict[str, list[list[int]]]:
    from vllm import SamplingParams

    from vllm_ddtree.demo import heldout_prompts

    texts = heldout_prompts(NUM_PROMPTS, 48, as_text=True)
    out = {}
    for kind in KINDS:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_kinds()[kind])
        out[kind] = [list(o.outputs[0].token_ids) for o in llm.generate(texts, params, use_tqdm=False)]
    return out


def _engine(target: str, **kwargs):
    from vllm import LLM

    return LLM(model=target, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
               max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048, max_num_seqs=16, seed=0,
               structured_outputs_config={"backend": "xgrammar"}, **kwargs)


@pytest.fixture(scope="module")
def plain(pair_dirs) -> dict[str, list[list[int]]]:
    llm = _engine(pair_dirs["trained"][0], distributed_executor_backend="uni")
    try:
        return _generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def tensor_parallel(plain, pair_dirs) -> dict[str, list[list[int]]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    target, draft = pair_dirs["trained"]
    llm = _engine(target, tensor_parallel_size=2, distributed_executor_backend="mp",
                  speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False})
    try:
        return _generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        mp.undo()


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_structured_greedy_equals_plain_decoding(plain, tensor_parallel, kind):
    assert tensor_parallel[kind] == plain[kind]
