"""Step costs timed when the engine starts (`vllm/startup_costs.py`): the table exists for every candidate
shape at every batch size timed, every sampling regime's policy starts from it, and the policy's first
choices follow it. No assertion on a timing's value: only that the table is there and is used."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, heldout_code_prompts, model_runner
from vllm_ddtree.core import OFF, AdaptiveBudget, SamplingRegimes, TreeShape

BUDGET = 16
MAX_NUM_SEQS = 4
"""Batch sizes timed: 1 and 3, one per batch bucket up to max_num_seqs (`startup_costs.BATCHES`)."""


@pytest.fixture(scope="module")
def engine(pair_dirs):
    from vllm import LLM

    target, draft = pair_dirs["trained"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=4 * (BUDGET + 1),
              max_num_seqs=MAX_NUM_SEQS, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    yield llm, model_runner(llm)
    llm.llm_engine.engine_core.shutdown()


def test_the_start_up_table_times_every_candidate_shape_at_every_batch_size(engine):
    _, runner = engine
    policy = runner.drafter.budget_policy
    assert isinstance(policy, SamplingRegimes)
    table = runner.startup_costs
    assert table is not None and runner.startup_seconds > 0
    assert {batch for batch, _ in table} == {1, 3}
    assert set(table) == {(batch, shape) for batch in (1, 3) for shape in policy.shapes}
    assert all(seconds > 0 for seconds in table.values())
    assert policy.startup_costs == table
    for greedy in (True, False):  # each regime's policy, made on first use, starts from it
        policy.use(greedy)
        assert policy.policy.prior == {(0 if batch == 1 else 1, shape): seconds for (batch, shape), seconds in table.items()}


def first_choices(llm, runner, policy, steps: int = 6) -> list[TreeShape]:
    """The shapes `policy` chooses over the first steps of one greedy request, set on the runner first."""
    from vllm import SamplingParams

    chosen = []
    choose = policy.choose

    def recording_choose(num_requests, context_tokens=0.0):
        shape = choose(num_requests, context_tokens)
        chosen.append(shape)
        return shape

    policy.choose = recording_choose
    runner.use_budget_policy(policy)
    llm.generate(heldout_code_prompts((40,)), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return chosen[:steps]


def test_the_policys_first_choices_follow_the_start_up_table(engine):
    """A table that makes the tree of 4 ten times as cheap as every other shape: after the start (a tree of
    8, which measures every smaller shape's tokens: nothing is known of the text before it), the policy
    runs the tree of 4 at once. The same policy without a table times the tree of 8, then the references
(off) before any other shape."""
    llm, runner = engine
    shapes = runner.drafter.budget_policy.shapes
    start, cheap = TreeShape(8), TreeShape(4)
    forced = {(batch, shape): 0.001 if shape == cheap else 0.01 for batch in (1, 3) for shape in shapes}
    seeded = SamplingRegimes(shapes)
    seeded.seed_costs(forced)
    chosen = first_choices(llm, runner, seeded)
    assert chosen[:2] == [start, start]
    assert chosen[2] == cheap
    unseeded = SamplingRegimes(shapes)
    chosen = first_choices(llm, runner, unseeded)
    assert chosen[:2] == [start, start]
    assert OFF in chosen and cheap not in chosen[: chosen.index(OFF)]
    assert isinstance(unseeded.policy, AdaptiveBudget) and not unseeded.policy.prior
