"""vLLM's greedy chain and DDTree on the embedded pair agree exactly with the pure-PyTorch reference loop.

Same pair, same held-out prompt ids, same algorithm, both in float32: the greedy tokens are identical,
and so are vLLM's spec-decode counters and the reference's step record: the number of drafts (steps),
the accepted draft tokens, the steps whose accepted path reached each depth, and hence tokens per
step. No tolerance: the two share nothing but the checkpoints, so any difference is a bug, or two
draft log-probs tied to float precision that the two float32 implementations round apart; no such
tie occurs on these prompts, and one appearing (say on another CPU's kernels) should fail loudly
rather than hide under a tolerance.
"""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def test_vllm_tokens_per_step_match_the_reference():
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts
    from vllm_ddtree.demo.check_pair_vllm import compare

    target, draft = demo_pair_paths()
    out = compare(target, draft, heldout_prompts(6, 48), max_tokens=64, budgets=[8, 32])
    assert out["plain_equals_reference_greedy"]
    assert set(out["variants"]) == {"dflash chain", "ddtree 8", "ddtree 32"}
    for name, v in out["variants"].items():
        assert v["tokens_equal_plain"], name
        assert v["vllm_drafts"] == v["reference_drafts"], (name, v)
        assert v["vllm_accepted"] == v["reference_accepted"], (name, v)
        assert v["vllm_accepted_per_position"] == v["reference_accepted_per_position"], (name, v)
        assert v["vllm_tokens_per_step"] == v["reference_tokens_per_step"], (name, v)
    assert out["variants"]["ddtree 32"]["vllm_tokens_per_step"] > out["variants"]["dflash chain"]["vllm_tokens_per_step"]
