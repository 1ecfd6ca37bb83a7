"""vLLM's greedy chain and DDTree on the embedded pair agree with the pure-PyTorch reference loop.

Same pair, same held-out prompt ids, same algorithm: the greedy tokens are identical and tokens per
step (from vLLM's own counters) is within 2% of the reference's (they agree exactly unless two draft
log-probs tie to float precision).
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
        assert v["relative_difference"] <= 0.02, (name, v)
    assert out["variants"]["ddtree 32"]["vllm_tokens_per_step"] > out["variants"]["dflash chain"]["vllm_tokens_per_step"]
