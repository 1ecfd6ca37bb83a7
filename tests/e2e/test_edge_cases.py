"""Edge cases of method 'ddtree': requests at max_model_len, max_tokens=1, EOS inside an accepted path,
preemption.

One engine per method (plain, ddtree budget 32) serves the first three groups of requests in one
batch, on the focused pair (drafts accepted deep) with max_model_len 128.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import prompts, run_engine
from tests.e2e.pairs import EOS_TOKEN_ID

MAX_MODEL_LEN = 128
EOS_PROMPTS = prompts()
LONG_PROMPTS = prompts(lengths=(96, 120, 126, 127), seed=3)
SHORT_PROMPTS = prompts(lengths=(5, 40), seed=5)


@pytest.fixture(scope="module")
def edge_runs(pair_dirs):
    from vllm import SamplingParams

    target, draft = pair_dirs["focused"]
    requests = EOS_PROMPTS + LONG_PROMPTS + SHORT_PROMPTS
    params = (
        [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=False)] * len(EOS_PROMPTS)
        + [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)] * len(LONG_PROMPTS)
        + [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)] * len(SHORT_PROMPTS)
    )
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 32, "ddtree_adaptive": False}
    return {
        name: run_engine(target, config, requests, params, max_model_len=MAX_MODEL_LEN)
        for name, config in (("plain", None), ("ddtree", spec))
    }


def _group(run, start, count):
    return run.token_ids[start : start + count], run.finish_reasons[start : start + count]


def test_edge_requests_equal_plain_decoding(edge_runs):
    assert edge_runs["ddtree"].token_ids == edge_runs["plain"].token_ids
    assert edge_runs["ddtree"].finish_reasons == edge_runs["plain"].finish_reasons


def test_requests_run_up_to_max_model_len_and_trees_stay_inside(edge_runs):
    run = edge_runs["ddtree"]
    outputs, reasons = _group(run, len(EOS_PROMPTS), len(LONG_PROMPTS))
    for prompt, out, reason in zip(LONG_PROMPTS, outputs, reasons):
        assert len(prompt["prompt_token_ids"]) + len(out) == MAX_MODEL_LEN
        assert reason == "length"
    for step in run.steps:
        assert int((step.starts + step.tree.num_nodes).max()) <= MAX_MODEL_LEN


def test_max_tokens_one_emits_one_token(edge_runs):
    outputs, reasons = _group(edge_runs["ddtree"], len(EOS_PROMPTS) + len(LONG_PROMPTS), len(SHORT_PROMPTS))
    assert [len(out) for out in outputs] == [1] * len(SHORT_PROMPTS)
    assert reasons == ["length"] * len(SHORT_PROMPTS)


def test_eos_inside_accepted_path_ends_the_output(edge_runs):
    run = edge_runs["ddtree"]
    outputs, reasons = _group(run, 0, len(EOS_PROMPTS))
    stopped = [out for out, reason in zip(outputs, reasons) if reason == "stop"]
    assert stopped and all(out[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in out[:-1] for out in stopped)
    eos_then_more = [
        row[: n].index(EOS_TOKEN_ID) < n - 1
        for step in run.steps
        for row, n in zip(step.acceptance.output_token_ids.tolist(), step.acceptance.num_accepted.tolist())
        if EOS_TOKEN_ID in row[:n]
    ]
    assert any(eos_then_more), "no verify step accepted tokens past an EOS"


def test_preempted_requests_equal_plain_decoding(pair_dirs):
    """A KV cache too small for the batch: vLLM preempts and recomputes requests mid-generation."""
    from vllm import SamplingParams

    target, draft = pair_dirs["focused"]
    requests = prompts(lengths=(3, 7, 12, 20, 31, 5, 9), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=230, ignore_eos=True)
    small = {"kv_cache_memory_bytes": 3_000_000, "max_model_len": 256}
    plain = run_engine(target, None, requests, params, **small)
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 7, "ddtree_adaptive": False}
    ddtree = run_engine(target, spec, requests, params, **small)
    assert ddtree.metrics["vllm:num_preemptions"] > 0
    assert ddtree.token_ids == plain.token_ids
