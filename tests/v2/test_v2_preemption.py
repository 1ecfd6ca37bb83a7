"""The edges of a request's life under method 'ddtree' on vLLM's V2 model runner, greedy output equal
to plain decoding: preemption (a KV cache far too small for the batch, so vLLM preempts requests
mid-generation and recomputes them while trees are verified around them; the V2 layer stores each
step's draft context at once, so no deferred context waits in blocks that change hands; every request
has penalties, so a resumed request's node histories come from the output vLLM hands back with it,
`v2/output_mirror.py`), and requests that run into max_model_len (the scheduler cuts the last trees to
the room left).

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from tests.v2.engines import ddtree, run  # noqa: E402

LENGTHS = (7, 20, 45, 30)
MAX_TOKENS = 120
SMALL_CACHE = {"kv_cache_memory_bytes": 3_000_000, "max_model_len": 256}  # about 480 tokens: the batch does not fit


@pytest.fixture(scope="module")
def runs():
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3 * (i % 2))
              for i in range(len(LENGTHS))]
    plain = run("v1", None, lengths=LENGTHS, params=params, **SMALL_CACHE)
    trees = run("v2", ddtree(8), lengths=LENGTHS, params=params, **SMALL_CACHE)
    return plain, trees


def test_preempted_and_resumed_requests_equal_plain_decoding(runs):
    plain, trees = runs
    assert trees.metrics["vllm:num_preemptions"] > 0
    assert len(trees.steps) > 10
    assert trees.token_ids == plain.token_ids


def test_requests_that_reach_max_model_len_equal_plain_decoding():
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    plain = run("v1", None, params=params, max_model_len=72)
    trees = run("v2", ddtree(), params=params, max_model_len=72)
    assert trees.finish_reasons == ["length"] * 3 and trees.steps
    assert [len(tokens) for tokens in trees.token_ids] == [72 - n for n in (7, 20, 45)]
    assert trees.token_ids == plain.token_ids
