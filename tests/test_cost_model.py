"""The verify-step all-reduce model: zero without TP, the ring formula by hand, the expected scalings."""

from __future__ import annotations

import math

import pytest

from vllm_ddtree.cost_model import NVLINK4, PCIE5_X16, LinkModel, allreduce_seconds, verify_allreduce_seconds

QWEN3_8B = {"hidden_size": 4096, "num_layers": 36}


def test_no_tensor_parallelism_costs_nothing():
    assert verify_allreduce_seconds(16, 64, tp=1, link=NVLINK4, **QWEN3_8B) == 0.0


def test_rejects_a_tp_size_below_one():
    with pytest.raises(ValueError):
        allreduce_seconds(1024, 0, NVLINK4)


def test_qwen3_8b_tp8_batch1_budget64_matches_the_ring_formula_by_hand():
    link = LinkModel("test", bandwidth=400e9, latency=5e-6)
    message = 65 * 4096 * 2  # tokens x hidden x bf16 bytes = 532,480
    per_allreduce = 5e-6 + 2 * 7 / 8 * message / 400e9
    expected = 2 * 36 * per_allreduce
    assert math.isclose(verify_allreduce_seconds(1, 64, tp=8, link=link, **QWEN3_8B), expected, rel_tol=1e-12)


def test_bandwidth_term_grows_linearly_with_tree_tokens_and_latency_term_does_not():
    zero_latency = LinkModel("bandwidth only", NVLINK4.bandwidth, 0.0)
    small = verify_allreduce_seconds(4, 15, tp=8, link=zero_latency, **QWEN3_8B)  # 64 tokens
    large = verify_allreduce_seconds(4, 63, tp=8, link=zero_latency, **QWEN3_8B)  # 256 tokens
    assert math.isclose(large, 4 * small, rel_tol=1e-12)
    latency_only = LinkModel("latency only", math.inf, 10e-6)
    assert verify_allreduce_seconds(1, 0, tp=8, link=latency_only, **QWEN3_8B) == verify_allreduce_seconds(16, 255, tp=8, link=latency_only, **QWEN3_8B)


def test_pcie_is_slower_than_nvlink_and_more_gpus_move_more_ring_traffic():
    assert verify_allreduce_seconds(16, 64, tp=8, link=PCIE5_X16, **QWEN3_8B) > verify_allreduce_seconds(16, 64, tp=8, link=NVLINK4, **QWEN3_8B)
    assert allreduce_seconds(1 << 20, 8, NVLINK4) > allreduce_seconds(1 << 20, 2, NVLINK4)
