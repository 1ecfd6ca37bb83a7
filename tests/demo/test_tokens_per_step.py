"""Tokens per decode step from vLLM's spec counters, which count only steps that proposed tokens."""

from __future__ import annotations

from vllm_ddtree.demo.side_by_side import SpecCounters, tokens_per_decode_step


def test_a_method_that_drafts_every_step_gives_one_plus_accepted_per_draft():
    # 2 requests x 11 output tokens: prefills 2, then 10 decode steps committing 20 tokens (10 accepted)
    assert tokens_per_decode_step(SpecCounters(drafts=10, draft_tokens=70, accepted=10), 22, 2) == 2.0


def test_steps_without_a_proposal_count():
    # 1 request, 31 tokens: prefill 1, 4 drafted steps accepting 6 each (28 tokens), 2 steps proposing nothing
    assert tokens_per_decode_step(SpecCounters(drafts=4, draft_tokens=28, accepted=24), 31, 1) == 1.0 + 24 / 6


def test_accepted_drafts_cut_by_max_tokens_fall_back_to_drafts():
    # 1 request, max_tokens 10: prefill 1, steps commit 4 + 4 + (4 accepted + 1, of which 1 output)
    assert tokens_per_decode_step(SpecCounters(drafts=3, draft_tokens=21, accepted=10), 10, 1) == 1.0 + 10 / 3


def test_no_speculation_is_one_token_per_step():
    assert tokens_per_decode_step(SpecCounters(), 100, 4) == 1.0
