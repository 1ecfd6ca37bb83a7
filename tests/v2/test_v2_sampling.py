"""Sampled requests under method 'ddtree' on vLLM's V2 model runner: the core's rule draws every tree
node (and every token of a batch with a seeded request) under each request's temperature, top_k, top_p
and min_p, a seeded request's draws keyed by (seed, position). So a seeded request's tokens are the
V1 layer's token for token, whatever the trees, the policy's off steps or the rest of the batch (here:
V1 at a fixed budget, V2 under the default adaptive policy, beside an unseeded sampled request and a
greedy one). The distribution itself is tested on the shared rule (tests/core) and on V1's engines.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from tests.v2.engines import ddtree, run  # noqa: E402

LENGTHS = (7, 20, 45, 30, 12)
MAX_TOKENS = 20
OPTIONS = [
    {"temperature": 0.8, "seed": 1},
    {"temperature": 1.0, "seed": 2, "top_k": 20, "top_p": 0.9},
    {"temperature": 0.7, "seed": 3, "min_p": 0.05},
    {"temperature": 0.9},  # unseeded
    {"temperature": 0.0},
]
COMPARED = [0, 1, 2, 4]  # the seeded requests and the greedy one


@pytest.fixture(scope="module")
def runs():
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options) for options in OPTIONS]
    v1 = run("v1", ddtree(8), lengths=LENGTHS, params=params)
    v2 = run("v2", ddtree(8, ddtree_adaptive=True), lengths=LENGTHS, params=params)
    greedy = run("v1", None, max_tokens=MAX_TOKENS, lengths=LENGTHS)
    return v1, v2, greedy


def test_seeded_and_greedy_tokens_on_v2_equal_v1s(runs):
    v1, v2, _ = runs
    assert v2.steps  # trees were verified
    assert [v2.token_ids[i] for i in COMPARED] == [v1.token_ids[i] for i in COMPARED]


def test_the_sampled_requests_were_sampled(runs):
    """The power of the equality above: the sampled requests' tokens are not their greedy ones."""
    _, v2, greedy = runs
    assert all(v2.token_ids[i] != greedy.token_ids[i] for i in range(4))
    assert v2.token_ids[4] == greedy.token_ids[4]
    assert len(v2.token_ids[3]) == MAX_TOKENS
