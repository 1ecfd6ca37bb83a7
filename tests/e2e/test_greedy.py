"""Greedy method 'ddtree' on vLLM's CPU backend equals plain decoding and vLLM's method 'dflash'.

Batches of 8 prompts (3..100 tokens, the longest prefilled in chunks of 64) under budgets 1,
block_size - 1 and 32, on a random pair (drafts almost never accepted: verification must be exact
whatever is drafted), a focused pair (drafts accepted deep in the tree, through non-rank-0
children: tree attention, walk, KV compaction and draft context all matter) and the embedded trained
pair on held-out code (a real draft: the tree beats the chain).
"""

from __future__ import annotations

import pytest

from tests.e2e.pairs import BLOCK_SIZE

BUDGETS = (1, BLOCK_SIZE - 1, 32)


@pytest.mark.parametrize("pair", ["random", "focused", "trained"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_output_equals_plain_and_dflash(engine_runs, pair, budget):
    plain = engine_runs(pair, None)
    dflash = engine_runs(pair, ("dflash", BLOCK_SIZE - 1))
    ddtree = engine_runs(pair, ("ddtree", budget))
    assert ddtree.token_ids == plain.token_ids
    assert dflash.token_ids == plain.token_ids
    assert all(len(t) == 32 for t in ddtree.token_ids)


@pytest.mark.parametrize("pair", ["focused", "trained"])
def test_tree_accepts_deep_and_off_the_greedy_chain(engine_runs, pair):
    run = engine_runs(pair, ("ddtree", 32))
    assert run.tokens_per_step > 1.5
    ranks_of_accepted = []
    for step in run.steps:
        nodes = step.acceptance.accepted_nodes
        ranks_of_accepted += step.tree.ranks.gather(1, nodes.clamp(min=0))[nodes > 0].tolist()
    assert any(rank > 0 for rank in ranks_of_accepted), "every accepted node was a rank-0 child"
    assert max(int(step.acceptance.num_accepted.max()) for step in run.steps) >= 3


def test_tree_of_top1_candidates_is_dflash_chain(engine_runs):
    """topk 1 leaves block_size - 1 distinct paths, fewer than the budget: the tree is DFlash's chain,
    so acceptance matches stock DFlash exactly; budget 1 matches DFlash with one token likewise."""
    chain = engine_runs("focused", ("ddtree", 32, {"ddtree_topk": 1}))
    dflash = engine_runs("focused", ("dflash", BLOCK_SIZE - 1))
    assert chain.token_ids == dflash.token_ids
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
        assert chain.metrics[name] == dflash.metrics[name], name
    assert chain.metrics["vllm:spec_decode_num_draft_tokens"] == (BLOCK_SIZE - 1) * chain.metrics["vllm:spec_decode_num_drafts"]

    single = engine_runs("focused", ("ddtree", 1))
    dflash1 = engine_runs("focused", ("dflash", 1))
    assert single.metrics["vllm:spec_decode_num_accepted_tokens"] == dflash1.metrics["vllm:spec_decode_num_accepted_tokens"]
    assert single.metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_spec_decode_metrics_count_tree_steps(engine_runs):
    """drafts = verify steps, draft tokens = verified nodes, accepted = accepted nodes, per-position
    counter i = steps that accepted a node at depth i + 1."""
    run = engine_runs("focused", ("ddtree", 32))
    accepted_per_step = [n - 1 for step in run.steps for n in step.acceptance.num_accepted.tolist()]
    nodes_per_step = [n - 1 for step in run.steps for n in step.tree.num_nodes.tolist()]
    metrics = run.metrics
    assert metrics["vllm:spec_decode_num_drafts"] == len(accepted_per_step)
    assert metrics["vllm:spec_decode_num_draft_tokens"] == sum(nodes_per_step)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(accepted_per_step)
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 32
    assert per_pos == [sum(a > i for a in accepted_per_step) for i in range(32)]


def test_trained_pair_tree_beats_its_chain(engine_runs):
    """On held-out code the trained draft's chain accepts several tokens and the tree accepts more."""
    chain = engine_runs("trained", ("dflash", BLOCK_SIZE - 1))
    tree = engine_runs("trained", ("ddtree", 32))
    assert chain.tokens_per_step > 2.0
    assert tree.tokens_per_step > 1.15 * chain.tokens_per_step


@pytest.mark.parametrize("pair", ["focused", "trained"])
def test_adaptive_budget_is_lossless_and_cuts_trees(engine_runs, pair):
    """ddtree_adaptive: each step verifies a prefix of every tree (sometimes none of it); output unchanged.
    What the policy picks after its cold start depends on the machine's timing, so only what does not is
    asserted: a fresh engine's policy starts with trees of 8 nodes (cut from the cap 32), so some steps
    verify drafts and some verify fewer than 32."""
    plain = engine_runs(pair, None)
    run = engine_runs(pair, ("ddtree", 32, {"ddtree_adaptive": True}))
    assert run.token_ids == plain.token_ids
    verified = [n - 1 for step in run.steps for n in step.tree.num_nodes.tolist()]
    assert min(verified) < 32 and max(verified) > 0
