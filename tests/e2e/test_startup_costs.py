"""Step costs timed when the engine starts (`vllm/startup_costs.py`): the table exists for every candidate
shape at every batch size timed, every sampling regime's policy starts from it, the policy's first
choices follow it, and the timing's dummy forwards stay inside the block table and leave the KV cache
as it was. No assertion on a timing's value: only that the table is there and is used."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.e2e.conftest import KV_CACHE_BYTES, heldout_code_prompts, model_runner
from vllm_ddtree.core import OFF, AdaptiveBudget, SamplingRegimes, TreeShape
from vllm_ddtree.core.budget import batch_bucket
from vllm_ddtree.vllm.v1 import startup_costs

BUDGET = 16
MAX_NUM_SEQS = 12
"""Batch sizes timed: 1, 3, 6 and 12, one per batch bucket up to max_num_seqs (`startup_costs.BATCHES`),
fewer where the timing reaches its time limit."""
MAX_MODEL_LEN = 128
"""One KV block per block-table row on CPU (128-token blocks), below the largest step's tokens
(MAX_NUM_SEQS x (BUDGET + 1) = 204): the condition under which a dummy layout that gives a request more
sequence than max_model_len reads past its row (`test_no_dummy_request_reads_past_its_block_table_row`)."""


@pytest.fixture(scope="module")
def engine(pair_dirs):
    from vllm import LLM

    target, draft = pair_dirs["trained"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_NUM_SEQS * (BUDGET + 1),
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
    batches = sorted({batch for batch, _ in table})
    assert batches == [1, 3, 6, 12][: len(batches)]
    assert set(table) == {(batch, shape) for batch in batches for shape in policy.shapes}
    assert all(seconds > 0 for seconds in table.values())
    assert policy.startup_costs == table
    for greedy in (True, False):  # each regime's policy, made on first use, starts from it
        policy.use(greedy)
        assert policy.policy.prior == {(batch_bucket(batch), shape): seconds for (batch, shape), seconds in table.items()}


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
    """A table that makes the tree of 4 ten times as cheap as every other shape: after the start (one step of
    a tree of 8, which measures every smaller shape's tokens: nothing is known of the text before it; the
    step after it is chosen before its tokens are in, and runs off), the policy runs the tree of 4 at once.
    The same policy without a table times the tree of 8 (two steps), then the references (off) before any
    other shape."""
    llm, runner = engine
    shapes = runner.drafter.budget_policy.shapes
    start, cheap = TreeShape(8), TreeShape(4)
    forced = {(batch, shape): 0.001 if shape == cheap else 0.01 for batch in (1, 3, 6, 12) for shape in shapes}
    seeded = SamplingRegimes(shapes)
    seeded.seed_costs(forced)
    chosen = first_choices(llm, runner, seeded)
    assert chosen[:3] == [start, OFF, cheap]
    unseeded = SamplingRegimes(shapes)
    chosen = first_choices(llm, runner, unseeded)
    assert chosen[:2] == [start, start]
    assert OFF in chosen and cheap not in chosen[: chosen.index(OFF)]
    assert isinstance(unseeded.policy, AdaptiveBudget) and not unseeded.policy.prior


def test_no_dummy_request_reads_past_its_block_table_row(engine, monkeypatch):
    """The timing's largest steps hold more tokens than max_model_len. vLLM's default dummy layout gave
    each of min(tokens, max_num_seqs) requests a sequence of all the tokens (204: two blocks where a
    block-table row holds one), so the CPU attention kernel read block ids past every row, past the
    table's end for the last one, and died of SIGSEGV wherever the heap there held no valid block id.
    Every attention metadata the timing builds must give each request a row of the table and a sequence
    that fits in it, each request exactly a verify's rows; and the timing writes nothing to the KV cache."""
    _, runner = engine
    monkeypatch.setattr(startup_costs, "TIME_LIMIT_S", float("inf"))  # every batch size, however slow the machine
    built = []  # (tokens, query lengths, sequence lengths, block-table shape), copied: the metadata's tensors are reused buffers
    build = runner._build_attention_metadata

    def recording_build(*args, **kwargs):
        out = build(*args, **kwargs)
        for metadata in out[0].values():
            starts = metadata.query_start_loc.tolist()
            num_reqs = starts.index(metadata.num_actual_tokens)
            built.append((metadata.num_actual_tokens, [b - a for a, b in itertools.pairwise(starts[:num_reqs + 1])],
                          metadata.seq_lens[:num_reqs].tolist(), tuple(metadata.block_table.shape)))
        return out

    monkeypatch.setattr(runner, "_build_attention_metadata", recording_build)
    kv_caches = [kv.clone() for kv in runner.kv_caches]
    policy = runner.drafter.budget_policy
    table = startup_costs.time_step_costs(runner, policy.shapes)
    assert {batch for batch, _ in table} == {1, 3, 6, 12}
    assert max(tokens for tokens, *_ in built) > MAX_MODEL_LEN  # the crash condition
    block_size = runner.cache_config.block_size
    verify_rows = {startup_costs._rows(shape, BUDGET) for shape in policy.shapes}
    assert all(len(seq_lens) <= table_rows and max(seq_lens) <= row_blocks * block_size
               for _, _, seq_lens, (table_rows, row_blocks) in built)
    assert all(len(set(query_lens)) == 1 and query_lens[0] in verify_rows for _, query_lens, *_ in built)
    assert all(torch.equal(before, after) for before, after in zip(kv_caches, runner.kv_caches))


