"""Method 'ddtree' on vLLM's V2 model runner under tensor parallelism 2 (multiprocess executor, one core per
rank): every rank builds its trees from TP rank 0's draft top-K and tree shape and takes TP rank 0's tokens
(`vllm_ddtree.vllm.rank_zero`, docs/v2_runner.md D15), so every rank walks the same paths, compacts its own
K/V shard alike and commits the same tokens.

One V2 engine at TP=2 (the default adaptive policy) serves four batches: greedy under the default policy;
greedy under a scripted policy that chooses the full tree at every step (a fixed budget); a seeded T > 0
request beside an unseeded one and a greedy one; and greedy again with rank 1's target and draft logits
negated (the power check: rank 1 must still build rank 0's trees and commit rank 0's tokens). A recorder on every worker (`LLM.collective_rpc`)
keeps each rank's steps (shape, trees, sampled rows, accepted paths); the ranks' records must be equal.
Baselines in the same child: V1 plain decoding (greedy must equal it) and V1 ddtree at a fixed budget (the
seeded request's draws are keyed by (seed, position), so its tokens must equal V1's).

vLLM's CPU platform spawns the TP workers: `spawned/sitecustomize.py` registers the Triton stand-in in them.
Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.v2.engines import BUDGET, CHUNK, MAX_TOKENS, PROMPT_LENGTHS, ddtree, run  # noqa: E402

SPAWNED = Path(__file__).resolve().parent / "spawned"
REPO = Path(__file__).resolve().parents[2]
SAMPLED = [{"temperature": 0.8, "seed": 1}, {"temperature": 1.0}, {"temperature": 0.0}]  # seeded, unseeded, greedy


def _install_recorder(worker: Any) -> None:
    """Every rank: record each `sample` call as (shape, tree tokens, parents, sampled rows, accepted nodes);
    a step vLLM's sampler drew (no drafts) has its shape and sampled rows only."""
    runner = worker.model_runner
    runner.recorded_steps = []
    sample = runner.sample

    def recording_sample(*args: Any, **kwargs: Any) -> Any:
        result = sample(*args, **kwargs)
        step, sampled = runner.step, result[0].sampled_token_ids.tolist()
        shape = (runner._step_shape.budget, runner._step_shape.topk)
        if step is None or step.acceptance is None:
            runner.recorded_steps.append((shape, None, None, sampled, None))
        else:
            runner.recorded_steps.append((shape, step.tree.token_ids.tolist(), step.tree.parents.tolist(), sampled,
                                          step.acceptance.accepted_nodes.tolist()))
        return result

    runner.sample = recording_sample


def _take_recorded(worker: Any) -> tuple[list, int]:
    """Every rank: its recorded steps since the last call, and its chain fallbacks (expected 0)."""
    runner = worker.model_runner
    steps, runner.recorded_steps = runner.recorded_steps, []
    return steps, runner.num_chain_fallbacks


def _script_fixed_tree(worker: Any) -> None:
    """Every rank: a tree of BUDGET nodes at every step from now on."""
    from tests.e2e.scripted_budget import ScriptedBudget
    from vllm_ddtree.core import TreeShape, candidate_shapes

    runner = worker.model_runner
    runner.use_budget_policy(ScriptedBudget(candidate_shapes(BUDGET, runner.speculator.depth), [TreeShape(BUDGET, None)]))


def _negate_rank_one_logits(worker: Any) -> None:
    """Rank 1 only: its target's and its draft's logits negated (after their collectives), so that its own
    top-K, argmaxes and draws would build other trees and commit other tokens than rank 0's."""
    from vllm.distributed import get_tp_group

    if get_tp_group().rank_in_group != 1:
        return
    runner = worker.model_runner
    target_logits, draft_logits = runner.model.compute_logits, runner.speculator.compute_draft_logits
    runner.model.compute_logits = lambda *args, **kwargs: -target_logits(*args, **kwargs)
    runner.speculator.compute_draft_logits = lambda *args, **kwargs: -draft_logits(*args, **kwargs)


