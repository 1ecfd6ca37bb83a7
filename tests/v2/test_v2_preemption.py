"""Preemption under method 'ddtree' on vLLM's V2 model runner: a KV cache far too small for the batch,
so vLLM preempts requests mid-generation and recomputes them while trees are verified around them;
greedy output still equals plain decoding. (The V2 layer stores each step's draft context at once,
so no deferred context waits in blocks that change hands.)

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
    plain = run("v1", None, max_tokens=MAX_TOKENS, lengths=LENGTHS, **SMALL_CACHE)
    trees = run("v2", ddtree(8), max_tokens=MAX_TOKENS, lengths=LENGTHS, **SMALL_CACHE)
    return plain, trees


def test_preempted_and_resumed_requests_equal_plain_decoding(runs):
    plain, trees = runs
    assert trees.metrics["vllm:num_preemptions"] > 0
    assert len(trees.steps) > 10
    assert trees.token_ids == plain.token_ids