def test_larger_batch_sizes_time_off_and_their_largest_forward_and_interpolate_the_rest(engine, monkeypatch):
    """Batch 1 times the target at every row count, each larger batch size at its smallest (off's) and
    largest row counts only; every other shape's target cost is the forwards' seconds interpolated at its
    tokens. With timings forced to a linear function of the tokens, the interpolation is exact, so every
    entry is that function plus the draft pass and the tree build."""
    _, runner = engine
    monkeypatch.setattr(startup_costs, "TIME_LIMIT_S", float("inf"))
    timed = []

    def forced_least(run, sync):
        if getattr(run, "func", None) is startup_costs._target_step:
            batch, rows = run.args[1:]
            timed.append((batch, rows))
            return 0.01 + 1e-4 * batch * rows
        return 0.002 if getattr(run, "func", None) is startup_costs._draft_pass else 0.0

    monkeypatch.setattr(startup_costs, "_least", forced_least)
    shapes = runner.drafter.budget_policy.shapes
    table = startup_costs.time_step_costs(runner, shapes)
    verify_rows = sorted({startup_costs._rows(shape, BUDGET) for shape in shapes})
    assert sorted(rows for batch, rows in timed if batch == 1) == verify_rows
    assert [(batch, rows) for batch, rows in timed if batch > 1] == [(batch, rows) for batch in (3, 6, 12) for rows in (1, verify_rows[-1])]
    assert set(table) == {(batch, shape) for batch in (1, 3, 6, 12) for shape in shapes}
    for (batch, shape), seconds in table.items():
        expected = 0.01 + 1e-4 * batch * startup_costs._rows(shape, BUDGET) + (0.0 if shape.is_off else 0.002)
        assert seconds == pytest.approx(expected, rel=1e-9)


def test_interpolated_is_exact_at_timed_tokens_linear_between_and_none_outside():
    seconds = {1: 1.0, 9: 2.0, 33: 5.0}
    assert startup_costs.interpolated(seconds, 9) == 2.0
    assert startup_costs.interpolated(seconds, 5) == pytest.approx(1.5)
    assert startup_costs.interpolated(seconds, 17) == pytest.approx(3.0)
    assert startup_costs.interpolated(seconds, 34) is None
    assert startup_costs.interpolated({}, 1) is None