def _generate(llm: Any, params: Any) -> tuple[list[list[int]], list[list]]:
    """Token ids per prompt, and each rank's recorded steps."""
    from tests.e2e.conftest import heldout_code_prompts

    outputs = llm.generate(heldout_code_prompts(PROMPT_LENGTHS), params, use_tqdm=False)
    ranks = llm.collective_rpc(_take_recorded)
    assert len(ranks) == 2 and all(fallbacks == 0 for _, fallbacks in ranks)
    return [list(o.outputs[0].token_ids) for o in outputs], [steps for steps, _ in ranks]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm import LLM, SamplingParams, envs

    from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
    from vllm_ddtree.demo import demo_pair_paths

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options) for options in SAMPLED]
    out: dict[str, Any] = {"v1 plain": run("v1", None).token_ids, "v1 sampled": run("v1", ddtree(), params=sampled).token_ids}
    with pytest.MonkeyPatch.context() as mp:
        envs.disable_envs_cache()  # the in-process engines above may have frozen vLLM's env reads
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with this module's functions
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SPAWNED), str(REPO), os.environ.get("PYTHONPATH")])))
        llm = LLM(model=demo_pair_paths()[0], speculative_config=ddtree(ddtree_adaptive=True), skip_tokenizer_init=True,
                  dtype="float32", enforce_eager=True, tensor_parallel_size=2, distributed_executor_backend="mp",
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK,
                  max_num_seqs=8, seed=0)
        try:
            llm.collective_rpc(_install_recorder)
            out["v2 default"] = _generate(llm, greedy)
            llm.collective_rpc(_script_fixed_tree)
            out["v2 fixed"] = _generate(llm, greedy)
            out["v2 sampled"] = _generate(llm, sampled)
            llm.collective_rpc(_negate_rank_one_logits)
            out["v2 rank 1 negated"] = _generate(llm, greedy)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return out


def _verified(steps: list) -> list:
    """The steps that verified trees (accepted nodes recorded)."""
    return [step for step in steps if step[4] is not None]


def _deepest_path(steps: list) -> int:
    """Nodes on the longest accepted path of any request in any step, root included."""
    return max(sum(node >= 0 for node in path) for step in _verified(steps) for path in step[4])


def test_greedy_under_the_default_policy_equals_plain_and_ranks_agree(runs):
    token_ids, (rank0, rank1) = runs["v2 default"]
    assert token_ids == runs["v1 plain"]
    assert rank0 == rank1 and _verified(rank0)


def test_greedy_fixed_trees_equal_plain_and_ranks_agree(runs):
    token_ids, (rank0, rank1) = runs["v2 fixed"]
    assert token_ids == runs["v1 plain"]
    assert rank0 == rank1
    verified = _verified(rank0)
    assert verified and all(shape == (BUDGET, None) for shape, *_ in verified)
    assert any(parent != index - 1 for step in verified for parents in step[2] for index, parent in enumerate(parents) if index)  # branching trees
    assert _deepest_path(rank0) > 2  # the trees accepted drafts


def test_a_seeded_sampled_request_equals_v1_and_ranks_agree(runs):
    """The seeded request equals V1 ddtree's token for token and the greedy one plain decoding's; the
    unseeded one was drawn (its own tokens) and both ranks committed the same."""
    token_ids, (rank0, rank1) = runs["v2 sampled"]
    assert token_ids[0] == runs["v1 sampled"][0] and token_ids[2] == runs["v1 plain"][2]
    assert token_ids[0] != runs["v1 plain"][0] and token_ids[1] != runs["v1 plain"][1]  # the power of the equality
    assert len(token_ids[1]) == MAX_TOKENS
    assert rank0 == rank1 and _verified(rank0)


def test_every_rank_commits_rank_zeros_tokens_whatever_its_own_logits(runs):
    """The power of the ranks' agreement above: with rank 1's target and draft logits negated, its trees,
    node tokens and first tokens are still rank 0's, and the output still equals plain decoding."""
    token_ids, (rank0, rank1) = runs["v2 rank 1 negated"]
    assert token_ids == runs["v1 plain"]
    assert rank0 == rank1 and _deepest_path(rank0) > 2
