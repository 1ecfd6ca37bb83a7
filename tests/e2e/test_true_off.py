"""Steps without speculation are true "off" steps: the draft's block pass does not run, and the draft
still resumes with its full context.

An off step only keeps the context of the tokens the target computed (DFlash's KV injection), stored
as K/V in one pass with other off steps' rows before the next draft pass: no pass over the mask
block, no draft LM head, no top-k. The shapes are forced by a `ScriptedBudget`
on the embedded trained pair (greedy), whose draft reads its context: if off steps left holes in the
draft's context, the trees after them would accept fewer tokens per verify step than trees on every
step; the tests below require at least 95% of theirs, which trees after off steps miss by a wide margin
when the context store is removed.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import CHUNK, KV_CACHE_BYTES, MAX_MODEL_LEN, heldout_code_prompts, model_runner, record_verified_steps
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, TreeShape, candidate_shapes
from vllm_ddtree.vllm.v1 import proposer

BUDGET = 16
TREE = TreeShape(BUDGET)
SCRIPTS = {"trees": [TREE], "off, tree": [OFF, TREE], "3 off, tree": [OFF, OFF, OFF, TREE], "off": [OFF]}
SMALL_PASSES = "3 off, tree, small store passes"
"""The "3 off, tree" script again with DEFERRED_BYTES at 2 rows: deferred rows stored whenever a step's
would pass it, and a step with more rows (a prefill chunk, a batch's off step) stored at once."""
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def script_runs(pair_dirs):
    """Per script: the outputs, the tokens per verify step and the number of draft LM-head passes."""
    from vllm import LLM, SamplingParams

    target, draft = pair_dirs["trained"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK,
              max_num_seqs=16, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    runner = model_runner(llm)
    steps: list = []
    record_verified_steps(runner, steps)
    draft_heads = []
    sample_draft = runner.drafter._sample_draft_tokens

    def counting_sample_draft(*args, **kwargs):
        draft_heads.append(runner.drafter.deferred_rows)  # context rows not yet stored when the draft reads it
        return sample_draft(*args, **kwargs)

    runner.drafter._sample_draft_tokens = counting_sample_draft
    context_layouts = _check_context_layouts(runner)
    metadata_checks = _check_no_draft_spec_metadata(runner)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    stores = []
    store_context = runner.drafter._store_context

    def counting_store(states, positions, slots):
        stores.append(positions.shape[0])
        return store_context(states, positions, slots)

    runner.drafter._store_context = counting_store
    deferral = pytest.MonkeyPatch()
    try:
        for name, script in [*SCRIPTS.items(), (SMALL_PASSES, SCRIPTS["3 off, tree"])]:
            # rows stay deferred until a draft pass or a batch change, or pass the small limit
            deferral.setattr(proposer, "DEFERRED_BYTES", 2 * _row_bytes(runner) if name == SMALL_PASSES else 2**62)
            stores.clear()
            runner.use_budget_policy(ScriptedBudget(candidate_shapes(BUDGET, runner.drafter.max_depth), script))
            steps.clear()
            draft_heads.clear()
            context_layouts.clear()
            outputs = llm.generate(heldout_code_prompts(), params, use_tqdm=False)
            assert runner.num_chain_fallbacks == 0
            accepted = [int(n) for step in steps for n in step.acceptance.num_accepted]
            runs[name] = {
                "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                "tokens_per_verify_step": sum(accepted) / len(accepted) if accepted else None,
                "draft_passes": len(draft_heads),
                "context_layouts_equal": list(context_layouts),
                "rows_unstored_at_draft_passes": sum(draft_heads),
                "no_draft_metadata_equal": list(metadata_checks),
                "rows_per_store_pass": list(stores),
            }
            metadata_checks.clear()
    finally:
        deferral.undo()
        llm.llm_engine.engine_core.shutdown()
    return runs


def _row_bytes(runner) -> int:
    """Bytes of one deferred context row (its buffers exist once an earlier script has deferred rows)."""
    states = runner.drafter._deferred._states
    assert states is not None
    return states.shape[1] * states.element_size()


def _check_no_draft_spec_metadata(runner) -> list[bool]:
    """Per step without drafts: whether the runner's directly built spec-decode metadata equals vLLM's
    general computation for the same inputs (values and dtypes of every field)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    results = []
    ours = runner._calc_spec_decode_metadata

    def checking(num_draft_tokens, cu_num_scheduled_tokens):
        got = ours(num_draft_tokens, cu_num_scheduled_tokens)
        if not num_draft_tokens.any():
            want = GPUModelRunner._calc_spec_decode_metadata(runner, num_draft_tokens, cu_num_scheduled_tokens)
            same = got.num_draft_tokens == want.num_draft_tokens and got.max_spec_len == want.max_spec_len
            for name in ("draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens", "target_logits_indices",
                         "bonus_logits_indices", "logits_indices"):
                a, b = getattr(got, name), getattr(want, name)
                same = same and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            results.append(same)
        return got

    runner._calc_spec_decode_metadata = checking
    return results


def _check_context_layouts(runner) -> list[bool]:
    """Per step that deferred its context (a step without drafts followed by none): whether the rows it
    deferred sit where DFlash's first pass would store a step without drafts' context
    (`set_inputs_first_pass`: the target's positions, the draft KV cache group's slot mapping), read
    before a store pass can take them (the fixture raises DEFERRED_BYTES)."""
    results = []
    drafter = runner.drafter
    defer = drafter.defer_context

    def checking_defer(parts, count, positions, slots):
        draft_slots = runner.input_batch.block_table[drafter.kv_cache_gid].slot_mapping.gpu[:count]
        results.append(all(part.shape[0] >= count for part in parts) and bool(torch.equal(positions[:count], runner.positions[:count]))
                       and bool(torch.equal(slots[:count], draft_slots)))
        defer(parts, count, positions, slots)

    drafter.defer_context = checking_defer
    return results


def test_off_steps_store_the_context_where_a_full_draft_pass_would(script_runs):
    for name in ("off", "3 off, tree"):
        layouts = script_runs[name]["context_layouts_equal"]
        assert layouts and all(layouts), name


def test_deferred_context_is_stored_before_every_draft_pass(script_runs):
    for name in ("off, tree", "3 off, tree"):
        assert script_runs[name]["draft_passes"] > 0
        assert script_runs[name]["rows_unstored_at_draft_passes"] == 0, name


def test_off_steps_spec_decode_metadata_equals_vllms(script_runs):
    """Steps without drafts that run vLLM's speculative path (those followed by a draft pass) build
    vLLM's spec-decode metadata directly."""
    checks = [ok for run in script_runs.values() for ok in run["no_draft_metadata_equal"]]
    assert len(checks) > 20 and all(checks)


def test_off_steps_do_not_run_the_draft_block_pass(script_runs):
    assert script_runs["off"]["draft_passes"] == 0
    assert script_runs["off"]["tokens_per_verify_step"] is None
    assert script_runs["trees"]["draft_passes"] > 0


def test_outputs_do_not_depend_on_off_steps(script_runs):
    reference = script_runs["trees"]["token_ids"]
    assert all(run["token_ids"] == reference for run in script_runs.values())


@pytest.mark.parametrize("script", ["off, tree", "3 off, tree", SMALL_PASSES])
def test_the_draft_resumes_with_its_whole_context_after_off_steps(script_runs, script):
    trees = script_runs["trees"]["tokens_per_verify_step"]
    after_off = script_runs[script]["tokens_per_verify_step"]
    print(f"tokens per verify step: trees on every step {trees:.2f}, {script}: {after_off:.2f}")
    assert after_off >= 0.95 * trees


def test_small_store_passes_store_every_row_as_one_pass_would(script_runs):
    """With DEFERRED_BYTES at 2 rows, deferred rows are stored in more, smaller passes, and a step with more
    rows at once: the draft reads the same context (trees accept as many tokens, the outputs are the same)."""
    small, large = script_runs[SMALL_PASSES], script_runs["3 off, tree"]
    assert small["token_ids"] == large["token_ids"]
    assert small["tokens_per_verify_step"] >= 0.95 * large["tokens_per_verify_step"]
    assert max(small["rows_per_store_pass"]) > 2  # a step's rows beyond the limit, stored at once
    assert len(small["rows_per_store_pass"]) > len(large["rows_per_store_pass"])
